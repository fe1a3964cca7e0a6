"""Exact gradient accumulation in the Hugging Face Trainer: ExactTrainer (docs/guides/hf-trainer.md).

A tiny GPT-2 built from a config (float64, dropout 0; its ``loss_type`` is None, so the stock Trainer
counts the unshifted labels) trains on 10 micro-batches of padded sequences of 3-30 tokens with
``gradient_accumulation_steps=4``: windows of 4, 4 and 2 micro-batches. Each run is compared with one
optimizer step per window on the whole window as one batch:

    python examples/hf_trainer_gpt2.py

prints the largest parameter difference (Delta) of ExactTrainer and of the stock Trainer.
"""
from __future__ import annotations

import copy
import tempfile

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

from gradaccum import causal_lm_loss
from gradaccum.integrations.hf_trainer import ExactTrainer

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
ACCUM, LR = 4, 0.1


def batch_of(seqs):
    """Right-padded: input_ids 0, attention_mask 0 and labels -100 on padding."""
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(s)] = s, s
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


g = torch.Generator().manual_seed(0)
SEQS = [[torch.randint(1, 50, (int(torch.randint(3, 31, (1,), generator=g)),), generator=g) for _ in range(k)]
        for k in [2, 3, 1, 2, 3, 1, 2, 2, 3, 1]]           # sequences per micro-batch
MICRO = [batch_of(s) for s in SEQS]


def fit(model, trainer_cls):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1,
                             gradient_accumulation_steps=ACCUM, num_train_epochs=1, max_grad_norm=0.0,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                             train_sampling_strategy="sequential", remove_unused_columns=False)
    # one pre-padded micro-batch per dataset item, so micro-batches keep their own sizes and padding
    trainer = trainer_cls(model=model, args=args, train_dataset=MICRO, data_collator=lambda items: items[0],
                          optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return model


def one_big_batch_per_window(model):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for w in range(0, len(SEQS), ACCUM):
        big = batch_of([s for seqs in SEQS[w:w + ACCUM] for s in seqs])
        opt.zero_grad()
        logits = model(input_ids=big["input_ids"], attention_mask=big["attention_mask"]).logits
        causal_lm_loss(logits, big["labels"])[0].backward()
        opt.step()
    return model


def delta(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


if __name__ == "__main__":
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=64, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).double()
    ref = one_big_batch_per_window(model)
    exact, stock = fit(model, ExactTrainer), fit(model, Trainer)
    print(f"{len(MICRO)} micro-batches, gradient_accumulation_steps={ACCUM}: windows of 4, 4 and 2")
    print(f"Delta from one big batch per window: ExactTrainer {delta(exact, ref):.1e}, "
          f"stock Trainer {delta(stock, ref):.1e}")
