"""TRL's trainers with exact gradient accumulation: SFT and DPO are ``class X(ExactTrainer, TRLTrainer)``
(for another Trainer subclass write the same one line, ExactTrainer first); GRPO and RLOO generate their
micro-batches inside the step, so their drop-ins count each step's completions first
(:mod:`gradaccum.integrations.trl_rl`). Guide: docs/guides/trl.md."""
from __future__ import annotations

# first: RL has its own driver (count the step's completions first), and trl_rl refuses a TRL too old or missing
from .trl_rl import ExactGRPOTrainer, ExactRLOOTrainer
from trl import DPOTrainer, SFTTrainer

from .hf_trainer import ExactTrainer

__all__ = ["ExactSFTTrainer", "ExactDPOTrainer", "ExactGRPOTrainer", "ExactRLOOTrainer"]


class ExactSFTTrainer(ExactTrainer, SFTTrainer):  # type: ignore[misc]
    """``SFTTrainer`` whose window is one big batch of its next-token targets (``labels[:, 1:] !=
    -100``, or the collator's ``shift_labels``: padded, padding-free and packed batches alike), over
    every rank, whatever ``average_tokens_across_devices`` says: SFT divides its summed token loss by
    the window's count, and ExactTrainer sets the factor for the ranks."""


class ExactDPOTrainer(ExactTrainer, DPOTrainer):  # type: ignore[misc]
    """``DPOTrainer`` whose window weighs every preference pair the same, across micro-batches, ranks and a short
    last window: each micro-batch's mean over its pairs is weighted by its share of the window's pairs. Loss types
    that are not a mean of per-pair terms (``"sft"``, ``"aot"``, ``"aot_unpaired"``) are refused."""

