"""gradaccum benchmarks (`make bench`): writes docs/benchmarks.md and its plots.

Every figure is a median over repeats and a ratio against a baseline measured in the same run, with
the alternatives alternated (A, B, C, A, B, C, ...) so that drift hits all of them alike.
"""
from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gradaccum import Accumulator  # noqa: E402
from gradaccum.cli.train import MemoryMeter  # noqa: E402

DOCS = ROOT / "docs"
QUICK = os.environ.get("BENCH_QUICK") == "1"
REPEATS = 5 if QUICK else 21


def mlp(width: int = 512, d_in: int = 784) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def ce(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def data(n: int, d_in: int = 784):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d_in, generator=g), torch.randint(0, 10, (n,), generator=g)


def alternate(fns: Dict[str, Callable[[], None]], repeats: int = REPEATS) -> Dict[str, float]:
    for fn in fns.values():  # warm-up
        fn()
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    # rotate the order every repeat: on this machine the position in the sequence alone moved
    # timings by up to 50% (a first run of 1.16x "overhead" was that), so each runs in each place
    for i in range(repeats * len(names)):
        shift = i // len(names)
        name = names[(i + shift) % len(names)]
        t0 = time.perf_counter()
        fns[name]()
        samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


# 1 ------------------------------------------------------------------------------------------
def overhead() -> List[dict]:
    try:
        from accelerate import Accelerator
    except ImportError:
        Accelerator = None  # noqa: N806
    rows = []
    n = 4
    for m in (8, 256):
        window = [data(m)] * n
        models = {k: mlp() for k in ("hand", "gradaccum", "accelerate")}
        opts = {k: torch.optim.SGD(v.parameters(), lr=1e-3) for k, v in models.items()}
        crit = nn.CrossEntropyLoss()

        def hand() -> None:  # seed 003's loop: loss / N, backward, step, zero_grad
            model, opt = models["hand"], opts["hand"]
            for x, y in window:
                (crit(model(x), y) / n).backward()
            opt.step()
            opt.zero_grad()

        acc = Accumulator(models["gradaccum"], opts["gradaccum"])
        fns = {"hand": hand, "gradaccum": lambda: acc.step(window, ce)}
        if Accelerator is not None:
            accelerator = Accelerator(gradient_accumulation_steps=n, cpu=True)
            a_model, a_opt = accelerator.prepare(models["accelerate"], opts["accelerate"])

            def accel() -> None:
                for x, y in window:
                    with accelerator.accumulate(a_model):
                        accelerator.backward(crit(a_model(x), y))
                        a_opt.step()
                        a_opt.zero_grad()
            fns["accelerate"] = accel
        t = alternate(fns)
        row = {"micro_batch": m, "N": n, "hand_ms": 1e3 * t["hand"], "gradaccum_ms": 1e3 * t["gradaccum"],
               "ratio_vs_hand": t["gradaccum"] / t["hand"]}
        if "accelerate" in t:
            row.update(accelerate_ms=1e3 * t["accelerate"], ratio_vs_accelerate=t["gradaccum"] / t["accelerate"])
        rows.append(row)
    return rows


# 3 ------------------------------------------------------------------------------------------
def memory() -> List[dict]:
    def conv() -> nn.Module:  # activation-heavy: wide feature maps, few weights
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10))

    rows = []
    for m in (8, 32):
        for n in (1, 4, 16):
            x = torch.randn(m * n, 1, 28, 28)
            y = torch.randint(0, 10, (m * n,))
            model = conv()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            meter = MemoryMeter(torch.device("cpu"))
            Accumulator(model, opt).step((x, y), meter.wrap(ce), micro_batch_size=m)
            acc_peak = meter.peak(model, opt)["peak_memory_bytes"]
            big = conv()
            big_opt = torch.optim.SGD(big.parameters(), lr=1e-3)
            meter2 = MemoryMeter(torch.device("cpu"))
            Accumulator(big, big_opt).step((x, y), meter2.wrap(ce), micro_batch_size=m * n)
            rows.append({"micro_batch": m, "N": n, "accumulated_MiB": acc_peak / 2**20,
                         "one_batch_MiB": meter2.peak(big, big_opt)["peak_memory_bytes"] / 2**20,
                         "grad_buffer_MiB": sum(p.numel() * 4 for p in model.parameters()) / 2**20})
    return rows


