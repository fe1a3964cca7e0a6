"""TRL's trainers with exact gradient accumulation: each is ``class X(ExactTrainer, TRLTrainer)``.

    from gradaccum.integrations.trl import ExactSFTTrainer
    trainer = ExactSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds)   # was SFTTrainer(...)

TRL computes the loss, its metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``, DPO's
``rewards/*``) and its logs as usual; :class:`~gradaccum.integrations.hf_trainer.ExactTrainer`
counts the window's items before its first forward and weighs each micro-batch by them, across
ranks. For another Trainer subclass write the same one line, ExactTrainer first.

GRPO and RLOO generate their micro-batches inside the training step, so ExactTrainer cannot count
them: :class:`ExactGRPOTrainer` and :class:`ExactRLOOTrainer` (:mod:`gradaccum.integrations.trl_rl`)
are drop-ins for ``GRPOTrainer`` and ``RLOOTrainer`` that count each step's completions first.
"""
from __future__ import annotations

try:
    from trl import DPOTrainer, SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("gradaccum.integrations.trl needs TRL: pip install 'gradaccum[hf]' (or pip install trl)") from exc

from .hf_trainer import ExactTrainer
from .trl_rl import ExactGRPOTrainer, ExactRLOOTrainer  # RL: their own driver (count the step's completions first)

__all__ = ["ExactSFTTrainer", "ExactDPOTrainer", "ExactGRPOTrainer", "ExactRLOOTrainer"]


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

