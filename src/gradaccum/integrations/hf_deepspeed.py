"""``ExactTrainer`` under DeepSpeed (ZeRO-1/2/3): the engine owns the reduction, the optimizer and
clipping; the Trainer's window owns the boundary (:class:`WindowEngine` stands in for Accelerate's
``DeepSpeedEngineWrapper``). Set-up and figures: docs/guides/deepspeed.md ("ExactTrainer with
``deepspeed=``"); the maths is :mod:`gradaccum._deepspeed`'s.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from transformers import TrainerCallback

from .._deepspeed import DeepSpeedSync, engine_manages_accumulation
from ..accumulator import LowPrecisionWarning

__all__ = ["WindowEngine", "DeepSpeedWindows", "prepare", "step_applied"]


class WindowEngine:
    """Accelerate's ``DeepSpeedEngineWrapper`` for an engine whose caller owns the boundary."""

    def __init__(self, engine: Any, steps: Callable[[], bool]) -> None:
        self.engine, self.steps = engine, steps
        #: the engine applied the last window's step (False: its fp16 loss scale overflowed and backed off)
        self.applied = True

    def backward(self, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        """The micro-batch's weighted loss into the engine; ``engine.step()`` after the window's last one,
        unless the window holds no item."""
        self.engine.backward(loss, scale_wrt_gas=False)
        if sync_gradients and self.steps():
            self.engine.step()
            self.applied = bool(self.engine.was_step_applied())

    def get_global_grad_norm(self) -> Any:
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm


class DeepSpeedWindows(TrainerCallback):
    """Puts :class:`WindowEngine` in place of Accelerate's wrapper once the Trainer has built the engine."""

    def __init__(self, trainer: Any, steps: Callable[[], bool]) -> None:
        self.trainer, self.steps = trainer, steps

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        accelerator = self.trainer.accelerator
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None and not isinstance(wrapped, WindowEngine):
            accelerator.deepspeed_engine_wrapped = WindowEngine(wrapped.engine, self.steps)
            cost = DeepSpeedSync(wrapped.engine).low_precision_sum([])  # the Accumulator's check, on this engine
            if cost is not None:
                warnings.warn(f"{cost}. That sum rounds after every micro-batch, so its error grows with the window",
                              LowPrecisionWarning, stacklevel=2)
        return control


def prepare(trainer: Any, steps: Callable[[], bool]) -> None:
    """Check the DeepSpeed config (every loss source alike: the model's head, TRL's SFT tokens and DPO
    pairs are tested), then hand the boundary to the window (``steps()``: whether the window being
    trained takes a step). Raises before anything changes."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None) or {}
    if config.get("managed_gradient_accumulation", True) is not False:
        raise engine_manages_accumulation(type(trainer).__name__)
    trainer.add_callback(DeepSpeedWindows(trainer, steps))


def step_applied(trainer: Any) -> bool:
    """Whether the engine applied the window's step (an fp16 engine skips one whose loss scale overflowed:
    then the window is recorded skipped, as the ``Accumulator`` records it). True off DeepSpeed."""
    return getattr(getattr(trainer.accelerator, "deepspeed_engine_wrapped", None), "applied", True)
