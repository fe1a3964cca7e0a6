"""Where a window's gradient lives: the parameters' ``.grad``, or float32 accumulation buffers.

Summing N bf16 gradients in bf16 rounds N times to 8 bits of mantissa, so the error of the window's
gradient grows with N. With buffers (``Accumulator(accum_dtype=torch.float32)``), each micro-batch's
gradient is folded into a float32 tensor right after its backward (a post-accumulate-grad hook), the
bf16 ``.grad`` is dropped at once, and at the boundary the normalized float32 sum is rounded to the
parameter's dtype exactly once::

    buffer  = sum_k float32(grad_k)          (one rounding per micro-batch at most, in float32)
    p.grad  = dtype(buffer * scale)          (one rounding to bf16, for the optimizer)

:class:`Gradients` is the window's gradient wherever it lives: opened with the window, measured
(:func:`total_norm`), handed over at the boundary at its scale (the buffers rounded once) or dropped.
Every driver's boundary goes through it: the Accumulator's (:mod:`gradaccum._boundary`) and a
framework-driven window's (:meth:`gradaccum._weights.WindowWeights.hand_over`).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch

from .errors import ConfigurationError
from .sync import full_tensor

__all__ = ["AccumulationBuffers", "Gradients", "total_norm"]


class AccumulationBuffers:
    """Per-parameter float buffers, filled by hooks only while a window is open."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ConfigurationError(f"accum_dtype must be a floating dtype such as torch.float32, got {dtype}")
        self.dtype = dtype
        self.params = [p for p in params if p.dtype != dtype]
        self._buffers: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self.active = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._fold)

    def _fold(self, p: torch.Tensor) -> None:
        if not self.active or p.grad is None:
            return
        buf = self._buffers.get(p)  # type: ignore[call-overload]
        if buf is None:
            self._buffers[p] = p.grad.to(self.dtype)  # type: ignore[index]
        else:
            buf.add_(p.grad)
        p.grad = None  # the low-precision gradient lives only until its hook

    def tensors(self) -> List[torch.Tensor]:
        """The buffers holding gradient, in parameter order."""
        return [self._buffers[p] for p in self.params if p in self._buffers]

    def write_grads_(self) -> None:
        """Hand the optimizer each buffer rounded once to its parameter's dtype."""
        for p in self.params:
            buf = self._buffers.get(p)
            if buf is not None:
                p.grad = buf.to(p.dtype)
        self._buffers.clear()

    def clear(self) -> None:
        self._buffers.clear()

    def retire(self) -> None:
        """A window failed or a fit ended: the hooks stay on the parameters, so the buffers stop folding and
        keep nothing."""
        self.active = False
        self._buffers.clear()


class Gradients:
    """The window's gradient: opened with the window, read and scaled at the boundary, cleared after."""

    def __init__(self, params: Sequence[torch.nn.Parameter], buffers: Optional[AccumulationBuffers]) -> None:
        self.params = list(params)
        self.buffers = buffers
        folded = set() if buffers is None else {id(p) for p in buffers.params}
        #: the parameters whose gradient sums in ``.grad`` (all of them without buffers; with buffers, those
        #: already of the buffers' dtype: the float32 layers of a bf16 model)
        self.unbuffered = [p for p in self.params if id(p) not in folded]

    def open(self) -> None:
        """A window opens: stale gradients would leak into it; the buffers fold from here on."""
        for p in self.params:
            p.grad = None
        if self.buffers is not None:
            self.buffers.clear()
            self.buffers.active = True

    def tensors(self) -> List[torch.Tensor]:
        """The tensors holding the window's gradient: the ``.grad`` that exist, and the buffers' (every one
        of them is measured, clipped and rescaled at the boundary)."""
        grads = [p.grad for p in self.unbuffered if p.grad is not None]
        return grads if self.buffers is None else grads + self.buffers.tensors()

    def materialized(self) -> List[torch.Tensor]:
        """Every parameter's ``.grad``, zeros where none was made (for an explicit reduction)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]  # type: ignore[misc]

    def hand_over(self, coef: float, grads: Optional[List[torch.Tensor]] = None) -> None:
        """The window's gradient for the step: every tensor of it (``grads``, where the caller listed them)
        multiplied once by ``coef`` (the scale ``R / N``, with the Accumulator's clip folded in), the
        buffers then rounded once into ``.grad``. Every driver's one float32-buffer rule."""
        if self.buffers is not None:
            self.buffers.active = False
        if coef != 1.0:
            grads = self.tensors() if grads is None else grads
            if grads:
                with torch.no_grad():
                    torch._foreach_mul_(grads, coef)
        if self.buffers is not None:
            self.buffers.write_grads_()

    def drop(self) -> None:
        """The window's gradient goes (after its step, or skipped, or left without a step); its buffers fold
        nothing more until the next window opens."""
        for p in self.params:
            p.grad = None
        if self.buffers is not None:
            self.buffers.active = False
            self.buffers.clear()


def total_norm(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The gradient's total 2-norm: one fused pass for plain tensors on one device (the common case,
    without get_total_norm's per-call grouping); DTensors and mixed devices take the general path."""
    if not grads:
        return torch.zeros((), device=device)
    if all(type(g) is torch.Tensor and g.device == device for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    norm = torch.nn.utils.get_total_norm(grads, 2.0) if hasattr(torch.nn.utils, "get_total_norm") \
        else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return full_tensor(norm)
