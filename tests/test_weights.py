"""WindowWeights: the one weighting, count, verdict and skip that every loop drives (_weights.py).

Unit checks of each step against the formulas written out here (an independent oracle: no call into
the formulas), that R is fixed once per state, agreed once, and that the weight of each count is kept in one
place. The steps a framework's hooks add (buffers, hand over, judge): tests/test_window_lifecycle.py. Which
drivers fail when this one implementation is broken is pinned in tests/integrations/test_one_window.py and
the exactness tests."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradaccum import Accumulator
from gradaccum._weights import Verdict
from gradaccum._state import AccumulatorState
from gradaccum._weights import WindowWeights
from helpers import mse, regression_batch, regression_model


def test_counted_first_the_weights_are_the_windows_own_n():
    """N known before the first backward: w_k = n_k W / N, W / N for a summed loss, scale 1."""
    w = WindowWeights(AccumulatorState(), grad_divisor=2.0, num_items=12)
    assert w.reference == 12.0
    assert w.mean_weight(3) == 3 * 2 / 12 and w.sum_weight() == 2 / 12
    count = torch.tensor(5)
    weight = w.mean_weight(count, torch.float32)
    assert weight.dtype == torch.float32 and weight.item() == pytest.approx(5 * 2 / 12)
    closing = w.close(12)
    assert (closing.verdict, closing.scale, closing.num_items) == (Verdict.STEP, 1.0, 12.0)


def test_the_running_r_is_fixed_once_agreed_once_and_kept_in_the_state():
    state, asked = AccumulatorState(), []

    def agree(value):
        asked.append(value)
        return value + 1.0  # what the ranks agreed on (here: another rank's larger count)

    first = WindowWeights(state, 1.0)
    assert first.reference is None
    with pytest.raises(RuntimeError, match="before R was fixed"):
        first.mean_weight(3)
    assert first.fix_reference(3, agree) == 4.0 and first.fix_reference(7, agree) == 4.0
    assert asked == [3.0] and state.reference == 4.0
    assert WindowWeights(state, 1.0).fix_reference(9, agree) == 4.0 and asked == [3.0]  # the next window too
    assert WindowWeights(AccumulatorState(), 1.0).fix_reference(0) == 1.0  # never below 1
    closing = first.close(10, raw_norm=2.0)
    assert closing.scale == 4.0 / 10 and closing.grad_norm == 2.0 * 4.0 / 10


def test_the_verdict_steps_skips_or_raises():
    w = WindowWeights(AccumulatorState(), 1.0, num_items=4)
    assert w.close(0).verdict is Verdict.SKIP_EMPTY and w.close(0).scale == 0.0
    assert w.close(4, loss_sum=math.nan).verdict is Verdict.RAISE
    assert w.close(4, loss_sum=math.nan, nonfinite="skip").verdict is Verdict.SKIP_NONFINITE
    assert w.close(4, raw_norm=math.inf, has_scaler=True).verdict is Verdict.SKIP_NONFINITE


def test_a_window_known_empty_weighs_nothing_and_is_recorded_as_skipped_with_one_warning():
    state = AccumulatorState()
    first, second = WindowWeights(state, 2.0, num_items=0), WindowWeights(state, 2.0, num_items=0)
    assert first.empty and first.mean_weight(3) == 0.0 and first.sum_weight() == 0.0
    with pytest.warns(UserWarning, match="counted 0 items.*skipped; the driver counts them"):
        first.record(first.close(0), warn_empty="the driver counts them")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per state
        second.record(second.close(0), warn_empty="the driver counts them")
    assert (state.steps, state.skipped, state.last_window_items) == (0, 2, None)


def test_record_counts_the_step_and_keeps_the_last_n_with_items():
    state = AccumulatorState()
    w = WindowWeights(state, 1.0, num_items=6)
    w.record(w.close(6))
    w.record(w.close(0))  # an empty window leaves the last N (an R) as it was
    assert (state.steps, state.skipped, state.last_window_items) == (1, 1, 6.0)
    with pytest.raises(AssertionError, match="a window that raises is not recorded"):
        w.record(w.close(6, loss_sum=math.inf))


def test_the_weight_of_each_python_count_is_kept_in_one_place(monkeypatch):
    """mean_weight keeps n_k W / R by Python count in weight_of (a tensor count stays on its device, not
    kept); the Accumulator's window reads and fills the same dict, not a copy of the rule: each count's
    weight is computed once per window."""
    w = WindowWeights(AccumulatorState(), 2.0, num_items=8)
    w.mean_weight(3)
    w.mean_weight(torch.tensor(5))
    assert w.weight_of == {3: 3 * 2 / 8}
    asked = []
    mean_weight = WindowWeights.mean_weight
    monkeypatch.setattr(WindowWeights, "mean_weight", lambda self, n, *a: asked.append(n) or mean_weight(self, n, *a))
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with acc.window(3, num_items=7) as window:  # counted first: R = N = 7
        for n in (3, 3, 1):
            with window.micro_batch():
                window.backward(mse(model, regression_batch(n)), num_items=n)
        assert window.weights.weight_of == {3: 3 / 7, 1: 1 / 7} and asked == [3, 1]
        window.step()
