"""A small float64 dual encoder and losses that couple the window's items, with their big-batch
reference: shared by tests/test_cached.py and the torchrun scenarios (tests/distributed/cached_worker.py)."""
from __future__ import annotations

import copy
from typing import List, Sequence, Tuple

import torch
from torch import nn

from gradaccum import WindowLoss

DIM = 6


class DualEncoder(nn.Module):
    """Query and document towers, and (``scale=True``) a learned log-temperature the loss reads."""

    def __init__(self, seed: int = 0, dropout: float = 0.0, scale: bool = True, buffer: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.query = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 8))
        self.doc = nn.Sequential(nn.Linear(DIM, 8), nn.Dropout(dropout))
        # 1-d: fully_shard refuses 0-d parameters
        self.log_scale = nn.Parameter(torch.tensor([0.5])) if scale else None
        if buffer:  # DDP broadcasts buffers in a window's first forward: a collective
            self.register_buffer("shift", torch.zeros(8))
        self.double()

    def forward(self, queries: torch.Tensor, docs: torch.Tensor):
        q = self.query(queries)
        d = self.doc(docs.reshape(-1, DIM)).reshape(*docs.shape[:-1], 8)
        if hasattr(self, "shift"):
            q = q + self.shift
        return q, d


def pair_batch(n: int, seed: int = 1, negatives: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` queries and, per query, one positive document (and ``negatives`` hard negatives)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    shape = (n, DIM) if negatives == 0 else (n, 1 + negatives, DIM)
    return q, torch.randn(*shape, generator=g, dtype=torch.float64)


def in_batch_negatives(q: torch.Tensor, d: torch.Tensor, log_scale) -> torch.Tensor:
    """Symmetric InfoNCE over the window (CLIP's loss): item i's positive is document i; every other
    document of the window, and every hard negative (``d`` of shape (n, 1 + neg, dim)), is a negative."""
    q = nn.functional.normalize(q, dim=-1)
    positives = d if d.dim() == 2 else d[:, 0]
    docs = d.reshape(-1, d.shape[-1]) if d.dim() == 3 else d
    docs = nn.functional.normalize(docs, dim=-1)
    scale = log_scale.exp().reshape(()) if log_scale is not None else 10.0
    logits = q @ docs.T * scale
    stride = 1 if d.dim() == 2 else d.shape[1]
    target = torch.arange(len(q), device=q.device) * stride
    back = nn.functional.normalize(positives, dim=-1) @ q.T * scale
    return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(back, torch.arange(len(q)))) / 2


def window_loss(scale_of) -> WindowLoss:
    """A WindowLoss over (queries, docs) batches; ``scale_of()`` is the log-temperature parameter."""
    return WindowLoss(lambda model, batch: model(*batch), lambda model, reps: in_batch_negatives(*reps, scale_of()))


def big_batch_step(model: nn.Module, opt: torch.optim.Optimizer, batches: Sequence, *, max_grad_norm=None) -> float:
    """One optimizer step on the loss of the union of ``batches`` (in order): the reference."""
    opt.zero_grad(set_to_none=True)
    q = torch.cat([b[0] for b in batches])
    d = torch.cat([b[1] for b in batches])
    loss = in_batch_negatives(*model(q, d), model.log_scale)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return loss.item()


def per_micro_batch_step(model: nn.Module, opt: torch.optim.Optimizer, batches: Sequence) -> None:
    """Plain accumulation (each micro-batch's loss, item-weighted): another objective."""
    opt.zero_grad(set_to_none=True)
    n = sum(len(b[0]) for b in batches)
    for q, d in batches:
        (in_batch_negatives(*model(q, d), model.log_scale) * len(q) / n).backward()
    opt.step()


def largest_difference(a: nn.Module, b: nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def twin(model: nn.Module, opt_name: str = "adamw"):
    ref = copy.deepcopy(model)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1)}[opt_name]
    return ref, make(model.parameters()), make(ref.parameters())


def split(batch, sizes: List[int]):
    out, at = [], 0
    for n in sizes:
        out.append(tuple(t[at:at + n] for t in batch))
        at += n
    return out
