"""Data for TRL's trainers without a download: a word-level tokenizer over the tiny models' 50 ids
(``t0`` .. ``t49``, ``t0`` padding and end of sequence), SFT sequences of token ids and DPO pairs of
whitespace-separated words, and big-batch references that run the trainer's own ``compute_loss`` on
each window's examples collated into one batch (TRL's loss, as TRL defines it, over one big batch).
"""
from __future__ import annotations

import contextlib
import copy
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch
from torch import nn

from hf_helpers import VOCAB
from integrations.scenarios import make_optimizer


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="t0", eos_token="t0")


def sft_examples(count: int, seed: int = 0) -> List[Dict[str, List[int]]]:
    """``count`` sequences of 3-19 token ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (count,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def dpo_examples(count: int, seed: int = 0) -> List[Dict[str, str]]:
    """``count`` pairs: a prompt of 2-5 words, chosen and rejected completions of 1-8 words (ending in
    the end-of-sequence word, so TRL adds none)."""
    g = torch.Generator().manual_seed(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                                        generator=g).tolist())

    return [{"prompt": words(2, 6) + " ", "chosen": words(1, 8) + " t0", "rejected": words(1, 8) + " t0"}
            for _ in range(count)]


class Float64LogProbs:
    """Stands in for TRL's fused LM-head kernel (``trl.kernels.ChunkedLogProbFunction``), which
    accumulates in float32 (and projects in bf16 under TRL's default autocast, even for a float64
    model): the same outputs from the full logits in the hidden states' dtype. Both sides of a
    comparison run it, so that a float64 test sees the weighting at 1e-10 rather than TRL's kernel's
    rounding (about 1e-9, measured with the real kernel in benchmarks/stacks.py)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0,
              outputs=("log_probs",)):
        assert softcap is None, "the tiny test models have no logit softcapping"
        logits = torch.nn.functional.linear(hidden, weight.to(hidden.dtype), bias) * (logit_scale / temperature)
        log_p = logits.log_softmax(-1)
        picked = log_p.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            sq = torch.logsumexp(2 * log_p, -1) if "log_sum_sq_probs" in outputs else None
            mean = logits.mean(-1) if "mean_logits" in outputs else None
            top1 = logits.argmax(-1) == targets if "is_top1" in outputs else None
        return picked, entropy, sq, mean, top1


@contextlib.contextmanager
def float64_log_probs() -> Iterator[None]:
    """TRL's fused LM head with :class:`Float64LogProbs` inside (restored on the way out)."""
    import trl.trainer.utils as utils

    kept = utils._ChunkedLogProbFunction
    utils._ChunkedLogProbFunction = Float64LogProbs
    try:
        yield
    finally:
        utils._ChunkedLogProbFunction = kept


def fit(trainer_cls: type, model: nn.Module, examples: Sequence[Dict[str, Any]], *, train: bool = True,
        optimizer: Callable = make_optimizer, **config: Any) -> Any:
    """A TRL trainer of ``trainer_cls`` on a copy of ``model`` (float64: TRL's default ``bf16=True`` and
    ``gradient_checkpointing=True`` are left as TRL sets them), trained unless ``train=False``;
    sequential order, SGD with momentum and a schedule, no clipping, logs every step."""
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, SFTConfig

    transformers.logging.set_verbosity_error()
    model = copy.deepcopy(model)
    opt, sched = optimizer(model.parameters())
    is_dpo = issubclass(trainer_cls, DPOTrainer)
    settings = dict(output_dir=tempfile.mkdtemp(prefix="gradaccum-trl-"), num_train_epochs=1, max_grad_norm=0.0,
                    report_to="none", logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True,
                    train_sampling_strategy="sequential", seed=0, data_seed=0, max_length=None,
                    per_device_train_batch_size=2, gradient_accumulation_steps=2, dataset_num_proc=None)
    settings.update(config)
    args = (DPOConfig if is_dpo else SFTConfig)(**settings)
    extra = {"ref_model": copy.deepcopy(model).eval()} if is_dpo else {}  # DPO's frozen start, not from a hub
    trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_list([dict(e) for e in examples]),
                          processing_class=tokenizer(), optimizers=(opt, sched), **extra)
    trainer.remove_callback(transformers.PrinterCallback)
    if train:
        trainer.train()
    return model, trainer


def reference(trainer_cls: type, model: nn.Module, examples: Sequence[Dict[str, Any]], window: int,
              optimizer: Callable = make_optimizer, **config: Any) -> nn.Module:
    """One step per window of ``window`` consecutive (prepared) examples with ``trainer_cls``'s own
    ``compute_loss`` over them collated into one batch, under its autocast: TRL's loss, as TRL
    defines it, over one big batch."""
    model, trainer = fit(trainer_cls, model, examples, train=False, optimizer=optimizer, **config)
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    model.train()
    for start in range(0, len(rows), window):
        batch = trainer.data_collator(rows[start:start + window])
        opt.zero_grad(set_to_none=True)
        with trainer.accelerator.autocast():
            loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        opt.step()
        sched.step()
    return model
