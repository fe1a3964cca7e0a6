"""Argument checks shared with the command line (its flags as ``name``): each raises before anything changes,
naming the argument, the value and the fix."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple, Union

import torch
from torch import nn

from .errors import ConfigurationError, NotExactError

__all__ = ["Count", "check_int", "positive_int", "non_negative_int", "positive_number", "item_count",
           "scalar_loss", "split_loss_output", "as_number", "batchnorms", "tracking_instance_norms",
           "training_batchnorms", "ROWS", "LABEL_DTYPES", "holds_ignored_labels", "ignored_labels",
           "label_tensors", "padded_rows_refusal"]

#: how many items a mean loss is over: an int, a float weight, or a one-element tensor on the device
Count = Union[int, float, torch.Tensor]
#: ``num_items="rows"``: a bare mean loss is over the micro-batch's rows (dim 0), declared so
ROWS = "rows"


def _is_int_from(value: Any, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum  # True is no int here


def check_int(flag: str, value: Any, minimum: int = 1, *, maximum: Optional[int] = None, extra: str = "") -> None:
    """The command line's integer flags: ``--accum-steps must be an integer >= 1, got 0``."""
    if not _is_int_from(value, minimum) or (maximum is not None and value > maximum):
        want = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigurationError(f"{flag} must be an integer {want}{extra}, got {value!r}")


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (the library's arguments: ``epochs must be a positive int``)."""
    if not _is_int_from(value, 1):
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(name: str, value: Any, *, hint: str = "") -> int:
    """``value`` if it is an int >= 0; ``hint`` follows the name (``" (e.g. len(loader))"``)."""
    if not _is_int_from(value, 0):
        raise ConfigurationError(f"{name} must be an int >= 0{hint}, got {value!r}")
    return value


def positive_number(name: str, value: Any, *, what: str = "a positive finite number") -> float:
    """``value`` as a float if it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be {what}, got {value!r}")
    return float(value)


def item_count(name: str, value: Any) -> Count:
    """A finite number >= 0, or a one-element tensor (left on its device, unchecked: reading it would synchronise)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigurationError(f"{name} must be one number, got a tensor of shape {tuple(value.shape)}")
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)) and hasattr(value, "item"):
        value = value.item()  # a NumPy number
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{name} must be a finite number >= 0 (how many items the loss is a mean over), "
                                 f"got {value!r}")
    return value


def as_number(count: Count) -> float:
    """A count as a Python float (a tensor count synchronises with its device)."""
    return float(count.item()) if isinstance(count, torch.Tensor) else float(count)


def split_loss_output(out: Any, count: Count) -> Tuple[Any, Count]:
    """``loss_fn``'s output -> (mean loss, item count); a bare loss counts ``count`` (its rows, or ``num_items``')."""
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], item_count("the count returned by loss_fn", out[1])
    if isinstance(out, torch.Tensor):
        return out, count
    raise TypeError(f"loss_fn must return a scalar tensor (the mean loss over the micro-batch) or a pair "
                    f"(mean_loss, num_items), got {type(out).__name__}")


def scalar_loss(loss: Any, *, subject: str = "loss must be a scalar tensor", where: str) -> torch.Tensor:
    """A scalar loss that requires grad, else an error opening with ``subject``; ``where`` it should be computed."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigurationError(f"{subject} (the mean over the micro-batch's items), got {shape}; "
                                 "reduce it with .mean() or return (mean_loss, num_items)")
    if not loss.requires_grad:
        raise ConfigurationError(
            "loss does not require grad: it was computed under torch.no_grad(), detached, or from "
            f"a model with no trainable parameter. Compute it from the model's output inside {where}, "
            "without .detach() or .item()")
    return loss


def batchnorms(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The BatchNorm layers by name: in training mode their statistics are per micro-batch, not one big batch's."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def tracking_instance_norms(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The InstanceNorm layers that track running statistics, by name: in training mode their gradient is the big
    batch's, but they update those statistics once per micro-batch."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats]


def training_batchnorms(model: nn.Module) -> List[str]:
    """Names of the BatchNorm layers in training mode (:func:`batchnorms`)."""
    return [name for name, m in batchnorms(model) if m.training]


LABEL_DTYPES = (torch.int64, torch.int32)  #: the dtypes a tuple's labels may hold -100 in


def label_tensors(micro_batch: Any) -> List[torch.Tensor]:
    """Where a micro-batch's labels may be: a mapping's ``labels``; a tuple's int64/int32 tensors of two dimensions or
    more (token labels; its inputs' ids hold no -100 either; uint8 images and bool masks cannot hold it)."""
    if isinstance(micro_batch, Mapping):
        found = [micro_batch["labels"]] if "labels" in micro_batch else []
    elif isinstance(micro_batch, (tuple, list)):
        found = [t for t in micro_batch
                 if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.dtype in LABEL_DTYPES]
    else:
        return []
    return [t for t in found if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel()]


def ignored_labels(micro_batches: List[Any]) -> Optional[torch.Tensor]:
    """A flag on the labels' device: do the micro-batches' labels (:func:`label_tensors`) hold -100 (None: none)?"""
    found = [(t == -100).any() for mb in micro_batches for t in label_tensors(mb)]
    return torch.stack([f.to(found[0].device) for f in found]).any() if found else None


def holds_ignored_labels(micro_batches: List[Any]) -> bool:
    """:func:`ignored_labels`, read in one host synchronisation for all of them."""
    flag = ignored_labels(micro_batches)
    return flag is not None and bool(flag)


def padded_rows_refusal(where: str, fix: str) -> NotExactError:
    """The refusal of a bare mean loss over labels holding -100: ``where`` names the call, ``fix`` its count."""
    return NotExactError(
        f"{where} returned a bare mean loss on micro-batches whose 'labels' hold the ignore index -100 "
        "(padding, masked prompts), and no num_items says what that mean is over, so each micro-batch would be "
        "weighed by its rows, not by its targets, and the step would not be one big batch's (a Hugging Face "
        f"model's outputs.loss is a mean over the targets). {fix}")
