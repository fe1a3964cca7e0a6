"""Exact gradient accumulation in PyTorch Lightning with one callback (docs/guides/lightning.md).

A tiny GPT-2 (random init from a config, float64, dropout 0) trains on 10 micro-batches of padded
sequences of 3-30 tokens with ``accumulate_grad_batches=4``: windows of 4, 4 and 2 micro-batches.
Each run is compared with one optimizer step per window on the whole window as one batch:

    python examples/lightning_gpt2.py

prints the largest parameter difference (Delta) of ExactAccumulation and of Lightning's own accumulation.
"""
from __future__ import annotations

import copy
import warnings

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from gradaccum import causal_lm_loss, count_targets
from gradaccum.integrations.lightning import ExactAccumulation

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
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


class LitGPT2(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss, n = causal_lm_loss(logits, batch["labels"])   # the mean over this micro-batch's targets
        self.log("train_loss", loss, batch_size=int(n))
        return loss                                          # unchanged: the mean

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def fit(model, callbacks):
    lit = LitGPT2(copy.deepcopy(model))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=ACCUM,
                         gradient_clip_val=1.0, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(lit, DataLoader(MICRO, batch_size=None))
    return lit.model


def one_big_batch_per_window(model):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for w in range(0, len(SEQS), ACCUM):
        big = batch_of([s for seqs in SEQS[w:w + ACCUM] for s in seqs])
        opt.zero_grad()
        logits = model(input_ids=big["input_ids"], attention_mask=big["attention_mask"]).logits
        causal_lm_loss(logits, big["labels"])[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model


def delta(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


if __name__ == "__main__":
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=64, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # GPT-2's are 50256
    model = GPT2LMHeadModel(config).double()
    ref = one_big_batch_per_window(model)
    exact = fit(model, [ExactAccumulation(num_items=lambda batch: count_targets(batch["labels"]))])
    native = fit(model, [])
    print(f"{len(MICRO)} micro-batches, accumulate_grad_batches={ACCUM}: windows of 4, 4 and 2")
    print(f"Delta from one big batch per window: ExactAccumulation {delta(exact, ref):.1e}, "
          f"Lightning's own accumulation {delta(native, ref):.1e}")
