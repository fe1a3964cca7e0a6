"""A loss that reads labels and scores besides the representations (CoSENT-like ranking of pair scores,
a supervised-contrastive mask from class labels), with its big-batch reference: shared by
tests/test_cached_ride_along.py and the torchrun scenarios (tests/distributed/cached_worker.py)."""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import nn

from contrastive import DIM
from gradaccum import WindowLoss
from gradaccum import Constant


def labelled_batch(n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` (query, document) pairs, a float score per pair, an integer class per query."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, DIM, generator=g, dtype=torch.float64), torch.randn(n, DIM, generator=g, dtype=torch.float64),
            torch.rand(n, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))


def coupled_by_labels(q: torch.Tensor, d: torch.Tensor, score: torch.Tensor, label: torch.Tensor,
                      same: torch.Tensor) -> torch.Tensor:
    """CoSENT over the window (every pair whose score is lower is pushed below every higher one) plus a
    supervised-contrastive term whose positives are the queries of the same class (``same``, a bool
    matrix built from ``label``): both couple every item with every other, through the labels."""
    cos = nn.functional.cosine_similarity(q, d) * 20
    diff = cos[:, None] - cos[None, :]
    higher = score[:, None] < score[None, :]
    cosent = torch.logsumexp(torch.cat([torch.zeros(1, dtype=q.dtype), diff[higher]]), dim=0)
    z = nn.functional.normalize(q, dim=-1)
    sim = (z @ z.T * 5).masked_fill(torch.eye(len(q), dtype=torch.bool), -1e9)
    log_p = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    positives = same & ~torch.eye(len(q), dtype=torch.bool)
    supcon = -(log_p * positives).sum() / positives.sum().clamp(min=1)
    return cosent + supcon + (label.double() * 0).sum()


def labelled_window_loss() -> WindowLoss:
    """encode returns the representations, the scores as a Constant, the labels (integers) and a bool
    row mask as they are; loss gets all of them joined over the window and the ranks."""
    def encode(model, batch):
        q, d = model(batch[0], batch[1])
        return {"q": q, "d": d, "score": Constant(batch[2]), "label": batch[3], "even": batch[3] % 2 == 0}

    def loss(model, r):
        assert r["label"].dtype == torch.long and r["even"].dtype == torch.bool and not r["score"].requires_grad
        same = (r["label"][:, None] == r["label"][None, :]) & (r["even"][:, None] | True)
        return coupled_by_labels(r["q"], r["d"], r["score"], r["label"], same)

    return WindowLoss(encode, loss)


def labelled_big_batch_step(model: nn.Module, opt: torch.optim.Optimizer, batches: Sequence) -> None:
    opt.zero_grad(set_to_none=True)
    q, d, score, label = (torch.cat([b[i] for b in batches]) for i in range(4))
    qr, dr = model(q, d)
    coupled_by_labels(qr, dr, score, label, label[:, None] == label[None, :]).backward()
    opt.step()


def split_rows(batch, sizes):
    """A batch of tensors cut into micro-batches of ``sizes`` rows, in order."""
    out, at = [], 0
    for n in sizes:
        out.append(tuple(t[at:at + n] for t in batch))
        at += n
    return out
