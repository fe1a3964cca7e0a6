"""Peak memory of a run, for ``summary.json``: what the run measured, and how.

CUDA: the allocator's peak over the whole run. CPU: the allocator's events of one window (the third
this process runs: optimizer state exists and DDP has rebuilt its buckets; the last, in a shorter run
of one process), measured by :class:`~gradaccum.memory.PeakMeter`, plus the parameters and optimizer
state held before it (a shorter run under DDP is not measured: the profiler cannot attribute what
DDP's first two windows free, and said so in a C++ warning). On the
CPU rank 0 alone measures: the ranks run the same windows, and the profiler on the other ranks of a
gloo group printed a C++ warning per rank (``CPUAllocator.cpp ... Memory block of unknown size``).
Measuring never stops a run: where the profiler fails, the summary says it was not measured, and why.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional

import torch
from torch import nn

from .. import sync
from ..memory import PeakMeter, state_bytes

__all__ = ["RunMemory"]


class RunMemory:
    """Measure window ``measure_at`` (counted from 0 in this process) with :meth:`window`."""

    def __init__(self, device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 measure_at: int, sharded: bool = False) -> None:
        self.device = device
        self.model = model
        self.optimizer = optimizer
        self.measure_at = measure_at
        self.window_peak: Optional[int] = None
        self.held = 0
        self.failure: Optional[str] = None
        if sharded and device.type == "cpu":  # its frees of earlier windows' buffers are unattributable
            self.failure = ("FSDP2 frees buffers of earlier windows inside each window, which the CPU "
                            "profiler cannot attribute; run without --shard to measure")
        elif 0 <= measure_at < 2 and device.type == "cpu" and isinstance(model, nn.parallel.DistributedDataParallel):
            self.failure = ("under DDP a process's first two windows free blocks allocated before them (DDP's first "
                            "iteration, its bucket rebuild), which the CPU profiler cannot attribute; a process that "
                            "runs 3 windows or more measures its third")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def window(self, index: int) -> Iterator[None]:
        """Around the ``index``-th window this process runs; measures the one at ``measure_at``."""
        meter = None
        if (index == self.measure_at and self.device.type == "cpu" and self.window_peak is None
                and self.failure is None and sync.is_rank_zero()):
            held = state_bytes(self.model, self.optimizer)
            self.held = held["parameters"] + held["optimizer_state"]
            try:
                meter = PeakMeter("cpu")
                meter.__enter__()
            except Exception as e:  # noqa: BLE001 - the profiler's private API; the run goes on
                meter, self.failure = None, f"the profiler failed ({type(e).__name__}: {e})"
        try:
            yield
        finally:
            if meter is not None:
                try:
                    meter.__exit__(None, None, None)
                    self.window_peak = meter.result.peak_bytes
                except Exception as e:  # noqa: BLE001 - as above
                    self.failure = f"the profiler failed ({type(e).__name__}: {e})"

    def summary(self) -> Dict[str, Any]:
        static = sum(state_bytes(self.model, self.optimizer).values())
        if self.device.type == "cuda":
            return {"peak_memory_bytes": torch.cuda.max_memory_allocated(self.device),
                    "peak_memory_source": "CUDA allocator (max_memory_allocated)", "static_memory_bytes": static}
        if self.window_peak is None:
            why = self.failure or ("measured on rank 0 only" if not sync.is_rank_zero() else "no window ran")
            return {"peak_memory_bytes": None, "peak_memory_source": f"not measured: {why}",
                    "static_memory_bytes": static}
        return {"peak_memory_bytes": self.held + self.window_peak,
                "peak_memory_source": "measured: the CPU allocator's events of one window (PyTorch profiler), "
                                      "plus the parameters and optimizer state held before it",
                "static_memory_bytes": static}
