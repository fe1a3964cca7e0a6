"""GRPO and RLOO steps as one big batch: what each loss type averages its summed terms over.

A step of micro-batches on every rank is one big batch of a policy-gradient loss when every micro-batch
backpropagates its *summed* terms divided by the step's count N, counted before the first backward over every
micro-batch and rank; N depends on the loss type (:data:`ITEMS`, :func:`step_items`). TRL's GRPO and RLOO trainers
drive it in :mod:`gradaccum.integrations.trl_rl`; a loop of one's own passes N to ``acc.window(num_items=N)`` and
backpropagates each micro-batch's summed terms. The formulas per loss type: docs/guides/trl.md ("GRPO and RLOO").

    >>> import torch
    >>> masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1]])]   # completion masks
    >>> tokens, rows = local_counts(masks, torch.device("cpu")).tolist()             # then summed over the ranks
    >>> StepCount.of("dapo", tokens, rows, max_completion_length=3)                 # a token mean: N = T
    StepCount(tokens=6, rows=3, items=6)
    >>> StepCount.of("grpo", tokens, rows, 3).items, StepCount.of("dr_grpo", tokens, rows, 3).items
    (3, 9)
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["ITEMS", "StepCount", "local_counts", "step_items", "trl_divisor", "trl_entropy_mean"]

#: what a step's loss averages over, per loss type: its sequences ("rows"), its completion tokens
#: ("tokens"), or its rows times ``max_completion_length`` ("row slots", Dr. GRPO's constant)
ITEMS = {"grpo": "rows", "sapo": "rows", "luspo": "rows", "dr_grpo": "row slots",
         "bnpo": "tokens", "dapo": "tokens", "cispo": "tokens", "vespo": "tokens", "rloo": "rows"}


def step_items(loss_type: str, tokens: int, rows: int, max_completion_length: Optional[int]) -> int:
    """N, the step's count that ``loss_type``'s big batch divides its summed terms by; 0 (a token mean over a
    step without tokens): nothing to average, the step skipped.

    >>> step_items("dapo", tokens=0, rows=8, max_completion_length=16), step_items("grpo", 0, 8, 16)
    (0, 8)
    """
    kind = ITEMS[loss_type]
    return int(tokens if kind == "tokens" else rows * (max_completion_length or 0) if kind == "row slots" else rows)


@dataclasses.dataclass(frozen=True)
class StepCount:
    """One step's counts over every micro-batch on every rank: its completion tokens (the masks' sum), its
    sequences, and N, what its loss type divides by (0: the step is skipped)."""

    tokens: int
    rows: int
    items: int

    @classmethod
    def of(cls, loss_type: str, tokens: int, rows: int, max_completion_length: Optional[int]) -> "StepCount":
        """The step's counts, N from :func:`step_items`."""
        return cls(tokens, rows, step_items(loss_type, tokens, rows, max_completion_length))


def local_counts(masks: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's ``[completion tokens, sequences]`` over a step's micro-batches (their loss masks), a long tensor
    on ``device`` to sum over the ranks in one reduction, before :meth:`StepCount.of` (the module's example)."""
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for mask in masks:
        counts += torch.stack([mask.sum().long(), torch.tensor(mask.shape[0], device=mask.device)]).to(device)
    return counts


def trl_divisor(loss_type: str, mask: torch.Tensor, *, accumulation: int, max_completion_length: Optional[int],
                generation_tokens: Optional[torch.Tensor], world: int, steps_per_generation: int
                ) -> Union[float, torch.Tensor]:
    """What TRL 1.16's ``_compute_loss`` divided a training micro-batch's summed terms by (its ``loss_type``'s
    normaliser times the accumulation steps ``K``), so that ``loss * trl_divisor`` is its summed terms again::

        grpo, sapo, luspo   rows_k * K              bnpo    max(tokens_k, 1) * K
        dr_grpo             rows_k * L_max * K      dapo, cispo, vespo   max(N_gen, 1) / W * K / steps_per_generation
        rloo                rows_k                  (the Trainer's own 1/K is switched off)

    with ``rows_k``/``tokens_k`` the micro-batch's sequences and completion tokens (``mask``), ``N_gen`` the
    generation batch's tokens over all ``W`` ranks (TRL's ``num_items_in_batch``); each in TRL's own expression
    and dtype, so that the division is undone to the last bit.

    >>> mask = torch.tensor([[1., 1., 0.], [1., 0., 0.]])
    >>> common = dict(accumulation=4, max_completion_length=3, generation_tokens=torch.tensor(9.), world=1)
    >>> trl_divisor("grpo", mask, steps_per_generation=1, **common), trl_divisor("dr_grpo", mask, steps_per_generation=1, **common)
    (8.0, 24.0)
    >>> trl_divisor("bnpo", mask, steps_per_generation=1, **common), trl_divisor("dapo", mask, steps_per_generation=2, **common)
    (tensor(12.), tensor(18.))
    """
    rows = float(mask.shape[0])
    if loss_type == "rloo":
        return rows
    if loss_type in ("grpo", "sapo", "luspo"):
        return rows * accumulation
    if loss_type == "bnpo":
        return mask.sum().clamp(min=1.0) * accumulation
    if loss_type == "dr_grpo":
        assert max_completion_length is not None, "dr_grpo divides by max_completion_length"
        return rows * max_completion_length * accumulation
    assert generation_tokens is not None, f"loss_type={loss_type!r} divides by the generation batch's tokens"
    return generation_tokens.clamp(min=1.0) / world * accumulation / steps_per_generation


def trl_entropy_mean(entropies: torch.Tensor, mask: torch.Tensor, *, accumulation: int
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """A training micro-batch's entropy sum ``sum_it H_it m_it``, and the mean TRL 1.16's entropy bonus subtracted
    ``entropy_coef`` times: ``sum_it H_it m_it / max(tokens_k, 1) / K``, in TRL's order of operations, so that
    adding it back undoes TRL's term to the last bit. The exact step weighs the sum by ``W / T`` instead, ``T``
    the step's completion tokens on every rank.

    >>> trl_entropy_mean(torch.tensor([[1., 2., 4.], [3., 0., 0.]]), torch.tensor([[1., 1., 0.], [1., 0., 0.]]),
    ...                  accumulation=2)
    (tensor(6.), tensor(1.))
    """
    entropy_sum = (entropies * mask).sum()
    return entropy_sum, entropy_sum / mask.sum().clamp(min=1.0) / accumulation
