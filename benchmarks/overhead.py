"""Section 1: what gradaccum costs per window against the loops people write by hand, and where.

MLP 784-512-512-10, N = 4 micro-batches, SGD with momentum, one thread. Side by side in one run:
the hand loop (``loss / N``, backward, step, zero_grad) against ``Accumulator`` defaults; the same
loop plus ``clip_grad_norm_(1.0)`` against ``Accumulator(max_grad_norm=1.0)``; Accelerate's
``accumulate()``. Then a cProfile of gradaccum's windows at micro-batch 8, by call.
"""
from __future__ import annotations

import cProfile
import os
import pstats
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from common import QUICK, ROOT, Timer, accelerator, ce, data, median, mlp, paired_ratio, sgd, side_by_side

from gradaccum import Accumulator

N = 4
REPEATS = 4 if QUICK else 24
#: windows per timed block: a block of a few tens of milliseconds is above the timer's noise
BLOCK = {8: 8, 256: 2}
#: the goals of issue #13, per micro-batch size: (bare, with clipping)
GOALS = {8: (1.03, 1.01), 256: (1.02, 1.02)}
METHODS = ("hand", "gradaccum", "hand_clip", "gradaccum_clip", "accelerate")


def hand_loop(window, clip: bool, device: torch.device = torch.device("cpu")) -> Callable[[], None]:
    """The baseline: one window as people write it, each micro-batch's mean over N backpropagated, then
    (with ``clip``) the norm clipped to 1, the step and the zeroing; on a fresh model."""
    model = mlp().to(device)
    opt = sgd(model)
    crit = nn.CrossEntropyLoss()

    def run() -> None:
        for xb, yb in window:
            (crit(model(xb), yb) / N).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return run


def loops(m: int, device: torch.device = torch.device("cpu")) -> Dict[str, Callable[[], None]]:
    """One window of each method, on models with the same initial weights and the same data."""
    x, y = data(N * m)
    window = [(x[i * m:(i + 1) * m].to(device), y[i * m:(i + 1) * m].to(device)) for i in range(N)]
    crit = nn.CrossEntropyLoss()
    fns: Dict[str, Callable[[], None]] = {}

    def ours(clip: bool) -> Callable[[], None]:
        model = mlp().to(device)
        acc = Accumulator(model, sgd(model), max_grad_norm=1.0 if clip else None)
        return lambda: acc.step(window, ce)

    fns["hand"], fns["gradaccum"] = hand_loop(window, False, device), ours(False)
    fns["hand_clip"], fns["gradaccum_clip"] = hand_loop(window, True, device), ours(True)
    accel = accelerator(N, cpu=device.type == "cpu")
    if accel is not None:
        model = mlp().to(device)
        a_model, a_opt = accel.prepare(model, sgd(model))

        def accelerate() -> None:
            for xb, yb in window:
                with accel.accumulate(a_model):
                    accel.backward(crit(a_model(xb), yb))
                    a_opt.step()
                    a_opt.zero_grad()
        fns["accelerate"] = accelerate
    return fns


def overhead(device: torch.device = torch.device("cpu"), sizes: Tuple[int, ...] = (8, 256)) -> List[dict]:
    rows = []
    timer = Timer(device)
    for m in sizes:
        fns = loops(m, device)
        block = BLOCK.get(m, 2)
        blocks = {k: (lambda f=f: [f() for _ in range(block)]) for k, f in fns.items()}
        s = side_by_side(blocks, REPEATS, timer=timer)
        row: Dict[str, object] = {"micro_batch": m, "N": N, "repeats": REPEATS, "windows_per_block": block}
        for k, v in s.items():
            row[f"{k}_ms"] = 1e3 * median(v) / block
        for label, num, den in (("bare", "gradaccum", "hand"), ("clip", "gradaccum_clip", "hand_clip"),
                                ("accelerate", "accelerate", "hand")):
            if num in s:
                r = paired_ratio(s, num, den)
                row[f"{label}_ratio"], row[f"{label}_q1"], row[f"{label}_q3"] = r["ratio"], r["q1"], r["q3"]
        if "accelerate" in s:
            row["vs_accelerate_ratio"] = paired_ratio(s, "gradaccum", "accelerate")["ratio"]
        goal_bare, goal_clip = GOALS.get(m, (None, None))
        row["goal_bare"], row["goal_clip"] = goal_bare, goal_clip
        if goal_bare is not None:
            row["bare_met"] = "yes" if row["bare_ratio"] <= goal_bare else "no"
            row["clip_met"] = "yes" if row["clip_ratio"] <= goal_clip else "no"
        rows.append(row)
    return rows


# -- where gradaccum's extra time goes ---------------------------------------------------------

SRC = str(ROOT / "src" / "gradaccum") + os.sep


def _common_work(func: Tuple[str, int, str]) -> bool:
    """What the hand loop does as well: the user's loss (forward), the backward, the optimizer."""
    path, _, name = func
    return (path.startswith(str(ROOT / "benchmarks"))
            or (path.endswith(os.path.join("torch", "_tensor.py")) and name == "backward")
            or os.path.join("torch", "optim") in path)


def _short(func: Tuple[str, int, str]) -> str:
    path, _, name = func
    if path == "~":  # a builtin: "<method 'to' of 'torch._C.TensorBase' objects>", "<built-in method torch.cat>"
        if name.startswith("<method '"):
            owner = name.split(" of '")[1].split("'")[0].split(".")[-1].replace("TensorBase", "Tensor")
            return f"{owner}.{name.split(chr(39))[1]}"
        return name.replace("<built-in method ", "").rstrip(">")
    return f"{os.path.basename(path)}:{name}"


