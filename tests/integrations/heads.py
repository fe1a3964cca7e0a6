"""Tiny float64 BERT classifiers (from configs, dropout 0) and their micro-batches, for ExactTrainer's
heads other than a causal LM: sequence classification (single-label, regression with ``num_labels=1``,
multi-label) and token classification. The reference steps once per window on the model's own loss
over the window joined into one padded batch (``model(**batch).loss``: the loss as the model defines it).
"""
from __future__ import annotations

import copy
from typing import Dict, List, Sequence

import torch
from torch import nn

from integrations import scenarios as S

Batch = Dict[str, torch.Tensor]
#: head kind -> (model class name, config kwargs)
KINDS = {
    "single_label": ("BertForSequenceClassification", {"num_labels": 3}),
    "regression": ("BertForSequenceClassification", {"num_labels": 1}),
    "multi_label": ("BertForSequenceClassification", {"num_labels": 3, "problem_type": "multi_label_classification"}),
    "token": ("BertForTokenClassification", {"num_labels": 3}),
}


def bert(kind: str, seed: int = 0) -> nn.Module:
    import transformers

    name, extra = KINDS[kind]
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **extra)
    torch.manual_seed(seed)
    return getattr(transformers, name)(config).double().train()


def micro_batches(kind: str, sizes: Sequence[int], seed: int = 0) -> List[Batch]:
    """Padded micro-batches of 3-12 tokens; single-label and token labels have some -100 (not counted)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        lengths = torch.randint(3, 13, (n,), generator=g).tolist()
        ids = torch.zeros(n, max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, k in enumerate(lengths):
            ids[i, :k] = torch.randint(1, 50, (k,), generator=g)
            mask[i, :k] = 1
        if kind == "single_label":
            labels = torch.randint(-1, 3, (n,), generator=g)
            labels = labels.where(labels >= 0, torch.full_like(labels, -100))
        elif kind == "regression":
            labels = torch.randn(n, generator=g, dtype=torch.float64)
        elif kind == "multi_label":
            labels = torch.randint(0, 2, (n, 3), generator=g).double()
        else:
            labels = torch.randint(-1, 3, (n, ids.shape[1]), generator=g)
            labels = labels.where((labels >= 0) & (mask == 1), torch.full_like(labels, -100))
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def join(mbs: Sequence[Batch]) -> Batch:
    """Micro-batches as one batch, every sequence padded to the longest (token labels with -100)."""
    longest = max(mb["input_ids"].shape[1] for mb in mbs)

    def padded(t: torch.Tensor, key: str) -> torch.Tensor:
        if t.dim() == 2 and (key != "labels" or t.dtype == torch.long):
            return nn.functional.pad(t, (0, longest - t.shape[1]), value=-100 if key == "labels" else 0)
        return t

    return {k: torch.cat([padded(mb[k], k) for mb in mbs]) for k in mbs[0]}


def reference(model: nn.Module, mbs: Sequence[Batch], accum: int = S.ACCUM, optimizer=S.make_optimizer) -> nn.Module:
    """One step per window on the model's own loss over the window as one batch."""
    model = copy.deepcopy(model)
    opt, sched = optimizer(model.parameters())
    for w in range(0, len(mbs), accum):
        opt.zero_grad(set_to_none=True)
        model(**join(mbs[w:w + accum])).loss.backward()
        opt.step()
        sched.step()
    return model
