"""The window's fast paths (one process, fp32, int counts, a bare mean loss) give what the general paths give.

Section 1 of ``make bench`` times a window whose micro-batches take the short way through
:class:`gradaccum._window.Window` and :class:`gradaccum._boundary.Tally`: an int count accepted as it is,
a plain scalar loss, one shared micro-batch context, the backward through the seam directly, the loss sum
read on the host. Each test runs the same window down the general path beside it (a float or tensor count,
a ``(mean, count)`` pair, a hand-written window) and against the float64 big batch.
"""
from __future__ import annotations

import copy

import pytest
import torch

from gradaccum import Accumulator
from gradaccum._boundary import Tally
from helpers import (RTOL, assert_params_close, clone_pair, concat, make_optimizer, mse, reference_step, regression_batch,
                     regression_model)

SIZES = [5, 1, 3, 7]


def _window():
    return [regression_batch(n, seed=40 + i) for i, n in enumerate(SIZES)]


def _run(count, windows=2):
    """``windows`` windows of the same micro-batches through ``acc.window``, each counted by ``count(n)``."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for _ in range(windows):
        with acc.window(len(SIZES)) as window:
            for mb, n in zip(_window(), SIZES):
                with window.micro_batch():
                    window.backward(mse(model, mb), count(n))
            losses.append(window.step().loss)
    return model, losses


def test_host_loss_sum_is_the_device_sum():
    """The loss sum read on the host (one process) is the float64 sum on the device, bit for bit, and
    the item-weighted sum of the micro-batches' means."""
    means = [torch.tensor(v, dtype=torch.float32) for v in (0.3, 1.7, 0.05, 2.2)]
    tally = Tally(list(zip(means, SIZES)), torch.float64)
    host, _ = tally.read()
    assert host == tally.loss_sum.item()
    assert host == pytest.approx(sum(float(m) * n for m, n in zip(means, SIZES)), rel=1e-15)


def test_int_counts_equal_float_and_tensor_counts():
    """An int count takes the short way; a float count the general checks, a tensor count the device
    path (its weight a tensor, its loss summed on the device): the same step, and (float) the same bits."""
    fast, fast_losses = _run(int)
    general, general_losses = _run(float)
    device, device_losses = _run(lambda n: torch.tensor(n))
    for a, b in zip(fast.parameters(), general.parameters()):
        assert torch.equal(a, b)
    assert fast_losses == general_losses
    assert_params_close(fast, device)
    assert fast_losses == pytest.approx(device_losses, rel=1e-15)


def test_step_fast_path_equals_big_batch_and_the_pair_path():
    """``acc.step`` over bare means (the fast path) against ``loss_fn`` returning ``(mean, count)`` (the
    general path) and the float64 big batch, over two windows (momentum carries over)."""
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    pair_model = copy.deepcopy(model)
    acc = Accumulator(model, opt)
    pair_acc = Accumulator(pair_model, make_optimizer("sgd", pair_model.parameters()))
    for _ in range(2):
        window = _window()
        result = acc.step(window, mse)
        pair = pair_acc.step(window, lambda m, b: (mse(m, b), b[0].shape[0]))
        ref_loss = reference_step(ref, ref_opt, lambda: mse(ref, concat(window)))
        assert_params_close(model, ref)
        assert result.loss == pytest.approx(ref_loss, rel=RTOL)
        assert (result.loss, result.num_items) == (pair.loss, pair.num_items)
        for a, b in zip(model.parameters(), pair_model.parameters()):
            assert torch.equal(a, b)


def test_zero_count_still_weighs_nothing():
    """An int count of 0 leaves the short way: its nan mean reaches neither the gradient nor the loss, and
    the step is the one on the other micro-batch alone."""
    model = regression_model()
    start = copy.deepcopy(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with acc.window(2) as window:
        with window.micro_batch():
            window.backward(mse(model, regression_batch(3, seed=2)), 3)
        with window.micro_batch():
            x, y = regression_batch(2, seed=3)
            window.backward(mse(model, (x[:0], y[:0])), 0)  # a mean over no item: nan, with a zero gradient
        result = window.step()
    assert not result.skipped and result.num_items == 3
    ref = copy.deepcopy(start)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_loss = reference_step(ref, ref_opt, lambda: mse(ref, regression_batch(3, seed=2)))
    assert result.loss == pytest.approx(ref_loss, rel=RTOL)
    assert_params_close(model, ref)


@pytest.mark.parametrize("bad, match", [(torch.ones(2, requires_grad=True), "scalar"),
                                        (torch.tensor(1.0), "does not require grad")])
def test_a_loss_the_short_way_cannot_take_is_still_refused(bad, match):
    """The short way accepts only a plain 0-d tensor that requires grad; anything else gets the checks."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with acc.window(1) as window:
        with window.micro_batch():
            with pytest.raises(ValueError, match=match):
                window.backward(bad, 2)
        window.abandon()


def test_a_tuple_whose_leading_dimensions_disagree_is_refused():
    """The short count of an ``(inputs, targets)`` micro-batch checks every tensor's leading dimension."""
    from gradaccum.errors import SplitError
    x, y = regression_batch(3, seed=5)
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(SplitError, match=r"window\[1\]\[0\] has 3 items but window\[1\]\[1\] has 2"):
        acc.step([(x, y), (x, y[:2])], mse)
    assert acc.steps == 0


def test_a_window_leaves_nothing_for_the_garbage_collector():
    """A window's objects are freed as it ends (no reference cycle): the cycle collector finds nothing,
    so the short ways cost no collection of their own (nor keep a window's tally alive until one)."""
    import gc

    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.step(_window(), mse)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            acc.step(_window(), mse)
            with acc.window(1) as window:
                with window.micro_batch():
                    window.backward(mse(model, regression_batch(2, seed=9)), 2)
                window.step()
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_a_tensor_count_is_summed_in_float64_whatever_the_losss_dtype():
    """``(mean, count)`` with a half-precision mean and a tensor count: ``n_k L_k`` is summed in float64 (the count
    converted as it is filed), not in the loss's dtype, where 5000 * 900 overflows fp16 and the window would be
    skipped as not finite."""
    model = torch.nn.Linear(4, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = torch.randn(8, 4), 30 + torch.randn(8, 1)
    means = []

    def loss_fn(m, mb):
        mean = ((m(mb[0]) - mb[1]) ** 2).mean().half()
        means.append(mean.item())
        return mean, torch.tensor(5000)

    result = acc.step((x, y), loss_fn, micro_batch_size=4)
    assert not result.skipped and result.loss == (means[0] + means[1]) / 2
