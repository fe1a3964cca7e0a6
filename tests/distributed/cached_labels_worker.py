"""WindowLoss under torchrun, 2 gloo processes: labels (integers), masks (booleans) and scores
(Constant floats) returned by encode reach the loss joined over every rank, rank 0's first; a loss
that ignores the representations is refused on every rank alike (issue #34 a)."""
from __future__ import annotations

import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: the contrastive helpers

from contrastive import DualEncoder, largest_difference, twin  # noqa: E402
from contrastive_labels import labelled_batch, labelled_big_batch_step, labelled_window_loss  # noqa: E402
from distributed.worker import main, params_equal_on_all_ranks  # noqa: E402
from gradaccum import Accumulator, WindowLoss  # noqa: E402

RANK, WORLD = 0, 1
TOL = 1e-12
SHARES = [{0: [4, 3], 1: [5]}, {0: [2], 1: [3, 3]}]  # each rank's micro-batch sizes, per window


def _split(batch, sizes):
    out, at = [], 0
    for n in sizes:
        out.append(tuple(t[at:at + n] for t in batch))
        at += n
    return out


def cached_labels_ride_along_joined_across_ranks():
    model = DualEncoder(scale=False)  # no temperature: every parameter is used in the forward (DDP)
    ref, opt, ref_opt = twin(model, "sgd")
    acc = Accumulator(DDP(model), opt)
    wl = labelled_window_loss()
    worst = 0.0
    for w, shares in enumerate(SHARES):
        per_rank = {r: _split(labelled_batch(sum(s), seed=10 * w + r), s) for r, s in shares.items()}
        result = acc.step(per_rank[RANK], wl)
        labelled_big_batch_step(ref, ref_opt, [mb for r in range(WORLD) for mb in per_rank[r]])
        assert result.num_items == sum(sum(s) for s in shares.values())
        worst = max(worst, largest_difference(model, ref))
    assert worst < TOL, worst
    # teeth: each rank's own labels only is another objective
    local, _, local_opt = twin(DualEncoder(scale=False), "sgd")
    labelled_big_batch_step(local, local_opt, _split(labelled_batch(7, seed=0), [4, 3]))
    union, _, union_opt = twin(DualEncoder(scale=False), "sgd")
    labelled_big_batch_step(union, union_opt, _split(labelled_batch(7, seed=0), [4, 3]) + [labelled_batch(5, seed=1)])
    assert largest_difference(local, union) > 1e-3
    assert params_equal_on_all_ranks(model)
    return f"2 windows, uneven ranks: {worst:.1e} from one big batch"


def cached_loss_without_representations_refused_on_every_rank():
    model = DualEncoder()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(DDP(model), torch.optim.SGD(model.parameters(), lr=0.1))
    wl = WindowLoss(lambda m, b: m(b[0], b[1]), lambda m, r: m.module.log_scale.sum())
    try:
        acc.step(_split(labelled_batch(4, seed=RANK), [2, 2]), wl)
    except ValueError as e:
        assert "does not depend on the representations encode returned" in str(e), e
    else:
        raise AssertionError("not refused")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return "refused on both ranks before any backward"


SCENARIOS = [cached_labels_ride_along_joined_across_ranks, cached_loss_without_representations_refused_on_every_rank]

if __name__ == "__main__":
    sys.exit(main(SCENARIOS, globals()))
