"""What every benchmark section shares: the quick switch, timing side by side, tables, small models.

Timing rule: the alternatives of one comparison run in the same process, one block each per repeat,
in an order that rotates every repeat (A B C, B C A, C A B, ...), so that drift and the position in
the sequence hit all of them alike. A ratio is taken per repeat (same repeat, same conditions) and
its median over the repeats is reported, with the spread of the per-repeat ratios.
"""
from __future__ import annotations

import os
import random
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

#: BENCH_QUICK=1: fewer repeats and sizes, for a smoke run (about a minute); figures are noisier
QUICK = os.environ.get("BENCH_QUICK") == "1"


class Timer:
    """Seconds taken by a callable. On the CPU with torch on one thread: the CPU time of this thread
    (``time.thread_time``), which leaves out the time other processes take the core, so a busy
    machine does not blur the ratios; with more threads, ``perf_counter``. On a GPU: CUDA events
    (synchronized)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        t0 = clock()
        fn()
        return clock() - t0


def rotate(names: Sequence[str], repeat: int) -> List[str]:
    """The order of repeat ``repeat``: a seeded shuffle. A rotation keeps who runs right before whom
    (with five loops gradaccum always followed the hand loop), so what one loop leaves in the caches
    and the allocator would always fall on the same neighbour; a shuffle spreads it over all."""
    order = list(names)
    random.Random(repeat).shuffle(order)
    return order


def side_by_side(fns: Mapping[str, Callable[[], object]], repeats: int, *,
                 timer: Optional[Timer] = None, warmup: int = 1) -> Dict[str, List[float]]:
    """Seconds per call of each function, ``repeats`` samples each, order rotated every repeat."""
    timer = timer or Timer(torch.device("cpu"))
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in rotate(names, r):
            samples[name].append(timer(fns[name]))
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(samples: Mapping[str, List[float]], num: str, den: str) -> Dict[str, float]:
    """Median and interquartile range of the per-repeat ratios ``num / den``."""
    ratios = sorted(a / b for a, b in zip(samples[num], samples[den]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2]}


def table(rows: Sequence[Mapping[str, object]], cols: Sequence[str], fmt: Optional[Mapping[str, str]] = None,
          headers: Optional[Mapping[str, str]] = None) -> str:
    fmt, headers = fmt or {}, headers or {}
    out = ["| " + " | ".join(headers.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else format(v, fmt.get(c, "")) if not isinstance(v, str) else v)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def machine() -> Dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: Dict[str, object] = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
                               "python": platform.python_version(), "threads": torch.get_num_threads(),
                               "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        info["load_average_at_start"] = os.getloadavg()[0]
    except OSError:
        pass
    for name in ("accelerate", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


# -- the models and data of the overhead benchmark ------------------------------------------------

def mlp(width: int = 512, d_in: int = 784, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def ce(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def data(n: int, d_in: int = 784, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, 10, (n,), generator=g)


def sgd(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


_ACCELERATOR = None


def accelerator(num_steps: int, *, cpu: bool = True):
    """One Accelerator for the process (Accelerate keeps process-wide state, so the first call's
    ``cpu`` holds), set to ``num_steps`` and realigned to the start of a window; None when
    Accelerate is not installed. The CUDA section runs in a process of its own for that reason."""
    global _ACCELERATOR
    try:
        from accelerate import Accelerator
    except ImportError:
        return None
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator(gradient_accumulation_steps=num_steps, cpu=cpu)
    # the Trainer shares Accelerate's gradient state and sets it to 1 step: set it back every time
    _ACCELERATOR.gradient_accumulation_steps = num_steps
    _ACCELERATOR.gradient_state.plugin_kwargs.update(sync_with_dataloader=False)
    _ACCELERATOR.step = 0
    return _ACCELERATOR


def between_markers(text: str, start: str, end: str, body: str) -> str:
    """``text`` with what stands between the markers ``start`` and ``end`` replaced by ``body`` (the
    markers kept); a text without them gets the marked block appended. How ``make bench`` writes the
    tables a guide quotes, so that a page's figures are the last run's."""
    import re

    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        return re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    return text + block + "\n"


class Count:
    """Collectives issued from Python (``torch.distributed``'s and DTensor's functional ones, e.g. an
    FSDP2 norm; DDP's buckets run in C++ and are not seen) and host syncs, while active."""

    NAMES = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor")

    def __enter__(self) -> "Count":
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self.collectives = self.syncs = 0
        self.saved = [(dist, n, getattr(dist, n)) for n in self.NAMES]
        self.saved += [(funcol, n, getattr(funcol, n)) for n in ("all_reduce", "all_gather_tensor")]
        self.saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in ("item", "tolist", "cpu")]
        for owner, name, fn in self.saved:
            setattr(owner, name, self.wrap(fn, owner is not torch.Tensor))
        return self

    def wrap(self, fn: Callable, collective: bool) -> Callable:
        def f(*a, **k):  # type: ignore[no-untyped-def]
            if collective:
                self.collectives += 1
            else:
                self.syncs += 1
            return fn(*a, **k)
        return f

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)


def torchrun(script: Path, *args: str, timeout: int = 600,
             env: Optional[Mapping[str, str]] = None) -> "subprocess.CompletedProcess[str]":
    """``script args...`` under torchrun, 2 gloo processes (``--standalone``: torchrun picks a free port),
    this checkout's ``src`` first on the path, one thread each, ``env`` added; its output captured. (Not the tests'
    ``distributed.launch``: under run.py the name ``distributed`` is benchmarks/distributed.py.)"""
    import subprocess

    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), BENCH_QUICK="1" if QUICK else "0",
                **(env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), *args], capture_output=True, text=True, env=full, timeout=timeout)
