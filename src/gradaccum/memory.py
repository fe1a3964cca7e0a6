"""Peak memory of a region of code, measured from the allocator rather than estimated. With s_i the sizes of
the region's allocations and F(t) those of them freed by time t::

    peak_bytes     = max_t  sum_{i allocated by t, i not in F(t)} s_i
    retained_bytes = the same sum at the end of the region

in the bytes asked of the allocator; memory held at entry is not counted. On CUDA: the caching allocator's
high-water mark (free, but it resets the process's CUDA peak: CUDA meters must not be nested). On the CPU: the
PyTorch profiler's memory events, replayed in time order (not inside another profiler; about half a millisecond per
region plus 7 to 40 microseconds per allocation, docs/benchmarks.md section 3: measure some windows, not every one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .errors import ConfigurationError

__all__ = ["PeakMeter", "PeakMemory", "state_bytes"]


@dataclass(frozen=True)
class PeakMemory:
    """What one region allocated, in bytes, above the level at its entry."""

    #: the most bytes the region held at once
    peak_bytes: int
    #: bytes allocated in the region and still held at its end
    retained_bytes: int
    #: how many allocations the region made
    allocations: int
    #: e.g. ``"cpu"`` or ``"cuda:0"``
    device: str
    #: how the figure was obtained
    source: str


class PeakMeter:
    """Context manager that measures the peak bytes allocated on one device inside its block.

    Args:
        device: ``"cpu"`` or a CUDA device. Other devices raise ``ValueError``.

    The meter can be entered again; each block replaces ``result``. See the module docstring for
    what the figures mean and what measuring costs.

    Example:
        >>> with PeakMeter("cpu") as meter:
        ...     x = torch.empty(1000, dtype=torch.float32)   # 4000 bytes
        ...     del x
        ...     y = torch.empty(500, dtype=torch.float32)    # 2000 bytes, after x was freed
        >>> meter.result.peak_bytes >= 4000
        True
    """

    def __init__(self, device: Union[str, torch.device] = "cpu") -> None:
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ConfigurationError(f"PeakMeter measures 'cpu' or 'cuda' devices, got device={str(device)!r}; on "
                                     "other devices read the backend's own counters (e.g. "
                                     "torch.mps.current_allocated_memory)")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigurationError(f"PeakMeter(device={str(device)!r}): CUDA is not available here; use 'cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._result: Optional[PeakMemory] = None
        self._cuda_entry = (0, 0)  # bytes allocated and allocations made at entry
        self._active = False

    @property
    def result(self) -> PeakMemory:
        """The last finished block's figures."""
        if self._result is None:
            raise RuntimeError("PeakMeter.result is read after a `with PeakMeter(...) as meter:` block has ended")
        return self._result

    def __enter__(self) -> "PeakMeter":
        if self._active:
            raise RuntimeError("this PeakMeter is already measuring; use a second meter for a nested region")
        if self.device.type == "cuda":
            self._cuda_entry = _cuda_counters(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _start_cpu_events()
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._active = False
        if self.device.type == "cuda":
            (base, count), (now, count_now) = self._cuda_entry, _cuda_counters(self.device)
            figures = (torch.cuda.max_memory_allocated(self.device) - base, now - base, count_now - count)
            source = "CUDA caching allocator (max_memory_allocated - memory_allocated at entry)"
        else:
            figures, source = replay(_stop_cpu_events()), "CPU allocator events (PyTorch profiler, memory only)"
        self._result = PeakMemory(*figures, device=str(self.device), source=source)


def replay(events: List[Tuple[int, int, int]]) -> Tuple[int, int, int]:
    """``(time, address, signed size)`` events -> ``(peak, retained, allocations)``: a positive size allocates at
    the address, a negative one frees it (a free of a block from before the region is ignored)."""
    live: Dict[int, int] = {}
    current = peak = count = 0
    for _, ptr, size in sorted(events, key=lambda e: e[0]):  # stable: ties keep their order
        if size > 0:
            live[ptr] = size
            current += size
            count += 1
            peak = max(peak, current)
        elif size < 0:
            current -= live.pop(ptr, 0)
    return peak, current, count


def state_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, int]:
    """The bytes held between windows, counted from the tensors themselves (not measured): the
    parameters, their gradients (one buffer per parameter that requires grad) and the optimizer's
    state tensors. No activation is counted: the measured peak (:class:`PeakMeter`) is what has them."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = 0 if optimizer is None else sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                            for t in s.values() if isinstance(t, torch.Tensor))
    return {"parameters": params, "gradients": grads, "optimizer_state": state}


def _cuda_counters(device: torch.device) -> Tuple[int, int]:
    return torch.cuda.memory_allocated(device), int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))


def _start_cpu_events() -> None:
    # private: the entry points torch.profiler.profile uses
    from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope, _ExperimentalConfig

    if torch.autograd._profiler_enabled():
        raise RuntimeError("PeakMeter('cpu') cannot run while a PyTorch profiler is active on this thread: it uses "
                           "the profiler's memory events. Measure outside the profiler, or pass profile_memory=True "
                           "to your own torch.profiler.profile and read its memory events")
    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    # only TorchScript's static runtime emits this scope: in eager mode no operator is recorded (an empty set
    # would record them all), only the allocator's events. Kineto prints profiler_start/stop per region
    # unless KINETO_LOG_LEVEL is set when it starts: set for that moment only
    scopes = {RecordScope.STATIC_RUNTIME_MODEL}
    before = os.environ.get("KINETO_LOG_LEVEL")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        torch.autograd._prepare_profiler(config, activities)
        torch.autograd._enable_profiler(config, activities, scopes)  # type: ignore[call-arg]  # stubs lag
    finally:
        if before is None:
            del os.environ["KINETO_LOG_LEVEL"]


def _stop_cpu_events() -> List[Tuple[int, int, int]]:
    from torch._C._profiler import _ExtraFields_Allocation

    result = torch.autograd._disable_profiler()
    cpu = torch.device("cpu")
    events: List[Tuple[int, int, int]] = []
    stack = list(reversed(result.experimental_event_tree()))  # depth first, in recorded order
    while stack:  # a few pybind11 attribute reads per event: this loop is a third of the cost
        node = stack.pop()
        stack.extend(reversed(node.children))
        fields = node.extra_fields
        if type(fields) is _ExtraFields_Allocation and fields.device == cpu:
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    return events
