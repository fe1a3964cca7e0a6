"""``ExactTrainer`` under DeepSpeed (ZeRO-1/2/3): the engine owns the reduction, the optimizer and
clipping; the Trainer's window owns the boundary (:class:`EngineWrapper` stands in for Accelerate's
``DeepSpeedEngineWrapper``). Set-up and figures: docs/guides/deepspeed.md ("ExactTrainer with
``deepspeed=``"); the maths is :mod:`gradaccum._deepspeed`'s.
"""

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
    """Accelerate's ``DeepSpeedEngineWrapper`` for an engine whose caller owns the boundary: each
    micro-batch's backward and the window's step are the seam's DeepSpeed backend's
    (:class:`~gradaccum._deepspeed.DeepSpeedSync`), as under the ``Accumulator``; the Trainer checks no
    loss, so a step the engine drops on a gradient that is not finite is a skipped window."""

    def __init__(self, engine: Any, steps: Callable[[], bool]) -> None:
        self.engine, self.steps = engine, steps
        self.sync = DeepSpeedSync(engine, checks_loss=False)
        #: the last window's gradient norm as the engine measured it (inf: the gradient was not finite and
        #: the engine took no step; None: it measured none, or no window stepped yet)
        self.norm: Optional[float] = None

    @property
    def applied(self) -> bool:
        """The engine applied the last window's step (False: it found the gradient not finite and dropped it)."""
        return self.norm is None or math.isfinite(self.norm)

    def backward(self, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        """The micro-batch's weighted loss into the engine; its step after the window's last one, unless
        the window holds no item (a step the engine applied on a non-finite gradient raises, with the fix)."""
        self.sync.backward(loss)
        if sync_gradients:  # the window's last micro-batch: a window without items takes no step, measures nothing
            self.norm = self.sync.step(None, None) if self.steps() else None

    def get_global_grad_norm(self) -> Optional[float]:
        return self.norm


class DeepSpeedWindows(TrainerCallback):
    """Puts :class:`EngineWrapper` in place of Accelerate's wrapper once the Trainer has built the engine,
    and says once where that engine sums a bf16/fp16 window (the ``Accumulator``'s check, on this engine:
    :func:`gradaccum._accum_dtype.window_buffers`, which ``accum_dtype="param"`` silences)."""

    def __init__(self, trainer: Any, steps: Callable[[], bool], accum_dtype: str = "auto") -> None:
        self.trainer, self.steps, self.accum_dtype = trainer, steps, accum_dtype

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        accelerator = self.trainer.accelerator
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None and not isinstance(wrapped, EngineWrapper):
            window_engine = accelerator.deepspeed_engine_wrapped = EngineWrapper(wrapped.engine, self.steps)
            window_buffers(self.accum_dtype, window_engine.sync, "fp32", [])  # None: the engine holds the sum
        return control


def prepare(trainer: Any, steps: Callable[[], bool], accum_dtype: str = "auto") -> None:
    """Check the DeepSpeed config (every loss source alike: the model's head, TRL's SFT tokens and DPO
    pairs are tested), then hand the boundary to the window (``steps()``: whether the window being
    trained takes a step). A config without ``"managed_gradient_accumulation"`` (or with ``"auto"``) is
    taken, said once: the engine is built with it false while the trainer trains (:func:`accumulation_off`).
    Any other value is refused before anything changes."""
    who = type(trainer).__name__
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
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
    """While ``trainer`` trains: ``"managed_gradient_accumulation": false`` in the DeepSpeed config its engine
    is built from, where the user left it unset or ``"auto"``; as it was afterwards. That config is the
    TrainingArguments' (Accelerate's plugin holds the same dict), which a stock Trainer built from the same
    arguments would read too."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    if not isinstance(config, dict) or config.get(KEY, "auto") != "auto":
        yield
        return
    had, value = KEY in config, config.get(KEY)
    config[KEY] = False
    try:
        yield
    finally:
        if had:
            config[KEY] = value
        else:
            del config[KEY]


def step_applied(trainer: Any) -> bool:
    """Whether the engine applied the window's step; True off DeepSpeed. A step it dropped is recorded as a
    skipped window, as the ``Accumulator`` records one: silently for fp16, whose loss scale backs off so,
    else with a warning, once per run (a loss or gradient that was not finite)."""
    wrapped = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
    applied = getattr(wrapped, "applied", True)
    if not applied and not wrapped.engine.fp16_enabled() and trainer.accumulator_state.warn_once("nonfinite"):
        warnings.warn(f"{type(trainer).__name__} under DeepSpeed: the engine found a window's gradient not finite "
                      "(a loss that was not finite, or a mean over 0 items computed as 0/0) and took no step, so the "
                      "window was skipped (trainer.skipped counts them; the logged loss is not finite). Lower the "
                      "learning rate or set max_grad_norm", UserWarning, stacklevel=3)
    return applied
