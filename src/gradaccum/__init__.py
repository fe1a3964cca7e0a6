"""gradaccum: gradient accumulation for PyTorch that is exactly one big batch.

    from gradaccum import Accumulator
    acc = Accumulator(model, optimizer)
    result = acc.step(batch, loss_fn, micro_batch_size=8)   # one optimizer step on the whole batch

Every micro-batch backpropagates its item sum; the window's gradient is divided once by the total
item count across all ranks, so uneven micro-batches, padded sequences and short last windows are
weighted exactly as in one big batch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and the API reference read; at run time each is imported on first use
    from ._cached import Constant, WindowLoss
    from .moe import MoELoss, MoEOutput
    from ._state import AccumulatorState
    from ._autosize import is_out_of_memory
    from ._window import Window
    from .accumulator import Accumulator
    from .batching import split_batch
    from .checking import EquivalenceReport, check_equivalence
    from .errors import ConfigurationError, GradaccumError, NotExactError, RankAgreementError, ReplayError, SplitError
    from .losses import causal_lm_loss, count_targets, token_cross_entropy
    from .memory import PeakMeter
    from .pipeline import PipelineWindow
    from .result import StepResult
    from .sampler import WindowSampler
    from .schedule import AccumSchedule, num_steps

__version__ = "0.1.0"

#: each public name and the module that defines it. Importing ``gradaccum`` imports no torch: the
#: command line (``gradaccum.cli``) is running, and catching a Ctrl-C, before torch's import begins.
_HOMES = {
    "Accumulator": "accumulator", "AccumulatorState": "_state", "Window": "_window", "Constant": "_cached",
    "WindowLoss": "_cached", "is_out_of_memory": "_autosize", "split_batch": "batching",
    "EquivalenceReport": "checking", "check_equivalence": "checking", "causal_lm_loss": "losses",
    "count_targets": "losses", "token_cross_entropy": "losses", "PeakMeter": "memory", "StepResult": "result",
    "WindowSampler": "sampler",
    "AccumSchedule": "schedule", "num_steps": "schedule", "GradaccumError": "errors", "ConfigurationError": "errors",
    "NotExactError": "errors", "SplitError": "errors", "RankAgreementError": "errors", "ReplayError": "errors",
    "MoELoss": "moe", "MoEOutput": "moe", "PipelineWindow": "pipeline",
}
#: importable for code written against earlier versions, not the API: how ``train``/``num_steps`` read ``accum_steps``
_NOT_IN_ALL = ("AccumSchedule",)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gradaccum' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_HOMES))


__all__ = sorted(name for name in _HOMES if name not in _NOT_IN_ALL) + ["__version__"]