# 4 ------------------------------------------------------------------------------------------
def throughput() -> List[dict]:
    rows = []
    for name, width, d_in, batch in (("compute-bound (784-2048-2048-10, B=512)", 2048, 784, 512),
                                     ("weight-bound (4096-1024-1024-10, B=32)", 1024, 4096, 32)):
        x, y = data(batch, d_in)
        fns = {}
        for n in (1, 2, 4, 8, 16, 32):
            if batch % n:
                continue
            model = mlp(width, d_in)
            acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-4))
            fns[n] = (lambda a=acc, m=batch // n: a.step((x, y), ce, micro_batch_size=m))
        t = alternate(fns, repeats=max(3, REPEATS // 3))
        for n, sec in t.items():
            rows.append({"model": name, "N": n, "micro_batch": batch // n, "window_ms": 1e3 * sec,
                         "throughput_vs_one_batch": t[1] / sec})
    return rows


# 5 ------------------------------------------------------------------------------------------
def numerics() -> List[dict]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 16))
    rows = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(4 * n, 64, generator=g), torch.randn(4 * n, 16, generator=g)
        row = {"N": n}
        for label, dtype, accum in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                    ("bf16 + fp32 buffers", torch.bfloat16, torch.float32)):
            model = copy.deepcopy(base).to(dtype)
            ref = copy.deepcopy(model).double()
            nn.functional.mse_loss(ref(x.to(dtype).double()), y.to(dtype).double()).backward()
            captured = {}

            class Capture(torch.optim.SGD):
                def step(self, closure=None, _m=model):
                    captured["g"] = torch.cat([p.grad.double().flatten() for p in _m.parameters()])

            acc = Accumulator(model, Capture(model.parameters(), lr=0.0), accum_dtype=accum)
            acc.step((x.to(dtype), y.to(dtype)), lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1].float()),
                     micro_batch_size=4)
            r = torch.cat([p.grad.flatten() for p in ref.parameters()])
            row[label] = ((captured["g"] - r).norm() / r.norm()).item()
        rows.append(row)
    return rows


# 6 ------------------------------------------------------------------------------------------
def bandwidth() -> float:
    a, b = torch.randn(32 * 2**20), torch.randn(32 * 2**20)
    t = alternate({"add": lambda: a.add_(b)}, repeats=REPEATS)["add"]
    return 3 * a.numel() * 4 / t  # read a, read b, write a


def distributed() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(ROOT / "benchmarks" / "dist_bench.py")],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(lines[-1])


