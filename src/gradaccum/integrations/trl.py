"""TRL's trainers with exact gradient accumulation: each is ``class X(ExactTrainer, TRLTrainer)``.

    from gradaccum.integrations.trl import ExactSFTTrainer
    trainer = ExactSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds)   # was SFTTrainer(...)

TRL computes the loss, its metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``, DPO's
``rewards/*``) and its logs as usual; :class:`~gradaccum.integrations.hf_trainer.ExactTrainer`
counts the window's items before its first forward and weighs each micro-batch by them, across
ranks. For another Trainer subclass write the same one line, ExactTrainer first.
"""
from __future__ import annotations

try:
    from trl import DPOTrainer, SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("gradaccum.integrations.trl needs TRL: pip install 'gradaccum[hf]' (or pip install trl)") from exc

from .hf_trainer import ExactTrainer

__all__ = ["ExactSFTTrainer", "ExactDPOTrainer"]


class ExactSFTTrainer(ExactTrainer, SFTTrainer):  # type: ignore[misc]
    """``SFTTrainer`` whose window is one big batch of its next-token targets (``labels[:, 1:] !=
    -100``, or the collator's ``shift_labels``: padded, padding-free and packed batches alike), over
    every rank, whatever ``average_tokens_across_devices`` says: SFT divides its summed token loss by
    the window's count, and ExactTrainer sets the factor for the ranks."""


class ExactDPOTrainer(ExactTrainer, DPOTrainer):  # type: ignore[misc]
    """``DPOTrainer`` whose window weighs every preference pair the same, across micro-batches, ranks
    and a short last window: each micro-batch's mean over its pairs is weighted by its share of the
    window's pairs. Loss types that are not a mean of per-pair terms (``"sft"``, ``"aot"``,
    ``"aot_unpaired"``) are refused."""

