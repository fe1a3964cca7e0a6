"""WindowLoss(keep_graphs=...): the micro-batches whose pass-1 graph is kept are backpropagated from it,
without a second forward; the step equals the one where every forward is replayed (dropout on: the
replay draws what the kept graph drew) and the float64 big batch's."""
from __future__ import annotations

import pytest
import torch

from contrastive import DualEncoder, big_batch_step, in_batch_negatives, largest_difference, pair_batch, twin
from gradaccum import Accumulator, WindowLoss


def _step(keep: int, dropout: float, micro_batch_size: int = 3):
    model = DualEncoder(dropout=dropout)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5))
    calls = []

    def encode(m, b):
        calls.append(torch.is_grad_enabled())
        return m(*b)

    wl = WindowLoss(encode, lambda m, r: in_batch_negatives(*r, m.log_scale), keep_graphs=keep)
    torch.manual_seed(3)
    acc.step(pair_batch(11, seed=2), wl, micro_batch_size=micro_batch_size)
    return model, calls, torch.get_rng_state()


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_a_kept_graph_equals_the_replayed_one_and_saves_its_forward(keep):
    replayed, calls0, rng0 = _step(0, dropout=0.3)
    kept, calls, rng = _step(keep, dropout=0.3)
    assert largest_difference(kept, replayed) < 1e-15
    assert torch.equal(rng, rng0)  # the window drew its random numbers once either way
    assert len(calls0) == 8 and len(calls) == 8 - keep  # 4 micro-batches: 4 + 4 forwards, less the kept
    assert calls[:4] == [True] * keep + [False] * (4 - keep)  # pass 1 ran the first `keep` forwards with a graph


def test_kept_graphs_are_the_big_batch_s_step():
    model, _, _ = _step(2, dropout=0.0)
    ref, _, ref_opt = twin(DualEncoder(), "sgd")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    big_batch_step(ref, ref_opt, [pair_batch(11, seed=2)])
    assert largest_difference(model, ref) < 1e-12


def test_keep_graphs_must_be_a_count():
    with pytest.raises(ValueError, match=r"keep_graphs=-1\): how many micro-batches' graphs"):
        WindowLoss(lambda m, b: m(*b), lambda m, r: r[0].sum(), keep_graphs=-1)
