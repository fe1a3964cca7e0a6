"""Tiny Hugging Face causal LMs and padded variable-length batches, shared by the single-process tests
(test_hf.py, test_accelerate.py) and the torchrun worker (distributed/stacks_worker.py).

Nothing is downloaded: models are built from configs with random init, every dropout 0, in float64.
Batches are right-padded (``attention_mask`` 0, ``labels`` -100 on padding), each micro-batch to its
own longest sequence, as a dynamic-padding collator does; the full-batch reference pads the whole
window to its longest.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

from gradaccum import causal_lm_loss

VOCAB = 50


def _causal_lm_loss_type(model: nn.Module) -> nn.Module:
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's class name maps to no loss type: it would log so
    return model


def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                        use_cache=False)
    torch.manual_seed(seed)
    return _causal_lm_loss_type(GPT2LMHeadModel(config).double().train())


def llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         use_cache=False)
    torch.manual_seed(seed)
    return _causal_lm_loss_type(LlamaForCausalLM(config).double().train())


def sequences(lengths: Sequence[int], seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def pad(seqs: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Right-pad to the longest: ``input_ids`` 0, ``attention_mask`` 0 and ``labels`` -100 on padding."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
        labels[i, :len(s)] = s
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def unpad(mb: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    return [ids[:int(m.sum())] for ids, m in zip(mb["input_ids"], mb["attention_mask"])]


def micro_batches(seqs: Sequence[torch.Tensor], split: Sequence[int]) -> List[Dict[str, torch.Tensor]]:
    """The window's sequences cut into micro-batches of ``split`` sequences, each padded on its own."""
    assert sum(split) == len(seqs), (split, len(seqs))
    out, start = [], 0
    for n in split:
        out.append(pad(seqs[start:start + n]))
        start += n
    return out


def lm_loss(model: nn.Module, mb: Dict[str, torch.Tensor]):
    """gradaccum's way: ``(mean over the micro-batch's targets, their count)`` from the float64 logits."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return causal_lm_loss(logits, mb["labels"])


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, window: Sequence[torch.Tensor],
                   scheduler=None) -> float:
    """One optimizer step on the whole window as one padded batch: its mean over every target."""
    opt.zero_grad(set_to_none=True)
    loss, _ = lm_loss(model, pad(window))
    loss.backward()
    opt.step()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def naive_step(model: nn.Module, opt: torch.optim.Optimizer, mbs: Sequence[Dict[str, torch.Tensor]]) -> None:
    """The peers' loop: every micro-batch's mean loss divided by the number of micro-batches.

    The loss is gradaccum's float64 ``causal_lm_loss``, so the only difference from one big batch is
    this weighting: 1/K per micro-batch instead of tokens_k / tokens."""
    opt.zero_grad(set_to_none=True)
    for mb in mbs:
        (lm_loss(model, mb)[0] / len(mbs)).backward()
    opt.step()


def update_error(model: nn.Module, ref: nn.Module, start: nn.Module) -> float:
    """Largest parameter difference from the reference, relative to the reference's largest move."""
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    moved = max((q - s).abs().max().item() for q, s in zip(ref.parameters(), start.parameters()))
    return diff / moved
