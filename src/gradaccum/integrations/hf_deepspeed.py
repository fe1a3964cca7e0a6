"""``ExactTrainer`` under DeepSpeed: the engine owns the reduction, the optimizer and clipping, the window
the boundary (docs/guides/deepspeed.md, "ExactTrainer with ``deepspeed=``")."""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable, Iterator, Optional

from transformers import TrainerCallback

from .._accum_dtype import window_buffers
from .._deepspeed import DeepSpeedSync, engine_manages_accumulation

KEY = "managed_gradient_accumulation"  # the DeepSpeed config key that hands the boundary to its caller

__all__ = ["EngineWrapper", "DeepSpeedWindows", "prepare", "step_applied"]


class EngineWrapper:
    """Accelerate's ``DeepSpeedEngineWrapper`` for an engine whose caller owns the boundary: backward and
    step through :class:`~gradaccum._deepspeed.DeepSpeedSync`, as under the ``Accumulator``."""

    def __init__(self, engine: Any, steps: Callable[[], bool]) -> None:
        self.engine, self.steps = engine, steps
        self.sync = DeepSpeedSync(engine, checks_loss=False)
        self.norm: Optional[float] = None

    @property
    def applied(self) -> bool:
        """The engine applied the last window's step (False: its norm was not finite)."""
        return self.norm is None or math.isfinite(self.norm)

    def backward(self, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        self.sync.backward(loss)
        if sync_gradients:  # the window's last micro-batch: a window without items takes no step, measures nothing
            self.norm = self.sync.step(None, None) if self.steps() else None

    def get_global_grad_norm(self) -> Optional[float]:
        return self.norm


class DeepSpeedWindows(TrainerCallback):
    """Puts :class:`EngineWrapper` in place of Accelerate's once the engine is built, and says once where it
    sums a bf16/fp16 window (unless ``accum_dtype="param"``)."""

    def __init__(self, trainer: Any, steps: Callable[[], bool], accum_dtype: str = "auto") -> None:
        self.trainer, self.steps, self.accum_dtype = trainer, steps, accum_dtype

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        accelerator = self.trainer.accelerator
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None and not isinstance(wrapped, EngineWrapper):
            window_engine = accelerator.deepspeed_engine_wrapped = EngineWrapper(wrapped.engine, self.steps)
            window_buffers(self.accum_dtype, window_engine.sync, "fp32", [])  # None: the engine holds the sum
        return control


def _config(trainer: Any) -> Any:
    return getattr(getattr(trainer.accelerator.state, "deepspeed_plugin", None), "deepspeed_config", None)


def prepare(trainer: Any, steps: Callable[[], bool], accum_dtype: str = "auto") -> None:
    """Check the DeepSpeed config and hand the boundary to the window (``steps()``: whether the window
    being trained steps). Without ``KEY`` (or ``"auto"``): said once, set false by :func:`accumulation_off`."""
    who = type(trainer).__name__
    config = _config(trainer)
    if not isinstance(config, dict):  # no config to fill in: the engine would manage accumulation
        raise engine_manages_accumulation(who)
    value = config.get(KEY, "auto")  # absent, or "auto" as the Trainer's other keys: ExactTrainer's to set
    if value != "auto" and value is not False:
        raise engine_manages_accumulation(who, value=value)
    if value == "auto":
        warnings.warn(f"{who} under DeepSpeed: builds the engine with \"{KEY}\": false while it trains (your config "
                      "and the TrainingArguments' are left as they are), so that each window takes one engine step on "
                      "one big batch's gradient; add that line to your config to say so and silence this notice",
                      UserWarning, stacklevel=4)
    trainer.add_callback(DeepSpeedWindows(trainer, steps, accum_dtype))


@contextlib.contextmanager
def accumulation_off(trainer: Any) -> Iterator[None]:
    """While ``trainer`` trains: ``KEY`` false in the DeepSpeed config where it was unset or ``"auto"``."""
    config = _config(trainer)
    if not isinstance(config, dict) or config.get(KEY, "auto") != "auto":
        yield
        return
    kept = {KEY: config[KEY]} if KEY in config else {}  # "auto", or nothing
    config[KEY] = False
    try:
        yield
    finally:
        config.pop(KEY, None)
        config.update(kept)


def step_applied(trainer: Any) -> bool:
    """Whether the engine applied the window's step (True off DeepSpeed); a dropped step of a non-fp16 engine
    is said once per run."""
    wrapped = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
    applied = getattr(wrapped, "applied", True)
    if not applied and not wrapped.engine.fp16_enabled() and trainer.accumulator_state.warn_once("nonfinite"):
        warnings.warn(f"{type(trainer).__name__} under DeepSpeed: the engine found a window's gradient not finite "
                      "(a loss that was not finite, or a mean over 0 items computed as 0/0) and took no step, so the "
                      "window was skipped (trainer.skipped counts them; the logged loss is not finite). Lower the "
                      "learning rate or set max_grad_norm", UserWarning, stacklevel=3)
    return applied
