"""What a batch's items are, for :class:`~gradaccum.integrations.hf_trainer.ExactTrainer`: the heads whose
loss it computes from the logits, and the items of each loss source (next-token targets, labels,
label elements, preference pairs, rows). The formulas themselves are :mod:`gradaccum._maths`'.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from .. import _maths
from ..batching import leading_dim
from ..errors import ConfigurationError

__all__ = ["HEADS", "head_of", "BatchItems"]

#: the model heads whose loss ExactTrainer computes itself, and the loss of each
#: (a sequence-classification head's depends on its problem type, resolved as the model resolves it)
HEADS = {"causal_lm": "cross_entropy", "masked_lm": "cross_entropy", "token_classification": "cross_entropy",
         "sequence_classification": None}
_PROBLEM_LOSS = {"single_label_classification": "cross_entropy", "regression": "squared_error",
                 "multi_label_classification": "binary_cross_entropy"}


def head_of(model: nn.Module) -> str:
    """The :data:`HEADS` entry of a Hugging Face model, from its class (PEFT and compile unwrapped).

    Raises:
        ValueError: the class is none of the Auto mappings' causal-LM, masked-LM, token- or
            sequence-classification classes (pass ``head=`` to ExactTrainer).
    """
    from transformers.models.auto import modeling_auto as auto

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    base = getattr(base, "_orig_mod", base)
    name = type(base).__name__

    def names(mapping: Dict[str, Any]) -> set:
        return {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}

    for head, mapping in (("causal_lm", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("sequence_classification", auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
                          ("token_classification", auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
                          ("masked_lm", auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)):
        if name in names(mapping):
            return head
    raise ConfigurationError(f"ExactTrainer cannot tell the head of {name}; pass head= one of {', '.join(HEADS)} "
                     "(ExactTrainer computes that head's loss from the model's logits)")


@dataclasses.dataclass(frozen=True)
class BatchItems:
    """The items of a batch under one loss source (:data:`~gradaccum.integrations.hf_trainer.SOURCES`):
    ``"head"`` (the model's head, ``head``), ``"tokens"`` (next-token targets), ``"pairs"`` or
    ``"rows"``. ``config`` is the model's (its ``problem_type`` and ``num_labels``), ``device`` where
    counts are made."""

    source: str
    head: Any  # one of HEADS, or None where the trainer computes the loss
    ignore_index: int
    config: Any
    device: torch.device

    def loss_of(self, batch: Dict[str, Any]) -> str:
        """The :data:`gradaccum._maths.LOSSES` entry of this batch under the model's head."""
        loss = HEADS[self.head]
        if loss is not None:
            return loss
        problem = getattr(self.config, "problem_type", None)
        if problem is None:  # as the model resolves it on its first batch with labels
            labels = self.labels(batch)
            if getattr(self.config, "num_labels", None) == 1:
                problem = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem = "single_label_classification"
            else:
                problem = "multi_label_classification"
        if problem not in _PROBLEM_LOSS:
            raise ConfigurationError(f"ExactTrainer: problem_type={problem!r} is not supported; supported are "
                             f"{', '.join(_PROBLEM_LOSS)}")
        return _PROBLEM_LOSS[problem]

    @staticmethod
    def labels(batch: Dict[str, Any]) -> torch.Tensor:
        labels = batch.get("labels")
        if labels is None:
            raise ConfigurationError("ExactTrainer: a training batch has no 'labels'; it needs them to count the items "
                             "and compute the loss (use a collator such as DataCollatorForLanguageModeling(mlm=False))")
        return labels

    def targets(self, batch: Dict[str, Any]) -> torch.Tensor:
        """The labels the loss is over: a causal LM's ``shift_labels`` if the collator gave them, else
        its ``labels[:, 1:]``; every other head's ``labels``."""
        if self.head in (None, "causal_lm") and "shift_labels" in batch:
            return batch["shift_labels"]
        labels = self.labels(batch)
        return labels[..., 1:] if self.head in (None, "causal_lm") else labels

    def rows(self, batch: Dict[str, Any]) -> int:
        """The items of a batch whose trainer returns a mean over pairs or rows: its preference pairs
        (``input_ids`` holds the chosen rows, then the rejected ones) or its rows along dim 0."""
        return leading_dim(batch["input_ids"]) // 2 if self.source == "pairs" else leading_dim(batch)

    def rows_items(self, batch: Dict[str, Any]) -> torch.Tensor:
        """Items per row (a pair's two rows count as one): what evaluation gathers."""
        if self.source in ("pairs", "rows"):
            return torch.ones(self.rows(batch), dtype=torch.long, device=self.device)
        targets = self.targets(batch)
        loss = "cross_entropy" if self.source == "tokens" else self.loss_of(batch)
        return torch.stack([_maths.loss_items(t, loss=loss, ignore_index=self.ignore_index) for t in targets])

    def count(self, batch: Dict[str, Any]) -> torch.Tensor:
        """The batch's items, on the device (no host synchronisation)."""
        if self.source in ("pairs", "rows"):
            return torch.tensor(self.rows(batch), device=self.device)
        targets = self.targets(batch)
        loss = "cross_entropy" if self.source == "tokens" else self.loss_of(batch)
        return _maths.loss_items(targets, loss=loss, ignore_index=self.ignore_index)

    def model_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}

    @staticmethod
    def logits(outputs: Any) -> torch.Tensor:
        if isinstance(outputs, torch.Tensor):
            logits: Optional[torch.Tensor] = outputs  # a bare tensor from forward is taken as the logits
        elif isinstance(outputs, dict):
            logits = outputs.get("logits")
        elif isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
            logits = outputs[0]  # return_dict=False without labels: logits come first
        else:
            logits = getattr(outputs, "logits", None)
        if logits is None:
            raise ConfigurationError("ExactTrainer: the model returned no 'logits'; ExactTrainer computes the loss from them "
                             f"(got {type(outputs).__name__}). Return logits from forward when no labels are given")
        return logits

    def aligned(self, logits: torch.Tensor, batch: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Logits and the targets they predict (a causal LM's logits drop their last position unless the
        collator gave ``shift_labels``, which align with every position)."""
        targets = self.targets(batch)
        if self.head == "causal_lm" and "shift_labels" not in batch:
            logits = logits[..., :-1, :]
        return logits, targets

    def head_loss_sum(self, outputs: Any, batch: Dict[str, Any]) -> torch.Tensor:
        logits, targets = self.aligned(self.logits(outputs), batch)
        return _maths.summed_loss(logits, targets, loss=self.loss_of(batch), ignore_index=self.ignore_index)

    def rows_loss_sums(self, outputs: Any, batch: Dict[str, Any]) -> torch.Tensor:
        """The head's loss summed over each row's items, one value per row (for ``eval_loss``)."""
        logits, targets = self.aligned(self.logits(outputs), batch)
        loss = self.loss_of(batch)
        return torch.stack([_maths.summed_loss(lg, t, loss=loss, ignore_index=self.ignore_index)
                            for lg, t in zip(logits, targets)])
