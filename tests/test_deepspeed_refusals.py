"""What a DeepSpeed engine cannot do exactly is refused before anything changes, on one process and
without a process group: engines that are DeepSpeed's classes in type only (nothing initialised), each
standing for one case. The real engines, every ZeRO stage, run under torchrun in
tests/distributed/test_deepspeed.py."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed_engine = pytest.importorskip("deepspeed.runtime.engine")
pipe_engine = pytest.importorskip("deepspeed.runtime.pipe.engine")

from gradaccum import Accumulator  # noqa: E402
from gradaccum._deepspeed import WORKS_WITH  # noqa: E402
from gradaccum.errors import ConfigurationError  # noqa: E402


def _engine(base: type, **answers):
    """An instance of ``base`` (a DeepSpeed engine class) holding one small module, answering the
    engine's questions the Accumulator asks with ``answers``; DeepSpeed's own __init__ never runs."""
    cls = type(f"Fake{base.__name__}", (base,), {})
    engine = cls.__new__(cls)
    nn.Module.__init__(engine)
    engine.module = nn.Linear(2, 2)
    engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=0.1)
    for name, value in answers.items():
        setattr(engine, name, value)
    return engine


def test_an_engine_without_a_caller_owned_boundary_names_the_version_that_has_one():
    old = _engine(deepspeed_engine.DeepSpeedEngine, managed_gradient_accumulation=None)
    with pytest.raises(ConfigurationError, match=f"install deepspeed>={WORKS_WITH}"):
        Accumulator(old)


def test_an_engine_that_manages_accumulation_is_refused_with_the_config_key():
    managed = _engine(deepspeed_engine.DeepSpeedEngine, managed_gradient_accumulation=lambda: True)
    with pytest.raises(ConfigurationError, match='add "managed_gradient_accumulation": false'):
        Accumulator(managed)


def test_the_pipeline_engine_and_deepcompile_are_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match="PipelineEngine.*plain nn.Module.*gradaccum.PipelineWindow"):
        Accumulator(_engine(pipe_engine.PipelineEngine, managed_gradient_accumulation=lambda: False))
    compiled = _engine(deepspeed_engine.DeepSpeedEngine, managed_gradient_accumulation=lambda: False,
                       is_deepcompile_enabled=lambda: True)
    with pytest.raises(ConfigurationError, match="remove \"compile\""):
        Accumulator(compiled)


@pytest.mark.parametrize("kwargs, fix", [({"max_grad_norm": 1.0}, '"gradient_clipping": 1.0'),
                                         ({"precision": "bf16"}, '"bf16": {"enabled": true}'),
                                         ({"accum_dtype": torch.float32}, '"grad_accum_dtype": "fp32"')])
def test_what_the_engine_owns_is_refused_naming_its_setting(kwargs, fix):
    engine = _engine(deepspeed_engine.DeepSpeedEngine, managed_gradient_accumulation=lambda: False,
                     is_deepcompile_enabled=lambda: False)
    with pytest.raises(ConfigurationError, match=r"around a DeepSpeed engine: the engine owns that") as info:
        Accumulator(engine, **kwargs)
    assert fix in str(info.value)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="not the DeepSpeed engine's"):
        Accumulator(engine, other)


class _Stepped:
    """What ``engine.step()`` left behind, as the seam reads it: whether the step was applied, whether the
    engine runs fp16 (its loss scale skips an overflowing step), and the norm it measured (ZeRO reports a
    non-finite one as -1)."""

    def __init__(self, applied: bool, fp16: bool, norm):
        self.applied, self.fp16, self.norm, self.steps = applied, fp16, norm, 0

    def zero_optimization_stage(self):
        return 2

    def step(self):
        self.steps += 1

    def was_step_applied(self):
        return self.applied

    def fp16_enabled(self):
        return self.fp16

    def get_global_grad_norm(self):
        return self.norm


def test_the_seam_reads_what_the_engine_s_step_did():
    """A step the engine applied gives its norm; an fp16 overflow the engine skipped gives inf (the boundary
    records a skipped window); a step applied on a non-finite norm (a bf16 or fp32 engine checks no
    overflow) raises instead of being counted as a step or as a skip: the parameters moved on inf or nan."""
    from gradaccum._deepspeed import DeepSpeedSync

    assert DeepSpeedSync(_Stepped(True, False, 2.5)).step(None, None) == 2.5
    assert DeepSpeedSync(_Stepped(False, True, None)).step(None, None) == float("inf")
    for norm in (float("nan"), float("inf"), -1.0):
        with pytest.raises(FloatingPointError, match="may now hold inf or nan: restore the last checkpoint"):
            DeepSpeedSync(_Stepped(True, False, norm)).step(None, None)
    with pytest.raises(FloatingPointError, match="skipped its step"):
        DeepSpeedSync(_Stepped(False, False, None)).step(None, None)
    # a driver that checks no loss (ExactTrainer) gets the dropped step back as a skipped window
    assert DeepSpeedSync(_Stepped(False, False, None), checks_loss=False).step(None, None) == float("inf")
    with pytest.raises(FloatingPointError, match=r"may now hold inf or nan.*TrainingArguments\(max_grad_norm"):
        DeepSpeedSync(_Stepped(True, False, -1.0), checks_loss=False).step(None, None)


def test_exact_trainer_reads_whether_the_engine_applied_the_window_s_step():
    """ExactTrainer's stand-in for Accelerate's wrapper remembers whether the window's ``engine.step()`` was
    applied: an fp16 overflow is then recorded as a skipped window, as the Accumulator records it."""
    from types import SimpleNamespace

    from gradaccum.integrations.hf_deepspeed import EngineWrapper, step_applied

    engine = _Stepped(False, True, None)
    engine.backward = lambda loss, scale_wrt_gas: None
    window_steps = [True]
    wrapped = EngineWrapper(engine, steps=lambda: window_steps[0])
    trainer = SimpleNamespace(accelerator=SimpleNamespace(deepspeed_engine_wrapped=wrapped))
    assert step_applied(trainer)  # before any window
    wrapped.backward(torch.zeros(()), sync_gradients=False)
    assert step_applied(trainer) and engine.steps == 0  # not the window's last micro-batch: no step
    wrapped.backward(torch.zeros(()), sync_gradients=True)
    assert engine.steps == 1 and not step_applied(trainer) and wrapped.get_global_grad_norm() == float("inf")
    window_steps[0] = False  # then a window without items: no step, and nothing of the last window's left
    wrapped.backward(torch.zeros(()), sync_gradients=True)
    assert engine.steps == 1 and step_applied(trainer) and wrapped.get_global_grad_norm() is None
    assert step_applied(SimpleNamespace(accelerator=SimpleNamespace()))  # off DeepSpeed


@pytest.mark.parametrize("norm", [float("nan"), -1.0])
def test_exact_trainer_s_window_steps_through_the_seam_and_refuses_a_step_on_a_non_finite_gradient(norm):
    """The Trainer's stand-in steps the engine through the seam's DeepSpeed backend, so a bf16/fp32 engine
    that stepped on a non-finite gradient (ZeRO's norm -1) raises with the fix, as under the Accumulator,
    instead of being logged as a step; an applied step hands the Trainer the engine's norm."""
    from gradaccum.integrations.hf_deepspeed import EngineWrapper

    engine = _Stepped(True, False, norm)
    engine.backward = lambda loss, scale_wrt_gas: None
    with pytest.raises(FloatingPointError, match="may now hold inf or nan"):
        EngineWrapper(engine, steps=lambda: True).backward(torch.zeros(()), sync_gradients=True)
    fine = EngineWrapper(_Stepped(True, False, 2.5), steps=lambda: True)
    fine.engine.backward = lambda loss, scale_wrt_gas: None
    fine.backward(torch.zeros(()), sync_gradients=True)
    assert fine.applied and fine.get_global_grad_norm() == 2.5


def test_a_step_a_bf16_or_fp32_engine_dropped_is_a_skipped_window_said_once():
    """The Trainer checks no loss: a window whose gradient the engine found not finite and dropped (its
    bf16/fp32 overflow check) is recorded as skipped, with one warning per run (an fp16 overflow, the
    loss scale backing off, says nothing)."""
    from types import SimpleNamespace

    from gradaccum import AccumulatorState
    from gradaccum.integrations.hf_deepspeed import EngineWrapper, step_applied

    for fp16, warns in ((False, True), (True, False)):
        engine = _Stepped(False, fp16, None)
        engine.backward = lambda loss, scale_wrt_gas: None
        wrapped = EngineWrapper(engine, steps=lambda: True)
        trainer = SimpleNamespace(accelerator=SimpleNamespace(deepspeed_engine_wrapped=wrapped),
                                  accumulator_state=AccumulatorState())
        wrapped.backward(torch.zeros(()), sync_gradients=True)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert not step_applied(trainer) and not step_applied(trainer)
        assert sum("took no step" in str(w.message) for w in said) == (1 if warns else 0)


def test_exact_trainer_sets_the_caller_owned_boundary_itself_and_refuses_an_engine_managed_one():
    """A Trainer-style config without ``"managed_gradient_accumulation"`` (or with ``"auto"``) is taken, said in
    one warning, and holds false only while the trainer trains (the config is the TrainingArguments', which a
    stock Trainer built from them reads too); false set by the user says nothing; any
    other value is refused in one line naming the key, the value and the fix, before anything changes (no
    callback added, the config as it was). With no config to fill in, the Accumulator's refusal."""
    from types import SimpleNamespace

    hf_deepspeed = pytest.importorskip("gradaccum.integrations.hf_deepspeed")

    class ExactSFTStandIn:
        def __init__(self, config):
            plugin = SimpleNamespace(deepspeed_config=config)
            self.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
            self.callbacks = []

        def add_callback(self, callback):
            self.callbacks.append(callback)

    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
    for given in (dict(auto), dict(auto, managed_gradient_accumulation="auto")):
        trainer = ExactSFTStandIn(given)
        with pytest.warns(UserWarning) as said:
            hf_deepspeed.prepare(trainer, lambda: True)
        assert [str(w.message) for w in said] == [
            'ExactSFTStandIn under DeepSpeed: builds the engine with "managed_gradient_accumulation": false while it '
            "trains (your config and the TrainingArguments' are left as they are), so that each window takes one "
            "engine step on one big batch's gradient; add that line to your config to say so and silence this notice"]
        before = dict(given)
        with hf_deepspeed.accumulation_off(trainer):
            assert given == dict(auto, managed_gradient_accumulation=False)  # what the engine is built from
        assert given == before
        assert [type(c).__name__ for c in trainer.callbacks] == ["DeepSpeedWindows"]
    trainer = ExactSFTStandIn(dict(auto, managed_gradient_accumulation=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_deepspeed.prepare(trainer, lambda: True)
    assert [type(c).__name__ for c in trainer.callbacks] == ["DeepSpeedWindows"]
    for value, said in ((True, "true"), (1, "1")):
        config = dict(auto, managed_gradient_accumulation=value)
        trainer = ExactSFTStandIn(config)
        with pytest.raises(ConfigurationError) as info:
            hf_deepspeed.prepare(trainer, lambda: True)
        assert str(info.value) == (
            f'ExactSFTStandIn under DeepSpeed: "managed_gradient_accumulation": {said} in the DeepSpeed config: the '
            "engine manages gradient accumulation itself (it reduces and steps every gradient_accumulation_steps "
            "backward passes, each loss divided by that count), so the window could not be one big batch; set it "
            "to false, or remove the key (ExactSFTStandIn then sets it to false)")
        assert trainer.callbacks == [] and config == dict(auto, managed_gradient_accumulation=value)
    trainer = ExactSFTStandIn(None)
    with pytest.raises(ConfigurationError, match=r'^ExactSFTStandIn under DeepSpeed: .*add "managed_gradient_'
                                                 rf'accumulation": false to the DeepSpeed config \(DeepSpeed >= {WORKS_WITH}\)'):
        hf_deepspeed.prepare(trainer, lambda: True)
    assert trainer.callbacks == []


@pytest.mark.parametrize("accum_dtype, warns", [("auto", True), ("param", False)])
def test_exact_trainer_names_a_bf16_engine_s_sum_once_unless_accum_dtype_is_param(accum_dtype, warns):
    """ExactTrainer under a bf16 engine that sums the window in bf16 says so once its engine is built, with
    the Accumulator's check and message (window_buffers); accum_dtype='param' accepts it silently, as the
    guide says (the Trainer's own copy of the warning ignored it)."""
    from types import SimpleNamespace

    from gradaccum.accumulator import LowPrecisionWarning
    from gradaccum.integrations.hf_deepspeed import DeepSpeedWindows, EngineWrapper

    class Bf16Engine:
        communication_data_type = torch.bfloat16

        def zero_optimization_stage(self):
            return 2

        def get_data_types(self):
            return torch.bfloat16, torch.bfloat16

    accelerator = SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=Bf16Engine()))
    windows = DeepSpeedWindows(SimpleNamespace(accelerator=accelerator), steps=lambda: True, accum_dtype=accum_dtype)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        windows.on_train_begin(None, None, "control")
    assert isinstance(accelerator.deepspeed_engine_wrapped, EngineWrapper)
    named = [str(w.message) for w in said if issubclass(w.category, LowPrecisionWarning)]
    assert len(named) == (1 if warns else 0), named
    if warns:
        assert "grad_accum_dtype" in named[0] and "accum_dtype='param'" in named[0]
