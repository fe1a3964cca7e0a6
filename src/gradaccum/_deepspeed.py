"""DeepSpeed (ZeRO stages 1, 2 and 3; stage 0 untested) as a backend of the distributed seam, which
:func:`gradaccum.sync.sync_for` builds for an engine: the engine owns the reduction, the optimizer, clipping and
its scheduler; gradaccum owns the window. An engine built with ``"managed_gradient_accumulation": false`` leaves
the boundary to its caller; the window's N is counted before its first backward, so the boundary scale is 1 and
the engine's clipping and norm see the window's gradient (why and how: docs/guides/deepspeed.md)."""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .errors import ConfigurationError, NotExactError
from ._seam import LOW_PRECISION, GradSync, loaded_type

__all__ = ["DeepSpeedSync", "deepspeed_engine", "check_engine_arguments", "engine_manages_accumulation", "WORKS_WITH"]

#: the DeepSpeed release gradaccum is tested with (it has the caller-owned boundary; older ones may not)
WORKS_WITH = "0.19.8"


def deepspeed_engine(model: Any) -> Any:
    """``model`` itself when it is a ``deepspeed.initialize`` engine (DeepSpeed imported), else None."""
    engine_type = loaded_type(("deepspeed.runtime.engine", "deepspeed"), "DeepSpeedEngine")
    return model if engine_type is not None and isinstance(model, engine_type) else None


def check_engine_arguments(engine: Any, optimizer: Any, *, scheduler: Any, max_grad_norm: Any, precision: str,
                           accum_dtype: Any) -> Any:
    """The engine's optimizer, after every check of the engine and of the Accumulator's arguments that
    the engine owns (its pipeline engine, DeepCompile, an engine that manages accumulation: refused)."""
    pipe = loaded_type(("deepspeed.runtime.pipe.engine",), "PipelineEngine")
    if pipe is not None and isinstance(engine, pipe):
        raise ConfigurationError(
            "the DeepSpeed PipelineEngine schedules its own micro-batches (engine.train_batch) and cannot leave the "
            "boundary to its caller (DeepSpeed refuses managed_gradient_accumulation=false there): initialize "
            "DeepSpeed with a plain nn.Module (no PipelineModule) to accumulate exactly with the Accumulator, or split "
            "the model into torch.distributed.pipelining stages and step their schedule with gradaccum.PipelineWindow "
            "(gradaccum.pipeline, docs/guides/pipeline.md)")
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is None:
        import deepspeed

        raise ConfigurationError(
            f"DeepSpeed {getattr(deepspeed, '__version__', '?')} has no caller-owned accumulation boundary "
            f"(the config key 'managed_gradient_accumulation'): install deepspeed>={WORKS_WITH}, the version "
            "gradaccum is tested with")
    if managed():
        raise engine_manages_accumulation("Accumulator")
    if callable(getattr(engine, "is_deepcompile_enabled", None)) and engine.is_deepcompile_enabled():
        raise ConfigurationError(
            "DeepCompile compiles DeepSpeed's own accumulation schedule and cannot leave the boundary to its "
            "caller: remove \"compile\": {\"deepcompile\": true} from the DeepSpeed config")
    if engine.optimizer is None or type(engine.optimizer).__name__ == "DummyOptim":
        raise ConfigurationError(
            "the DeepSpeed engine has no optimizer, so engine.step() would move nothing: pass optimizer= (or an "
            "\"optimizer\" section in the config) to deepspeed.initialize")
    ours = (engine.optimizer, getattr(engine, "client_optimizer", None), getattr(engine, "basic_optimizer", None))
    if optimizer is not None and all(optimizer is not o for o in ours):
        raise ConfigurationError(
            f"the optimizer ({type(optimizer).__name__}) is not the DeepSpeed engine's: the engine steps its own. "
            "Pass Accumulator(engine) (optimizer=None) or the optimizer deepspeed.initialize returned")
    owned = [(max_grad_norm is not None, f"max_grad_norm={max_grad_norm!r}",
              f"\"gradient_clipping\": {max_grad_norm} in the DeepSpeed config (the engine clips the window's "
              "gradient once, at engine.step())"),
             (scheduler is not None, f"scheduler={type(scheduler).__name__}",
              "pass it to deepspeed.initialize(lr_scheduler=...): engine.step() steps it, once per window"),
             (precision != "fp32", f"precision={precision!r}",
              "set \"bf16\": {\"enabled\": true} (or fp16) in the DeepSpeed config, which owns mixed precision"),
             (accum_dtype not in (None, "auto", "param"), f"accum_dtype={accum_dtype}",
              "set \"data_types\": {\"grad_accum_dtype\": \"fp32\"} and \"communication_data_type\": \"fp32\" "
              "in the DeepSpeed config, which accumulates the gradient")]
    for given, what, fix in owned:
        if given:
            raise ConfigurationError(f"Accumulator({what}) around a DeepSpeed engine: the engine owns that; {fix}")
    return engine.optimizer


