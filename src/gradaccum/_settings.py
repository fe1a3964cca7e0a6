"""The Accumulator's arguments, each checked before anything is built (``precision``, ``data_parallel`` where used)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from ._accum_dtype import AccumDtype, check_accum_dtype
from ._checks import positive_number
from ._deepspeed import check_engine_arguments, deepspeed_engine
from .errors import ConfigurationError
from .sync import refuse_pipeline

__all__ = ["NONFINITE", "Settings", "check_training_objects", "nonfinite_choice"]

#: ``nonfinite=``: skip a window whose loss or gradient is not finite, or raise
NONFINITE = ("skip", "raise")


def nonfinite_choice(who: str, value: Any) -> str:
    """``nonfinite=`` as ``who`` (the Accumulator, ``ExactTrainer``, ``ExactAccumulation``) was given it, checked."""
    if not isinstance(value, str) or value not in NONFINITE:
        raise ConfigurationError(
            f"{who}(nonfinite={value!r}): nonfinite must be 'skip' (a window whose loss or gradient is not finite "
            "takes no optimizer or scheduler step, is counted in skipped, with a warning) or 'raise' (training "
            f"stops with FloatingPointError at that window); pass {who}(nonfinite='skip') or nonfinite='raise'")
    return value


@dataclass(frozen=True)
class Settings:
    """The :class:`~gradaccum.Accumulator`'s keyword settings (its Args say what each does), checked as made."""

    max_grad_norm: Optional[float] = None
    precision: str = "fp32"
    accum_dtype: AccumDtype = "auto"
    nonfinite: str = "skip"
    reduce_every_micro_batch: bool = False
    data_parallel: str = "auto"
    compute_grad_norm: bool = False

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None:
            object.__setattr__(self, "max_grad_norm", positive_number("max_grad_norm", self.max_grad_norm,
                                                                      what="a positive finite number or None"))
        nonfinite_choice("Accumulator", self.nonfinite)
        check_accum_dtype(self.accum_dtype)
        object.__setattr__(self, "compute_grad_norm", bool(self.compute_grad_norm))


def check_training_objects(model: Any, optimizer: Any, scheduler: Any,
                           settings: Settings) -> Tuple[Any, List[nn.Parameter]]:
    """The optimizer the boundary steps (a DeepSpeed engine's own) and the model's trainable parameters, all checked."""
    refuse_pipeline(model)
    engine = deepspeed_engine(model)
    if engine is not None:  # the engine steps its own optimizer: see gradaccum._deepspeed
        optimizer = check_engine_arguments(engine, optimizer, scheduler=scheduler,
                                           max_grad_norm=settings.max_grad_norm, precision=settings.precision,
                                           accum_dtype=settings.accum_dtype)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if engine is None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_scheduler_optimizer(scheduler, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigurationError("model has no parameter that requires grad; there is nothing to accumulate")
    if engine is not None:
        return optimizer, params
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not {id(p) for p in held} & {id(p) for p in params}:
        raise ConfigurationError(
            f"the optimizer holds none of the {type(model).__name__}'s {len(params)} trainable "
            "parameters, so its steps would never move the model: build it over this model's "
            "parameters, e.g. torch.optim.AdamW(model.parameters()) after wrapping/sharding the model")
    own = {id(p) for p in model.parameters()}
    outside = [p for p in held if id(p) not in own]  # a frozen one too: it may be unfrozen later
    if outside:
        raise ConfigurationError(
            f"the optimizer holds {len(outside)} parameter(s) that are not the {type(model).__name__}'s "
            f"(shapes {[tuple(p.shape) for p in outside][:4]}): the Accumulator clears, weighs and clips the "
            "gradients of the model it is given, so theirs would carry over from window to window, unscaled "
            "and unclipped. Give the Accumulator a module that holds them all (e.g. nn.ModuleDict({'body': "
            "body, 'head': head}), the loss_fn calling its parts), or build the optimizer over model.parameters() "
            "(under FSDP2 after model.reshard(), where a forward ran since fully_shard and left the root's "
            "parameters unsharded)")
    refuse_unscaled_fp16(model, optimizer, settings.precision)
    scaler = getattr(optimizer, "scaler", None)  # Accelerate's prepared optimizer under fp16 brings its own
    if scaler is not None and callable(getattr(scaler, "is_enabled", None)) and scaler.is_enabled():
        raise ConfigurationError(
            f"the optimizer ({type(optimizer).__name__}) carries its own enabled GradScaler, so its step() "
            "would unscale gradients gradaccum never scaled (Accelerate's prepared optimizer under "
            "mixed_precision='fp16'). Prepare with Accelerator(mixed_precision='no') and pass "
            "precision='fp16' to Accumulator, which owns the scaler")
    return optimizer, params


def refuse_unscaled_fp16(model: nn.Module, optimizer: torch.optim.Optimizer, precision: str) -> None:
    """fp16 with trainable parameters the optimizer does not hold: refused at build and as each window opens."""
    if precision != "fp16":
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    unstepped = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if unstepped:
        raise ConfigurationError(
            f"precision='fp16' with {len(unstepped)} trainable parameter(s) the optimizer does not hold "
            f"({', '.join(unstepped[:4])}{', ...' if len(unstepped) > 4 else ''}): GradScaler unscales only the "
            "optimizer's gradients, so theirs would enter the window's norm and its clip still multiplied by the loss "
            "scale. Freeze them (requires_grad_(False)) or give the optimizer all of them (optimizer.add_param_group)")


def check_scheduler_optimizer(scheduler: Any, optimizer: torch.optim.Optimizer, who: str = "Accumulator",
                              name: str = "scheduler") -> None:
    """A scheduler steps once per window; it must change the learning rate of *this* optimizer."""
    if scheduler is None:
        return
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"{name} must have a step() method, got {type(scheduler).__name__}")
    own, ours = getattr(scheduler, "optimizer", None), optimizer
    for _ in range(4):  # Accelerate's AcceleratedOptimizer holds the raw one
        if own is None or ours is own:  # a scheduler without an optimizer of its own is not compared
            return
        ours = getattr(ours, "optimizer", None)
    raise ConfigurationError(
        f"the scheduler ({type(scheduler).__name__}) is over another optimizer than the {who}'s "
        f"({type(optimizer).__name__}), so its learning-rate changes would never reach the model: build "
        f"it over the same optimizer, e.g. LinearLR(optimizer, ...) with the optimizer you pass to {who}")
