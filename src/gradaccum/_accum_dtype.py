"""``accum_dtype``: where a window's gradient of bf16/fp16 parameters is summed, for every driver. A bf16 ``.grad``
rounds to 8 bits of mantissa after each micro-batch adds into it, so its error grows with the window: gradaccum sums
in float32 buffers where it owns the sum, and a :class:`LowPrecisionWarning` names the setting where it does not."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union

import torch

from ._gradients import AccumulationBuffers
from ._seam import LOW_PRECISION, GradSync
from .errors import ConfigurationError

__all__ = ["LowPrecisionWarning", "ACCUM_DTYPES", "LOW_PRECISION", "AccumDtype", "check_accum_dtype",
           "window_buffers", "driver_buffers", "warn_low_precision_grad_sum"]

#: ``accum_dtype=`` names besides a dtype: float32 buffers for low-precision parameters, or none
ACCUM_DTYPES = ("auto", "param")
#: what ``accum_dtype=`` takes: ``"auto"``, ``"param"`` (or None, the same), or a dtype for the buffers
AccumDtype = Union[None, str, torch.dtype]
#: what a sum in bf16/fp16 costs, said by both warnings
_ROUNDS = ("rounds after every micro-batch, so its error grows with the window (bf16 GPT-2, 64 micro-batches: about "
           "2x the error of a float32 sum)")


class LowPrecisionWarning(UserWarning):
    """The window's gradient is summed in bf16/fp16 where a data-parallel wrapper, or a loss scaler unscaling
    ``.grad`` before the boundary, owns the sum: it names the setting that sums in float32."""


def check_accum_dtype(accum_dtype: Any) -> None:
    """Refuse (TypeError) an ``accum_dtype`` that is none of ``"auto"``, ``"param"``, None or a ``torch.dtype``."""
    if accum_dtype is not None and accum_dtype not in ACCUM_DTYPES and not isinstance(accum_dtype, torch.dtype):
        raise TypeError(f"accum_dtype must be 'auto' (float32 buffers for bf16/fp16 parameters), 'param' (the "
                        f"parameter's own dtype) or a torch.dtype such as torch.float32, got {accum_dtype!r}")


def window_buffers(accum_dtype: AccumDtype, sync: GradSync, precision: str,
                   params: Sequence[torch.nn.Parameter]) -> Optional[AccumulationBuffers]:
    """The Accumulator's window buffers: ``"auto"``, float32 ones for a single process's bf16/fp16 parameters
    (none, with a :class:`LowPrecisionWarning`, where a wrapper or GradScaler owns the sum); a dtype, its own
    (refused under DDP/FSDP2/DeepSpeed or with ``precision="fp16"``); ``"param"`` or None: none."""
    if accum_dtype is None or accum_dtype == "param":
        return None
    if accum_dtype == "auto":
        if not sync.shares_windows and not any(p.dtype in LOW_PRECISION for p in params):
            return None
        if sync.shares_windows or precision == "fp16":  # the wrapper, or the scaler, owns the sum
            trainable = [p for p in params if p.requires_grad]
            cost = sync.low_precision_sum(trainable) if sync.shares_windows else (
                "precision='fp16' with bf16/fp16 parameters: GradScaler unscales float32 gradients only, so the "
                "window's gradient is summed in the parameters' own dtype"
            ) if any(p.dtype in LOW_PRECISION for p in trainable) else None
            if cost is not None:
                warnings.warn(f"{cost}. That sum {_ROUNDS}. Pass accum_dtype='param' to accept it without this "
                              "warning", LowPrecisionWarning, stacklevel=3)  # the line that built the Accumulator
            return None
        accum_dtype = torch.float32
    if sync.shares_windows:
        raise ConfigurationError(
            f"accum_dtype is for single-process training (got accum_dtype={accum_dtype}); with DDP or FSDP2 keep "
            "float32 master parameters (FSDP2: MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32)) and leave accum_dtype='auto'")
    if precision == "fp16":
        raise ConfigurationError(
            f"accum_dtype with precision='fp16' is not supported (accum_dtype={accum_dtype}): GradScaler unscales "
            "float32 gradients only. Use precision='bf16', keep float32 parameters, or pass accum_dtype='param'")
    return AccumulationBuffers(params, accum_dtype)  # type: ignore[arg-type]


def warn_low_precision_grad_sum(who: str, params: Any, fix: str) -> None:
    """The warning of a driver whose framework sums bf16/fp16 gradients in ``.grad``; ``fix`` names its setting."""
    low = sorted({str(p.dtype) for p in params if p.requires_grad and p.dtype in LOW_PRECISION})
    if low:
        warnings.warn(f"{who}: the trainable parameters are {', '.join(low)}, so each window's gradient is summed in "
                      f"their own .grad and {_ROUNDS}. {fix}", LowPrecisionWarning, stacklevel=4)


def driver_buffers(who: str, params: Any, accum_dtype: str, *, owns_the_sum: bool,
                   fix: str) -> Optional[AccumulationBuffers]:
    """A trainer driver's float32 buffers for its bf16/fp16 parameters (a frozen one too) under ``"auto"``, where it
    ``owns_the_sum`` (one process, no data-parallel wrapper or scaler unscaling ``.grad``); else a warning."""
    if accum_dtype not in ACCUM_DTYPES:
        raise ConfigurationError(f"{who}(accum_dtype={accum_dtype!r}): accum_dtype must be 'auto' (float32 buffers for "
                                 "bf16/fp16 parameters, rounded once per window) or 'param' (the sum in the "
                                 "parameters' own .grad, rounded after every micro-batch)")
    low = [p for p in params if p.dtype in LOW_PRECISION]
    if not low or accum_dtype == "param":
        return None
    if not owns_the_sum:
        warn_low_precision_grad_sum(who, low, fix)
        return None
    return AccumulationBuffers(low, torch.float32)