class DeepSpeedSync(GradSync):
    """A ``deepspeed.initialize`` engine with a caller-owned boundary. ``checks_loss``: the driver refuses
    a window whose loss is not finite before :meth:`step` (the ``Accumulator``), so a step the engine then
    drops is a defect to raise; a driver that does not (``ExactTrainer``) gets it back as a skipped window."""

    shares_windows = True
    can_reduce_later = False
    needs_equal_counts = True
    owns_step = True
    needs_count_first = True

    def __init__(self, engine: Any, *, checks_loss: bool = True) -> None:
        self.engine, self.checks_loss = engine, checks_loss
        self.group = getattr(engine, "seq_data_parallel_group", None)
        self.group_size = int(getattr(engine, "seq_dp_world_size", None) or getattr(engine, "dp_world_size", 1) or 1)
        self.grad_divisor = float(self.group_size)  # DeepSpeed averages the gradient over its data-parallel ranks
        self.collectives_in_forward = engine.zero_optimization_stage() == 3  # ZeRO-3 all-gathers in forward

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward(loss, scale_wrt_gas=False)``: the weight is gradaccum's, not ``1 / gas``."""
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, optimizer: Any, precision: Any) -> Optional[float]:
        """``engine.step()`` (clip, step the optimizer and the engine's scheduler): the window gradient's
        norm as the engine measured it, or None; inf where the engine took no step on a gradient not finite
        (an fp16 overflow, or any dtype's with ``checks_loss=False``). A step on a non-finite gradient raises."""
        self.engine.step()
        if not self.engine.was_step_applied():
            if self.engine.fp16_enabled() or not self.checks_loss:
                return math.inf
            raise FloatingPointError(
                "the DeepSpeed engine found the window's gradient not finite and skipped its step (gradaccum's loss "
                "check saw a finite loss): a micro-batch's backward put inf or nan into the engine's gradient, e.g. a "
                "mean over 0 items computed as 0/0 (divide by max(count, 1), as gradaccum's losses do). The engine "
                "dropped that gradient; acc.steps does not count the window")
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else float(norm)
        if norm is not None and not (math.isfinite(norm) and norm >= 0):  # ZeRO reports a non-finite norm as -1
            clip = ("\"gradient_clipping\" in the DeepSpeed config" if self.checks_loss else
                    "TrainingArguments(max_grad_norm=...), which the Trainer writes into the DeepSpeed config")
            resume = ("engine.load_checkpoint and acc.load_state_dict" if self.checks_loss else
                      "trainer.train(resume_from_checkpoint=...)")
            raise FloatingPointError(
                f"the DeepSpeed engine stepped on a window whose gradient norm is {norm} (not finite), so its "
                f"parameters may now hold inf or nan: restore the last checkpoint ({resume}), and set {clip} or lower "
                "the learning rate. The window is not counted as a step")
        return norm

    def low_precision_sum(self, params: Sequence[nn.Parameter]) -> Optional[str]:
        """DeepSpeed sums the window in ``data_types.grad_accum_dtype`` (default: the model's dtype) and, under
        ZeRO-2/3, reduces every micro-batch's gradient in ``communication_data_type`` before summing it."""
        model_dtype, accum = self.engine.get_data_types()
        if model_dtype not in LOW_PRECISION:
            return None
        comm = self.engine.communication_data_type
        partitions = self.engine.zero_optimization_stage() >= 2
        if accum in LOW_PRECISION or (partitions and comm in LOW_PRECISION):
            return (f"DeepSpeed sums the window's gradient in {accum} (data_types.grad_accum_dtype) and reduces each "
                    f"micro-batch's in {comm} (communication_data_type): set \"data_types\": {{\"grad_accum_dtype\": "
                    "\"fp32\"}" + (" and \"communication_data_type\": \"fp32\"" if partitions else "")
                    + " in the DeepSpeed config to sum it in float32")
        return None


def engine_manages_accumulation(who: str, *, value: Any = None) -> ConfigurationError:
    """The refusal of a DeepSpeed engine (or config) that manages gradient accumulation itself, for ``who``;
    ``value``: what the config sets ``"managed_gradient_accumulation"`` to (None: the key is absent)."""
    why = ("the engine manages gradient accumulation itself (it reduces and steps every gradient_accumulation_steps "
           "backward passes, each loss divided by that count), so the window could not be one big batch")
    if value is not None:
        return ConfigurationError(
            f"{who} under DeepSpeed: \"managed_gradient_accumulation\": {json.dumps(value, default=repr)} in the "
            f"DeepSpeed config: {why}; set it to false, or remove the key ({who} then sets it to false)")
    return ConfigurationError(
        f"{who} under DeepSpeed: {why}: add \"managed_gradient_accumulation\": false to the DeepSpeed config "
        f"(DeepSpeed >= {WORKS_WITH})")


def not_known_up_front(*, in_engine: bool = False) -> NotExactError:
    """The refusal of a window whose N is not known before its first backward; ``in_engine``: found at the boundary."""
    leak = (" The window's backwards are already in the engine's gradient, which gradaccum cannot drop: restore the "
            "last checkpoint (engine.load_checkpoint and acc.load_state_dict) before training on") if in_engine else ""
    return NotExactError(
        "under DeepSpeed the window's item count must be known before its first backward (the engine holds the "
        "gradient, so it cannot be rescaled at the boundary): pass num_items= (e.g. num_items=lambda mb: "
        "gradaccum.count_targets(mb['labels'])) to step()/train(), or window(num_items=...), counting the items "
        "loss_fn averages over" + leak)
