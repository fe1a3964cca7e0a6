"""A labelled batch's items and summed loss, by where the loss comes from, for ExactTrainer and ``eval_loss``."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _maths
from ._weights import window_mean
from .batching import leading_dim
from .errors import ConfigurationError

__all__ = ["HEADS", "BatchItems", "SetMean", "check_head"]

#: the model heads whose loss ExactTrainer computes itself, and the loss of each
#: (a sequence-classification head's depends on its problem type, resolved as the model resolves it)
HEADS = {"causal_lm": "cross_entropy", "masked_lm": "cross_entropy", "token_classification": "cross_entropy",
         "sequence_classification": None}
#: the heads whose logits hold one row per token label
TOKEN_HEADS = ("causal_lm", "masked_lm", "token_classification")
_PROBLEM_LOSS = {"single_label_classification": "cross_entropy", "regression": "squared_error",
                 "multi_label_classification": "binary_cross_entropy"}


def check_head(head: Optional[str]) -> None:
    """``head=`` as ExactTrainer takes it: None (read from the model's class) or one of :data:`HEADS`."""
    if head is not None and head not in HEADS:
        raise ConfigurationError(f"ExactTrainer(head={head!r}): supported heads are {', '.join(HEADS)}")


@dataclasses.dataclass(frozen=True)
class BatchItems:
    """The items of a batch under one loss source (``"head"``, ``"tokens"``, ``"pairs"`` or ``"rows"``)."""

    source: str
    head: Any  # one of HEADS, or None where the trainer computes the loss
    ignore_index: int
    config: Any
    device: torch.device

    def targets(self, batch: Dict[str, Any]) -> Tuple[torch.Tensor, str]:
        """The labels the loss is over (a causal LM's shifted) and their :data:`gradaccum._maths.LOSSES` entry."""
        shifted = self.head in (None, "causal_lm")
        if shifted and "shift_labels" in batch:
            targets = batch["shift_labels"]
        else:
            labels = batch.get("labels")
            if labels is None:
                raise ConfigurationError("ExactTrainer: a training batch has no 'labels'; it needs them to count the "
                                         "items and compute the loss (use a collator such as "
                                         "DataCollatorForLanguageModeling(mlm=False))")
            targets = labels[..., 1:] if shifted else labels
        loss = "cross_entropy" if self.source == "tokens" else HEADS[self.head]
        if loss is not None:
            return targets, loss
        problem = getattr(self.config, "problem_type", None)
        if problem is None:  # as the model resolves it on its first batch with labels
            problem = ("regression" if getattr(self.config, "num_labels", None) == 1 else
                       "single_label_classification" if targets.dtype in (torch.long, torch.int) else
                       "multi_label_classification")
        if problem not in _PROBLEM_LOSS:
            raise ConfigurationError(f"ExactTrainer: problem_type={problem!r} is not supported; supported are "
                                     f"{', '.join(_PROBLEM_LOSS)}")
        return targets, _PROBLEM_LOSS[problem]

    def rows(self, batch: Dict[str, Any]) -> int:
        """A batch's preference pairs (``input_ids``: the chosen rows, then the rejected) or its rows."""
        return leading_dim(batch["input_ids"]) // 2 if self.source == "pairs" else leading_dim(batch)

    def rows_items(self, batch: Dict[str, Any]) -> torch.Tensor:
        """Items per row (a pair's two rows count as one): what evaluation gathers."""
        if self.source in ("pairs", "rows"):
            return torch.ones(self.rows(batch), dtype=torch.long, device=self.device)
        targets, loss = self.targets(batch)
        return torch.stack([_maths.loss_items(t, loss=loss, ignore_index=self.ignore_index) for t in targets])

    def count(self, batches: Sequence[Dict[str, Any]], device: Optional[torch.device] = None) -> torch.Tensor:
        """The items of ``batches`` on this rank, a long scalar on ``device``, with no host synchronisation."""
        device = self.device if device is None else device
        if self.source in ("pairs", "rows"):
            return torch.tensor(sum(self.rows(b) for b in batches), device=device)
        total = torch.zeros((), dtype=torch.long, device=device)
        for targets, loss in map(self.targets, batches):
            total = total + _maths.loss_items(targets, loss=loss, ignore_index=self.ignore_index).to(device)
        return total

    def model_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}

    def loss_sum(self, outputs: Any, batch: Dict[str, Any], per_row: bool = False) -> torch.Tensor:
        """The head's loss summed over the batch's items (``per_row``: one sum per row), from the ``logits``."""
        if isinstance(outputs, torch.Tensor):
            logits: Optional[torch.Tensor] = outputs  # a bare tensor from forward is taken as the logits
        elif isinstance(outputs, dict):
            logits = outputs.get("logits")
        elif isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
            logits = outputs[0]  # return_dict=False without labels: logits come first
        else:
            logits = getattr(outputs, "logits", None)
        if logits is None:
            raise ConfigurationError("ExactTrainer: the model returned no 'logits'; ExactTrainer computes the loss from "
                                     f"them (got {type(outputs).__name__}). Return logits from forward when no labels "
                                     "are given")
        targets, loss = self.targets(batch)
        if self.head == "causal_lm" and "shift_labels" not in batch:
            logits = logits[..., :-1, :]
        if self.head in TOKEN_HEADS and (
                targets.dim() < 2 or logits.shape[:-1] != targets.shape):  # a head that does not fit the model
            raise ConfigurationError(
                f"ExactTrainer(head={self.head!r}): the model's logits {tuple(logits.shape)} and its labels "
                f"{tuple(targets.shape)}{' (shifted a token)' if self.head == 'causal_lm' else ''} are not that "
                "head's (one row of logits per token label): pass the head "
                "that fits the model, or declare exact_items in a compute_loss of your own")
        if not per_row:
            return _maths.summed_loss(logits, targets, loss=loss, ignore_index=self.ignore_index)
        return torch.stack([_maths.summed_loss(lg, t, loss=loss, ignore_index=self.ignore_index)
                            for lg, t in zip(logits, targets)])


