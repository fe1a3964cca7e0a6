"""Section 7, CUDA only: the same measurements on a GPU, plus fp16 (GradScaler) and bf16.

run.py starts this file as a process of its own when ``torch.cuda.is_available()`` (Accelerate keeps
process-wide state: its Accelerator here uses the GPU, the one of the CPU sections does not). Timing
uses CUDA events; memory is ``PeakMeter("cuda")``, i.e. ``torch.cuda.max_memory_allocated``. It
prints one JSON line. ``python benchmarks/cuda_bench.py --device cpu`` runs the same code on the CPU
in a minute, to check the code path on a machine without a GPU (its figures mean nothing).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Callable, Dict, List, Optional

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from common import QUICK, Timer, median, rotate  # noqa: E402
from memory_bench import memory  # noqa: E402
from overhead import overhead  # noqa: E402
from transformer import LR, STEPS, TextWindows, TinyLM, _flat, gpt2, lm_loss, reference  # noqa: E402

from gradaccum import Accumulator  # noqa: E402
from gradaccum.memory import PeakMeter  # noqa: E402

PRECISIONS = ("fp32", "fp16", "bf16")
NS = (1, 4) if QUICK else (1, 4, 16)
REPEATS = 3 if QUICK else 7
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _hand(model: nn.Module, windows: List[list], precision: str, device: torch.device) -> Callable[[int, int], None]:
    """The hand loop with torch.autocast and, for fp16, a GradScaler: loss / N per micro-batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def run(a: int, b: int) -> None:
        for w in range(a, b):
            for mb in windows[w]:
                with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = lm_loss(model, mb)[0] / len(windows[w])
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return run


def _ours(model: nn.Module, windows: List[list], precision: str) -> Callable[[int, int], None]:
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), precision=precision)

    def run(a: int, b: int) -> None:
        for w in range(a, b):
            acc.step(windows[w], lm_loss)
    return run


def precision_rows(device: torch.device) -> List[dict]:
    """Tokens per second, peak memory and distance from a float64 big batch, per precision."""
    data = TextWindows(device)
    timer = Timer(device)
    rows = []
    for label, base in (("TinyTransformer", TinyLM()), ("GPT-2 (tiny)", gpt2())):
        if base is None:
            continue
        base = base.to(device)
        for n in NS:
            w = max(2, 32 // n)
            windows = [data.window(i, n) for i in range(w + 1)]
            tokens = data.tokens([mb for win in windows[1:] for mb in win]) / w
            theta0, ref = _flat(base), reference(base, data, n)
            runs: Dict[str, Callable[[int, int], None]] = {}
            result: Dict[str, dict] = {}
            for precision in PRECISIONS:
                for method in ("gradaccum", "hand"):
                    key = f"{method}/{precision}"
                    make: Callable[[nn.Module], Callable[[int, int], None]] = (
                        (lambda m, p=precision: _ours(m, windows, p)) if method == "gradaccum"
                        else (lambda m, p=precision: _hand(m, windows, p, device)))
                    model = copy.deepcopy(base)
                    make(model)(0, STEPS)  # distance: STEPS windows from the initial weights
                    dist = float((_flat(model) - ref).norm() / (ref - theta0).norm())
                    model = copy.deepcopy(base)
                    runs[key] = make(model)
                    runs[key](0, 1)  # warm-up
                    with PeakMeter(device) as meter:
                        runs[key](1, 2)
                    result[key] = {"distance": dist, "peak_MiB": meter.result.peak_bytes / 2**20}
            samples: Dict[str, List[float]] = {k: [] for k in runs}
            for r in range(REPEATS):
                for key in rotate(list(runs), r):
                    samples[key].append(timer(lambda f=runs[key]: f(1, w + 1)) / w)
            for key, s in samples.items():
                method, precision = key.split("/")
                hand = samples[f"hand/{precision}"]
                rows.append({"model": label, "N": n, "precision": precision, "method": method,
                             "tokens_per_s": tokens / median(s), "window_ms": 1e3 * median(s),
                             "time_vs_hand": median([a / b for a, b in zip(s, hand)]), **result[key]})
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the code path")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu to check the code path")
    torch.set_num_threads(1)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (code-path check)",
           "overhead": overhead(device), "memory": memory(device=device), "precision": precision_rows(device)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
