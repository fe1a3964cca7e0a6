"""Section 3: memory, measured by ``gradaccum.memory.PeakMeter`` (the allocator's own figures).

For N x m items accumulated in N micro-batches of m, the peak the step adds to memory should be
that of one micro-batch of m plus the gradient buffer (the N = 1 row), whatever N is: goal at most
1.1x of it up to N = 16. One batch of N x m grows with N. The old estimate (gradients + the largest
set of activations one micro-batch saves for backward) is shown beside the measurement. Then what
measuring costs: a window timed with and without the meter, side by side.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from common import QUICK, ce, median, paired_ratio, side_by_side, sgd
from overhead import loops

from gradaccum import Accumulator
from gradaccum.memory import PeakMeter, state_bytes

GOAL = 1.1
NS: Sequence[int] = (1, 4, 16) if QUICK else (1, 2, 4, 8, 16)
REPEATS = 4 if QUICK else 12


def conv() -> nn.Module:
    """Activation-heavy: wide 28x28 feature maps, few weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10))


def _estimate(model: nn.Module, opt: torch.optim.Optimizer, batch, m: int) -> Optional[int]:
    """The command line's estimate, less what exists before the step (parameters, optimizer state)."""
    try:
        from gradaccum.cli.train import MemoryMeter  # the estimate `gradaccum train` reported so far
    except ImportError:
        return None
    meter = MemoryMeter(torch.device("cpu"))
    if not hasattr(meter, "wrap"):
        return None
    Accumulator(model, opt).step(batch, meter.wrap(ce), micro_batch_size=m)
    return state_bytes(model)["gradients"] + int(meter.peak_activations)


def memory(sizes: Sequence[int] = (8, 32), device: torch.device = torch.device("cpu")) -> List[dict]:
    rows = []
    for m in sizes:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(max(NS) * m, 1, 28, 28, generator=g), torch.randint(0, 10, (max(NS) * m,), generator=g)
        x, y = x.to(device), y.to(device)
        reference = None
        for n in NS:
            batch = (x[:n * m], y[:n * m])
            model = conv().to(device)
            opt = sgd(model)
            acc = Accumulator(model, opt)
            acc.step(batch, ce, micro_batch_size=m)  # the optimizer's state exists from here on
            with PeakMeter(device) as meter:
                acc.step(batch, ce, micro_batch_size=m)
            accumulated = meter.result
            with PeakMeter(device) as meter:
                acc.step(batch, ce, micro_batch_size=n * m)  # one batch of N x m
            one_batch = meter.result.peak_bytes
            if n == 1:
                reference = accumulated.peak_bytes
            assert reference is not None
            rows.append({"micro_batch": m, "N": n, "accumulated_MiB": accumulated.peak_bytes / 2**20,
                         "reference_MiB": reference / 2**20, "ratio": accumulated.peak_bytes / reference,
                         "goal": GOAL, "met": "yes" if accumulated.peak_bytes <= GOAL * reference else "no",
                         "one_batch_MiB": one_batch / 2**20, "allocations": accumulated.allocations,
                         "grad_buffer_MiB": state_bytes(model)["gradients"] / 2**20,
                         "estimate_MiB": None})
            if device.type == "cpu":
                fresh = conv()
                est = _estimate(fresh, sgd(fresh), batch, m)
                rows[-1]["estimate_MiB"] = None if est is None else est / 2**20
    return rows


def meter_cost(sizes: Sequence[int] = (8, 256)) -> List[dict]:
    """A gradaccum window (MLP of section 1) with and without the meter, side by side; and the meter's
    own price, from regions whose work is nothing but allocations (a difference of two training
    windows would drown it in their noise)."""
    empty_region = 1000

    def allocate() -> None:
        for _ in range(empty_region):
            t = torch.empty(64)
            del t

    def measured_allocate() -> None:
        with PeakMeter("cpu"):
            allocate()

    def empty() -> None:
        with PeakMeter("cpu"):
            pass

    own = side_by_side({"allocate": allocate, "measured": measured_allocate, "empty": empty}, 2 * REPEATS)
    fixed = median(own["empty"])
    per_allocation = max(0.0, median(own["measured"]) - median(own["allocate"]) - fixed) / empty_region
    rows = []
    for m in sizes:
        run = loops(m)["gradaccum"]
        counts: Dict[str, int] = {}

        def measured() -> None:
            with PeakMeter("cpu") as meter:
                run()
            counts["allocations"] = meter.result.allocations

        def full_profiler() -> None:  # what torch.profiler.profile(profile_memory=True) would cost
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
                run()

        s = side_by_side({"plain": run, "measured": measured, "full_profiler": full_profiler}, REPEATS)
        rows.append({"micro_batch": m, "window_ms": 1e3 * median(s["plain"]), "measured_ms": 1e3 * median(s["measured"]),
                     "ratio": paired_ratio(s, "measured", "plain")["ratio"], "allocations": counts["allocations"],
                     "predicted_ms": 1e3 * (fixed + counts["allocations"] * per_allocation),
                     "start_stop_ms": 1e3 * fixed, "us_per_allocation": 1e6 * per_allocation,
                     "full_profiler_ratio": paired_ratio(s, "full_profiler", "plain")["ratio"]})
    return rows