class SetMean:
    """The item-weighted mean loss over a whole evaluation set: per batch its rows' loss sums and items,
    gathered by ``gather`` (``gather_for_metrics``), summed in float64 at the end::

        loss = sum_{batches, rows} S_row / sum_{batches, rows} n_row
    """

    def __init__(self, items: BatchItems, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.items, self.gather = items, gather
        self.tally: List[torch.Tensor] = []  # per batch: [loss sum of its rows, their items]

    def head_mean(self, outputs: Any, batch: Dict[str, Any]) -> torch.Tensor:
        """The head's mean loss over the batch's items (what evaluation returns); its sums kept."""
        rows_items, rows_sums = self.items.rows_items(batch), self.items.loss_sum(outputs, batch, per_row=True)
        self._keep(rows_sums, rows_items)
        return rows_sums.sum() / rows_items.sum().clamp(min=1).to(rows_sums.dtype)

    def keep_mean(self, mean: torch.Tensor, batch: Dict[str, Any]) -> None:
        """A trainer's own batch mean, shared out over the batch's rows by their items."""
        rows_items = self.items.rows_items(batch)
        self._keep(mean.detach() * rows_items.to(mean.dtype), rows_items)

    def _keep(self, rows_sums: torch.Tensor, rows_items: torch.Tensor) -> None:
        both = torch.stack([rows_sums.detach().double(), rows_items.to(rows_sums.device).double()], dim=1)
        self.tally.append(self.gather(both).sum(dim=0))

    def report(self, metrics: Dict[str, float], prefix: str) -> None:
        """``{prefix}_loss`` in ``metrics``: the set's item-weighted mean (when a batch was evaluated)."""
        if self.tally:
            loss_sum, items = torch.stack(self.tally).sum(dim=0).tolist()
            metrics[f"{prefix}_loss"] = window_mean(loss_sum, items)
        self.tally = []
