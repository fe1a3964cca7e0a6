"""What a DeepSpeed engine cannot do exactly is refused before anything changes, on one process and
without a process group: engines that are DeepSpeed's classes in type only (nothing initialised), each
standing for one case. The real engines, every ZeRO stage, run under torchrun in
tests/distributed/test_deepspeed.py."""
from __future__ import annotations

import os

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
    with pytest.raises(ConfigurationError, match="PipelineEngine.*plain nn.Module"):
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
