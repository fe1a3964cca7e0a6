"""gradaccum: gradient accumulation for PyTorch that is exactly one big batch.

    from gradaccum import Accumulator
    acc = Accumulator(model, optimizer)
    result = acc.step(batch, loss_fn, micro_batch_size=8)   # one optimizer step on the whole batch

Every micro-batch backpropagates its item sum; the window's gradient is divided once by the total
item count across all ranks, so uneven micro-batches, padded sequences and short last windows are
weighted exactly as in one big batch.
"""

from ._ranks import WindowPlan
from ._cached import WindowLoss
from ._run import is_out_of_memory
from ._window import Window
from .accumulator import Accumulator
from .batching import split_batch
from .checking import EquivalenceReport, check_equivalence
from .losses import causal_lm_loss, count_targets, token_cross_entropy
from .memory import PeakMeter
from .result import StepResult
from .sampler import WindowSampler
from .schedule import AccumSchedule, num_steps

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "AccumSchedule",
    "EquivalenceReport",
    "PeakMeter",
    "StepResult",
    "Window",
    "WindowPlan",
    "WindowLoss",
    "WindowSampler",
    "causal_lm_loss",
    "check_equivalence",
    "count_targets",
    "is_out_of_memory",
    "num_steps",
    "split_batch",
    "token_cross_entropy",
    "__version__",
]
