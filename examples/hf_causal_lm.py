"""Fine-tune a tiny Hugging Face GPT-2 with padded, variable-length sequences: gradaccum against the
usual ``loss / accumulation_steps`` loop, both measured against one big batch per window.

Micro-batches of padded sequences hold different numbers of target tokens, so the usual loop weighs a
micro-batch of short sequences as much as one of long ones. gradaccum weighs each by its tokens
(``causal_lm_loss`` returns the mean and the count) and takes the very step of one big batch.

The model is built from a config (random init, nothing downloaded) in float64, so that "the same"
means equal to float64's rounding (~1e-12 after AdamW's steps) rather than float32's. Needs
``pip install transformers``.
"""
import copy

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from gradaccum import Accumulator, causal_lm_loss, count_targets, num_steps

torch.manual_seed(0)
VOCAB, MICRO_BATCH, ACCUM = 64, 4, 4

# 56 "documents" of 3 to 30 tokens; every micro-batch is padded to its own longest
docs = [torch.randint(1, VOCAB, (int(n),)) for n in torch.randint(3, 31, (56,))]


def collate(seqs):
    """Right-pad: input_ids 0, attention_mask 0 and labels -100 where there is no token."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(s)] = s, s
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


loader = DataLoader(docs, batch_size=MICRO_BATCH, collate_fn=collate)  # 14 micro-batches: windows 4+4+4+2
config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
model = GPT2LMHeadModel(config).double()
initial, naive_model, big_model = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)


def loss_fn(m, mb):
    """(mean loss over the micro-batch's target tokens, how many there are)"""
    logits = m(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return causal_lm_loss(logits, mb["labels"])


# gradaccum: one optimizer step per window of ACCUM micro-batches (the last window is shorter)
epochs = 2
print(f"{len(loader)} micro-batches of {MICRO_BATCH}, windows of {ACCUM}: "
      f"{num_steps(len(loader), ACCUM, epochs=epochs)} optimizer steps")
acc = Accumulator(model, adamw(model))
for result in acc.train(loader, loss_fn, accum_steps=ACCUM, epochs=epochs,
                        num_items=lambda mb: count_targets(mb["labels"])):
    print(f"step {result.step}: loss {result.loss:.4f} over {result.num_items} tokens")

# the usual loop: loss / ACCUM per micro-batch; and one big batch per window, the reference
naive_opt, big_opt = adamw(naive_model), adamw(big_model)
for epoch in range(epochs):
    batches = list(loader)
    for start in range(0, len(batches), ACCUM):
        window = batches[start:start + ACCUM]
        for mb in window:
            (loss_fn(naive_model, mb)[0] / len(window)).backward()
        naive_opt.step()
        naive_opt.zero_grad()
        docs_in_window = [ids[:int(mask.sum())] for mb in window
                          for ids, mask in zip(mb["input_ids"], mb["attention_mask"])]
        loss_fn(big_model, collate(docs_in_window))[0].backward()
        big_opt.step()
        big_opt.zero_grad()


def distance(m):
    """Largest parameter difference from the big-batch model, relative to how far that one moved."""
    diff = max((p - q).abs().max().item() for p, q in zip(m.parameters(), big_model.parameters()))
    moved = max((q - p0).abs().max().item() for q, p0 in zip(big_model.parameters(), initial.parameters()))
    return diff / moved


print(f"distance from one big batch per window: gradaccum {distance(model):.1e}, "
      f"naive loss/{ACCUM} loop {distance(naive_model):.1e}")
