"""``micro_batch_size="auto"``: the largest micro-batch that fits, found by halving on out-of-memory. A failed attempt
is dropped on every rank alike and the same window retried (:func:`gradaccum._run.run_window`'s ``catch_oom``)."""

from __future__ import annotations

import gc
from typing import Callable, List, Optional

import torch

from ._state import AccumulatorState
from .batching import Batch, leading_dim, split_batch
from .result import StepResult
from .sync import GradSync
from .errors import ConfigurationError, SplitError

__all__ = ["is_out_of_memory", "AutoMicroBatch"]


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA's ``torch.OutOfMemoryError`` and the CPU allocator's "can't allocate memory"."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


class AutoMicroBatch:
    """The out-of-memory back-off; the size that last worked is ``state.auto_micro_batch_size``."""

    def __init__(self, sync: GradSync, device: torch.device, state: AccumulatorState) -> None:
        self.sync, self.device, self.state = sync, device, state

    def check_supported(self) -> None:
        if not self.sync.can_reduce_later:
            raise ConfigurationError(
                f"micro_batch_size='auto' is not supported with {type(self.sync).__name__}: its "
                "gradients reduce only inside backward, so ranks cannot agree on an out-of-memory "
                "error first. Pass an int micro_batch_size (found once, e.g. with DDP)")

    def step(self, batch: Batch, attempt: Callable[[List[Batch], int], Optional[StepResult]]) -> StepResult:
        """Step on ``batch``, halving the size until ``attempt(micro_batches, size)`` did not run out of memory."""
        self.check_supported()
        n = leading_dim(batch)
        if n == 0 and not self.sync.shares_windows:
            raise SplitError("batch has 0 items along dim 0; there is nothing to step on")
        size = min(self.state.auto_micro_batch_size or n, n) if n else 2 ** 62  # an empty share follows the others
        size = first = self.sync.min_across(size, self.device)  # every rank starts from the same size
        while True:
            result = attempt(split_batch(batch, size) if n else [], size)
            if result is not None:
                if n and (size < first or self.state.auto_micro_batch_size is None):  # backed off, or the first
                    self.state.auto_micro_batch_size = size
                return result
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if size == 1:
                raise torch.OutOfMemoryError(
                    "micro_batch_size='auto' ran out of memory with micro-batches of 1 item; "
                    "the model does not fit: reduce its size, use precision='bf16', or shard it")
            size //= 2  # >= 1: a size of 1 raised above