def profile(m: int = 8, windows: int = 0) -> Dict[str, object]:
    """cProfile gradaccum's windows; for each gradaccum function, its own Python time plus what it
    calls outside gradaccum, less the work the hand loop shares (loss, backward, optimizer step)."""
    windows = windows or (50 if QUICK else 200)
    fns = loops(m)
    run = fns["gradaccum"]
    for _ in range(10):
        run()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(windows):
        run()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    per: Dict[Tuple[str, int, str], Dict[str, object]] = {}
    total_profiled = 0.0
    for func, (_, nc, tt, ct, callers) in stats.items():
        if func[2] == "step" and func[0].startswith(SRC) and func[0].endswith("accumulator.py"):
            total_profiled = max(total_profiled, ct)
        if func[0].startswith(SRC):
            entry = per.setdefault(func, {"calls": 0, "seconds": 0.0, "callees": {}})
            entry["calls"] = nc
            entry["seconds"] = float(entry["seconds"]) + tt  # type: ignore[arg-type]
        if func[0].startswith(SRC) or _common_work(func):
            continue
        for caller, (_, cnc, _, cct) in callers.items():
            if caller[0].startswith(SRC):
                entry = per.setdefault(caller, {"calls": 0, "seconds": 0.0, "callees": {}})
                entry["seconds"] = float(entry["seconds"]) + cct  # type: ignore[arg-type]
                callees: Dict[str, float] = entry["callees"]  # type: ignore[assignment]
                callees[_short(func)] = callees.get(_short(func), 0.0) + cct
    rows = []
    for func, e in per.items():
        callees = sorted(e["callees"].items(), key=lambda kv: -kv[1])[:3]  # type: ignore[union-attr]
        rows.append({"function": _short(func), "calls_per_window": int(e["calls"]) / windows,  # type: ignore[arg-type]
                     "ms_per_window": 1e3 * float(e["seconds"]) / windows,  # type: ignore[arg-type]
                     "calls_outside": ", ".join(f"{name} {1e3 * t / windows:.3f}" for name, t in callees)})
    rows.sort(key=lambda r: -r["ms_per_window"])  # type: ignore[operator]
    return {"micro_batch": m, "windows": windows, "rows": rows,
            "extra_ms_per_window": sum(r["ms_per_window"] for r in rows),  # type: ignore[misc]
            "profiled_window_ms": 1e3 * total_profiled / windows}


# -- this tree against another commit's (python benchmarks/overhead.py --against DIR) -------------------

def bytecodes_per_window(run: Callable[[], None], package_dir: str, windows: int = 20) -> float:
    """Python bytecodes executed per window inside ``package_dir``: gradaccum's own work, counted, so it
    does not move with the machine's load as a time does (3.11: ``sys.settrace`` opcode events)."""
    import sys
    count = [0]

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        if not frame.f_code.co_filename.startswith(package_dir):
            return None
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            count[0] += 1
        return tracer
    sys.settrace(tracer)
    try:
        for _ in range(windows):
            run()
    finally:
        sys.settrace(None)
    return count[0] / windows


def against(other_src: str, m: int = 8, repeats: int = 40, clip: bool = False) -> Dict[str, object]:
    """Section 1's window at micro-batch ``m``: this tree's gradaccum against another's (``other_src``: the
    ``src`` of another commit, e.g. ``git archive <commit> src | tar -x -C /tmp/old``, then
    ``/tmp/old/src``), beside the hand loop, in one process (the other imported under another name), the
    order shuffled every repeat. Median per-repeat ratios with their quartiles, and bytecodes per window."""
    import importlib
    import shutil
    import sys
    import tempfile

    tmp = tempfile.mkdtemp()
    shutil.copytree(os.path.join(other_src, "gradaccum"), os.path.join(tmp, "gradaccum_other"))
    sys.path.insert(0, tmp)
    other = importlib.import_module("gradaccum_other")  # its imports are relative: a package of its own
    x, y = data(N * m)
    window = [(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) for i in range(N)]
    def ours(package) -> Callable[[], None]:  # type: ignore[no-untyped-def]
        model = mlp()
        acc = package.Accumulator(model, sgd(model), max_grad_norm=1.0 if clip else None)
        return lambda: acc.step(window, ce)

    fns = {"hand": hand_loop(window, clip), "this tree": ours(sys.modules["gradaccum"]), "other": ours(other)}
    block = BLOCK.get(m, 2)
    s = side_by_side({k: (lambda f=f: [f() for _ in range(block)]) for k, f in fns.items()}, repeats)
    out: Dict[str, object] = {"micro_batch": m, "clip": clip, "repeats": repeats, "windows_per_block": block}
    for num, den in (("this tree", "hand"), ("other", "hand"), ("this tree", "other")):
        r = paired_ratio(s, num, den)
        out[f"{num} / {den}"] = f"{r['ratio']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})"
    out["ms per window"] = {k: round(1e3 * median(v) / block, 3) for k, v in s.items()}
    out["bytecodes per window"] = {
        "this tree": bytecodes_per_window(fns["this tree"], str(ROOT / "src" / "gradaccum") + os.sep),
        "other": bytecodes_per_window(fns["other"], os.path.join(tmp, "gradaccum_other") + os.sep)}
    return out


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=against.__doc__)
    parser.add_argument("--against", required=True, help="the src directory of another gradaccum")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--clip", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(against(args.against, args.micro_batch, args.repeats, args.clip)))
