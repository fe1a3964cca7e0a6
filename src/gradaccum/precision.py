"""Mixed precision as one object: autocast, and the GradScaler's whole lifecycle.

``"fp32"`` does nothing. ``"bf16"`` runs forward passes under autocast. ``"fp16"`` adds a dynamic loss scale S:
every micro-batch's backward sees ``S * loss``; at the window boundary the summed gradient is unscaled once (divided
by S), before normalization, clipping and the step; a window whose scaled gradient overflowed takes no step and S
backs off. The autocast device follows the model's parameters, so one code path serves the CPU and CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Optional

import torch

from .errors import ConfigurationError

PRECISIONS = ("fp32", "bf16", "fp16")

__all__ = ["MixedPrecision", "PRECISIONS"]


class MixedPrecision:
    """Autocast plus, for fp16, a ``torch.amp.GradScaler`` whose lifecycle this object owns."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in PRECISIONS:
            raise ConfigurationError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
        self.precision = precision
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        #: the autocast dtype, or None for fp32
        self.dtype: Optional[torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def autocast(self) -> ContextManager[Any]:
        """The forward pass's context: autocast to bf16/fp16 on the parameters' device, or nothing."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor, *, autocast_off: bool = False,
                 run: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> None:
        """``run(scale(loss))`` (``.backward()``, or the seam's: DeepSpeed's ``engine.backward``) outside autocast
        when the forward ran under it (or asked: a padding micro-batch)."""
        outside = self.dtype is not None or autocast_off  # the forward ran under autocast; its backward must not
        with torch.autocast(device_type=self.device_type, enabled=False) if outside else contextlib.nullcontext():
            run(self.scale(loss))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the accumulated gradients by the loss scale, once per window."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def skip(self) -> None:
        """No step this window; with a scaler, back the scale off (its overflow was recorded by unscale_)."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> Dict[str, Any]:
        return {"precision": self.precision,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("precision") != self.precision:
            raise ConfigurationError(f"checkpoint was written with precision={state.get('precision')!r} but this "
                                     f"Accumulator uses precision={self.precision!r}; construct it with the same "
                                     "precision")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
