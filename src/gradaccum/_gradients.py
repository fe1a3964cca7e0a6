"""Float32 accumulation buffers for a window's bf16/fp16 gradient (why: :mod:`gradaccum._accum_dtype`).

Each micro-batch's gradient is folded into float32 right after its backward (a post-accumulate-grad hook) and
its ``.grad`` dropped; at the boundary the scaled sum is rounded to the parameter's dtype once::

    buffer  = sum_k float32(grad_k)          (one rounding per micro-batch at most, in float32)
    p.grad  = dtype(buffer * scale)          (one rounding to bf16, for the optimizer)
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch

from .errors import ConfigurationError

__all__ = ["AccumulationBuffers"]


class AccumulationBuffers:
    """Per-parameter float buffers, filled by hooks only while a window is open."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ConfigurationError(f"accum_dtype must be a floating dtype such as torch.float32, got {dtype}")
        self.dtype = dtype
        bits = torch.finfo(dtype).bits  # a buffer never holds a gradient coarser than its parameter's own dtype
        self.params = [p for p in params if p.dtype.is_floating_point and torch.finfo(p.dtype).bits < bits]
        self._buffers: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self.active = False
        self._unhooked = list(self.params)
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        """Hook the trainable parameters (torch hooks no other); a frozen one as a window opens after its unfreezing,
        so that gradual unfreezing sums in float32 too."""
        for p in self._unhooked:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._fold)
        self._unhooked = [p for p in self._unhooked if not p.requires_grad]

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
        """The buffers holding gradient, in parameter order, then the ``.grad`` of a parameter unfrozen while the
        window was open (summed in its own dtype this window, scaled and clipped with the rest;
        hooked as the next window opens)."""
        return [self._buffers[p] for p in self.params if p in self._buffers] + [
            p.grad for p in self._unhooked if p.grad is not None]

    def write_grads_(self) -> None:
        """Hand the optimizer each buffer rounded once to its parameter's dtype; fold nothing more this window."""
        self.active = False
        for p, buf in self._buffers.items():  # the parameters whose hook folded a gradient
            p.grad = buf.to(p.dtype)
        self._buffers.clear()

    def open(self) -> None:
        """A window opens: the buffers fold its gradients from now on, from nothing."""
        self._buffers.clear()
        self.active = True
        if self._unhooked:
            self._hook_trainable()

    def retire(self) -> None:
        """A window failed or a fit ended: the hooks stay, so the buffers stop folding and keep nothing."""
        self.active = False
        self._buffers.clear()
