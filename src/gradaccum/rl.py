"""GRPO and RLOO steps as one big batch: what each loss type averages its summed terms over.

A step of micro-batches on every rank is one big batch of a policy-gradient loss when every micro-batch
backpropagates its *summed* terms divided by the step's count N, counted before the first backward over
every micro-batch and rank; N depends on the loss type (:data:`ITEMS`, :func:`step_items`). TRL's GRPO and
RLOO trainers drive it in :mod:`gradaccum.integrations.trl_rl`; a loop of one's own passes N to
``acc.window(num_items=N)`` and backpropagates each micro-batch's summed terms. The formulas per loss type:
docs/guides/trl.md ("GRPO and RLOO").

    >>> import torch
    >>> masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1]])]   # completion masks
    >>> tokens, rows = sum(int(m.sum()) for m in masks), sum(m.shape[0] for m in masks)
    >>> StepCount.of("dapo", tokens, rows, max_completion_length=3)                 # a token mean: N = T
    StepCount(tokens=6, rows=3, items=6)
    >>> StepCount.of("grpo", tokens, rows, 3).items, StepCount.of("dr_grpo", tokens, rows, 3).items
    (3, 9)
"""
from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["ITEMS", "StepCount", "step_items"]

#: what a step's loss averages over, per loss type: its sequences ("rows"), its completion tokens
#: ("tokens"), or its rows times ``max_completion_length`` ("row slots", Dr. GRPO's constant)
ITEMS = {"grpo": "rows", "sapo": "rows", "luspo": "rows", "dr_grpo": "row slots",
         "bnpo": "tokens", "dapo": "tokens", "cispo": "tokens", "vespo": "tokens", "rloo": "rows"}


def step_items(loss_type: str, tokens: int, rows: int, max_completion_length: Optional[int]) -> int:
    """N, the step's count that ``loss_type``'s big batch divides its summed terms by; 0 (a token mean
    over a step without tokens) is a step with nothing to average, skipped.

    >>> step_items("dapo", tokens=37, rows=8, max_completion_length=16), step_items("dr_grpo", 37, 8, 16)
    (37, 128)
    >>> step_items("dapo", tokens=0, rows=8, max_completion_length=16), step_items("grpo", 0, 8, 16)
    (0, 8)
    """
    kind = ITEMS[loss_type]
    count = tokens if kind == "tokens" else rows * (max_completion_length or 0) if kind == "row slots" else rows
    return int(count)


@dataclasses.dataclass(frozen=True)
class StepCount:
    """One optimizer step's counts over every micro-batch on every rank: its completion tokens (the
    masks' sum), its sequences, and N, what its loss type divides by (0: the step is skipped)."""

    tokens: int
    rows: int
    items: int

    @classmethod
    def of(cls, loss_type: str, tokens: int, rows: int, max_completion_length: Optional[int]) -> "StepCount":
        """The step's counts, N from :func:`step_items`."""
        return cls(tokens, rows, step_items(loss_type, tokens, rows, max_completion_length))
