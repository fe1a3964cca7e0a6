"""WindowLoss: labels and scores ride along in encode's output (integer and boolean tensors as they are,
float ones as a Constant) and reach the loss joined over the window; a loss that ignores the
representations is refused (issue #34 a)."""
from __future__ import annotations

import pytest
import torch

from contrastive import DualEncoder, largest_difference, twin
from contrastive_labels import labelled_batch, labelled_big_batch_step, labelled_window_loss, split_rows
from gradaccum import Accumulator, WindowLoss
from gradaccum import Constant

TOL = 1e-12



def test_labels_and_scores_ride_along_and_the_step_is_the_big_batch_s():
    model = DualEncoder()
    ref, opt, ref_opt = twin(model, "sgd")
    acc = Accumulator(model, opt)
    wl = labelled_window_loss()
    for step in range(2):
        batch = labelled_batch(11, seed=step)
        result = acc.step(split_rows(batch, [4, 4, 3]), wl)
        labelled_big_batch_step(ref, ref_opt, [batch])
        assert result.num_items == 11
        assert largest_difference(model, ref) < TOL
    # teeth: the labels of one micro-batch only (what a closure over the last micro-batch would see)
    # give another step
    local, _, local_opt = twin(DualEncoder(), "sgd")
    batch = labelled_batch(11, seed=0)
    labelled_big_batch_step(local, local_opt, split_rows(batch, [4, 4, 3])[:1])
    fresh, _, fresh_opt = twin(DualEncoder(), "sgd")
    labelled_big_batch_step(fresh, fresh_opt, [batch])
    assert largest_difference(local, fresh) > 1e-3


def test_a_loss_that_ignores_the_representations_is_refused_before_anything_changes():
    """Issue #34 (a): loss=lambda m, r: m.log_scale.sum() would train the temperature alone."""
    model = DualEncoder()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    wl = WindowLoss(lambda m, b: m(b[0], b[1]), lambda m, r: m.log_scale.sum())
    with pytest.raises(ValueError, match=r"does not depend on the representations encode returned \(its gradient"):
        acc.step(labelled_batch(6, seed=1), wl, micro_batch_size=3)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and acc.steps == 0
    assert all(p.grad is None for p in model.parameters())


def test_constant_wraps_tensors_only():
    with pytest.raises(TypeError, match="Constant\\(tensor\\) takes a tensor, got list"):
        Constant([1.0])
