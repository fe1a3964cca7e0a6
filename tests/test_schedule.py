"""num_steps counts the optimizer steps Accumulator.train takes, so schedules can be sized up front."""
from __future__ import annotations

import pytest
import torch

from gradaccum import Accumulator, num_steps
from helpers import mse, regression_batch, regression_model


def micro_batches(m: int):
    return [regression_batch(2, seed=i) for i in range(m)]


@pytest.mark.parametrize("m", [1, 7, 8, 9])
@pytest.mark.parametrize("accum", [1, 3, 4, {0: 2, 1: 5}, lambda e: 1 + e])
@pytest.mark.parametrize("drop_last", [False, True])
def test_num_steps_is_what_train_takes(m, accum, drop_last):
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.01))
    taken = list(acc.train(micro_batches(m), mse, accum_steps=accum, epochs=3, drop_last=drop_last))
    assert num_steps(m, accum, epochs=3, drop_last=drop_last) == len(taken) == acc.steps


def test_num_steps_sizes_a_one_cycle_schedule_that_the_short_last_window_does_not_overrun():
    """The issue's OneCycleLR(total_steps=len(loader) // accum_steps) raised on the short last window;
    sized with num_steps it runs to its end exactly."""
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = micro_batches(10)
    total = num_steps(len(loader), 4, epochs=2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
    results = list(Accumulator(model, opt, scheduler=sched).train(loader, mse, accum_steps=4, epochs=2))
    assert len(results) == total == 6 and sched.last_epoch == total


def test_num_steps_errors():
    with pytest.raises(ValueError, match=r"num_micro_batches must be an int >= 0 \(e.g. len\(loader\)\), got -1"):
        num_steps(-1, 4)
    with pytest.raises(ValueError, match="accum_steps must be a positive int, got 0"):
        num_steps(10, 0)
    with pytest.raises(ValueError, match="epochs must be a positive int, got 0"):
        num_steps(10, 2, epochs=0)