def table(rows: List[dict], cols: List[str], fmt: Dict[str, str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(format(r[c], fmt.get(c, "")) if c in r else "-" for c in cols) + " |")
    return "\n".join(out)


def plot(numeric_rows: List[dict], mem_rows: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["N"] for r in numeric_rows]
    for label in ("fp32", "bf16", "bf16 + fp32 buffers"):
        a.plot(ns, [r[label] for r in numeric_rows], marker="o", label=label)
    a.set(xscale="log", yscale="log", xlabel="micro-batches N", ylabel="relative gradient error vs float64",
          title="Numerics")
    a.legend()
    for m in sorted({r["micro_batch"] for r in mem_rows}):
        rs = [r for r in mem_rows if r["micro_batch"] == m]
        b.plot([r["N"] for r in rs], [r["accumulated_MiB"] for r in rs], marker="o", label=f"accumulate N x {m}")
        b.plot([r["N"] for r in rs], [r["one_batch_MiB"] for r in rs], "--", marker="x", label=f"one batch of N x {m}")
    b.set(xscale="log", yscale="log", xlabel="N", ylabel="peak MiB (estimate)", title="Memory")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "benchmarks.png", dpi=100)


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    DOCS.mkdir(exist_ok=True)
    started = time.time()
    over, mem, thr, num = overhead(), memory(), throughput(), numerics()
    bw = bandwidth()
    dist_res = distributed()
    plot(num, mem)
    params = sum(p.numel() for p in mlp().parameters())
    add_floor_ms = 1e3 * (4 - 1) * 3 * params * 4 / bw
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}")
    doc = f"""# Benchmarks

Measured by `make bench` ({time.time() - started:.0f} s) on: {machine}.
Every figure is a median of repeats, alternatives alternated, and ratios are against a baseline
measured in the same run. Memory on the CPU is the estimate of `gradaccum train` (parameters +
gradients + optimizer state + the largest set of activations saved for backward by one micro-batch);
on CUDA it would be the allocator's peak. No GPU was available for this run.

## 1. Overhead per window (MLP 784-512-512-10, N = 4, SGD)

Goal: at most 1.03x the hand-written loop of seed 003, and no slower than Accelerate's `accumulate()`.
A first version of this benchmark alternated in a fixed order and reported 1.16x at both sizes; the
profile showed gradaccum's own work (norm, scaling, counts) at about 1 ms of a 35 ms window, and
swapping the order moved the same code between 0.999x and 1.04x. The position in the sequence, not
the code, made the difference, so the order now rotates every repeat.

{table(over, ["micro_batch", "hand_ms", "gradaccum_ms", "accelerate_ms", "ratio_vs_hand", "ratio_vs_accelerate"],
       {"hand_ms": ".2f", "gradaccum_ms": ".2f", "accelerate_ms": ".2f", "ratio_vs_hand": ".3f", "ratio_vs_accelerate": ".3f"})}

What gradaccum adds per window: the item count and loss sum kept on the device, one total-norm pass
over the gradient (the non-finite check), one `.tolist()` and one in-place scale of the gradient.

## 2. Distributed (torchrun, 2 processes, gloo, MLP of {dist_res['params'] / 1e6:.1f} M parameters, micro-batch 8)

One reduction per window (`no_sync` until the last micro-batch) against reducing after every micro-batch
(`reduce_every_micro_batch=True`). All-reduces and bytes are counted per window by a DDP comm hook.
Goal: one reduction per window, and at least 1.8x at N = 4.

{table(dist_res['rows'], ["N", "once_s", "every_s", "speedup", "once_allreduces", "every_allreduces", "once_bytes", "every_bytes"],
       {"once_s": ".4f", "every_s": ".4f", "speedup": ".2f"})}

Floor: one all-reduce of the whole gradient ({dist_res['params'] * 4 / 2**20:.1f} MiB) takes
{1e3 * dist_res['allreduce_s']:.1f} ms here, so reducing every micro-batch costs at least (N - 1) x that
more per window; the measured difference `every_s - once_s` is compared with it below.

{table([{"N": r["N"], "measured_extra_ms": 1e3 * (r["every_s"] - r["once_s"]), "floor_ms": 1e3 * (r["N"] - 1) * dist_res["allreduce_s"]} for r in dist_res["rows"]],
       ["N", "measured_extra_ms", "floor_ms"], {"measured_extra_ms": ".1f", "floor_ms": ".1f"})}

## 3. Memory (activation-heavy conv net, 28x28 inputs)

{table(mem, ["micro_batch", "N", "accumulated_MiB", "one_batch_MiB", "grad_buffer_MiB"],
       {"accumulated_MiB": ".2f", "one_batch_MiB": ".2f", "grad_buffer_MiB": ".3f"})}

Accumulating N x m costs what one micro-batch of m costs plus the gradient buffer, whatever N is;
one batch of N x m grows with N.

## 4. Accumulation against one big batch, both fitting in memory

{table(thr, ["model", "N", "micro_batch", "window_ms", "throughput_vs_one_batch"],
       {"window_ms": ".2f", "throughput_vs_one_batch": ".3f"})}

When both fit, accumulation only costs: smaller matrix products use the cores less well, and each
micro-batch reads every weight again. A weight-bound model (small batch, large matrices) loses most
as N grows, since its cost per micro-batch is reading the weights; a compute-bound one keeps its
throughput until micro-batches get small. Accumulate to fit memory, not for speed.

## 5. Numerics: relative gradient error against float64 (micro-batches of 4 items)

{table(num, ["N", "fp32", "bf16", "bf16 + fp32 buffers"], {"fp32": ".2e", "bf16": ".2e", "bf16 + fp32 buffers": ".2e"})}

Plain bf16 accumulation rounds the running sum to 8 bits of mantissa N times, so its error grows with
N; with `accum_dtype=torch.float32` the sum is kept in float32 and rounded once, and the error stays flat.

## 6. The floor

Memory bandwidth measured here (`a += b` on 128 MiB): {bw / 1e9:.1f} GB/s. Accumulating the MLP of
section 1 ({params / 1e6:.2f} M parameters) over N = 4 needs 3 gradient additions of 3 x 4 bytes per
parameter: {add_floor_ms:.3f} ms per window, against windows of
{over[0]['gradaccum_ms']:.2f} ms (micro-batch 8) and {over[-1]['gradaccum_ms']:.2f} ms (micro-batch 256).
The adds are free on the scale of the window; the overhead that remains is per-window bookkeeping.

![numerics and memory](benchmarks.png)

Raw numbers: `docs/benchmarks.json`.
"""
    (DOCS / "benchmarks.md").write_text(doc)
    (DOCS / "benchmarks.json").write_text(json.dumps({"overhead": over, "distributed": dist_res, "memory": mem,
                                                       "throughput": thr, "numerics": num, "bandwidth_Bps": bw},
                                                      indent=2))
    print(doc)


if __name__ == "__main__":
    main()
