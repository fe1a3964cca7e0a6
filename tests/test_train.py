"""Accumulator.train: windows of accum_steps, short last windows exact, schedules, drop_last."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradaccum import Accumulator
from helpers import assert_params_close, clone_pair, mse, reference_step, regression_batch, regression_model


def loader_of(n: int, batch_size: int):
    x, y = regression_batch(n, seed=7)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False), (x, y)


def reference_epochs(ref, ref_opt, data, window_items, epochs):
    x, y = data
    for _ in range(epochs):
        start = 0
        for items in window_items:
            sl = slice(start, start + items)
            reference_step(ref, ref_opt, lambda: mse(ref, (x[sl], y[sl])))
            start += items


@pytest.mark.parametrize("n, batch_size, accum, expect", [
    (23, 3, 4, [12, 11]),       # 8 loader batches (last of 2 items): 4 + 4 micro-batches
    (23, 5, 2, [10, 10, 3]),    # short last window of one 3-item micro-batch
    (9, 2, 8, [9]),             # one window, accum larger than the epoch
])
def test_windows_and_short_last_window(n, batch_size, accum, expect):
    loader, data = loader_of(n, batch_size)
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "adamw")
    results = list(Accumulator(model, opt).train(loader, mse, accum_steps=accum, epochs=2))
    reference_epochs(ref, ref_opt, data, expect, epochs=2)
    assert [r.num_items for r in results] == expect * 2
    assert [r.epoch for r in results] == [0] * len(expect) + [1] * len(expect)
    assert results[-1].step == 2 * len(expect)
    assert_params_close(model, ref)


def test_drop_last_skips_the_short_window():
    loader, data = loader_of(23, 5)
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    results = list(Accumulator(model, opt).train(loader, mse, accum_steps=2, drop_last=True))
    reference_epochs(ref, ref_opt, data, [10, 10], epochs=1)
    assert [r.num_items for r in results] == [10, 10]
    assert_params_close(model, ref)


@pytest.mark.parametrize("schedule", [{0: 1, 1: 3}, lambda epoch: 1 if epoch == 0 else 3])
def test_accumulation_schedule(schedule):
    loader, data = loader_of(12, 2)
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    results = list(Accumulator(model, opt).train(loader, mse, accum_steps=schedule, epochs=2))
    assert [r.micro_batches for r in results] == [1] * 6 + [3] * 2  # the schedule's factor, as run
    reference_epochs(ref, ref_opt, data, [2] * 6, epochs=1)
    reference_epochs(ref, ref_opt, data, [6, 6], epochs=1)
    assert_params_close(model, ref)


def test_schedule_before_first_key_is_one():
    from gradaccum import AccumSchedule
    s = AccumSchedule({2: 4, 5: 8})
    assert [s(e) for e in range(7)] == [1, 1, 4, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="accum_steps for epoch 0 must be a positive int, got 0"):
        AccumSchedule(lambda e: 0)(0)


class _EpochSampler(torch.utils.data.Sampler):
    """Four items in order; records the epochs it is told (as DistributedSampler is)."""

    def __init__(self):
        self.calls = []

    def __iter__(self):
        return iter(range(4))

    def __len__(self):
        return 4

    def set_epoch(self, e):
        self.calls.append(e)


def test_set_epoch_is_called_on_the_sampler():
    x, y = regression_batch(4)
    sampler = _EpochSampler()
    calls = sampler.calls
    loader = DataLoader(TensorDataset(x, y), batch_size=2, sampler=sampler)
    model = regression_model()
    list(Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)).train(loader, mse, accum_steps=2, epochs=3))
    assert calls == [0, 1, 2]


def test_train_called_once_per_epoch_tells_the_sampler_a_new_epoch_each_time():
    """A DistributedSampler-style loop calling train() once per epoch: the epochs count on (0, 1, 2),
    so the sampler shuffles anew each time, and acc.epoch is saved for a resume."""
    x, y = regression_batch(4)
    sampler = _EpochSampler()
    calls = sampler.calls
    loader = DataLoader(TensorDataset(x, y), batch_size=2, sampler=sampler)
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    epochs = [[r.epoch for r in acc.train(loader, mse, accum_steps=2)] for _ in range(3)]
    assert calls == [0, 1, 2] and epochs == [[0], [1], [2]]
    assert acc.state_dict()["epoch"] == 3


@pytest.mark.parametrize("num_items", [None, lambda mb: len(mb["y"])])
def test_batches_that_carry_a_scalar_tensor_train_exactly(num_items):
    """A loader batch holding a 0-d tensor (its index) is carried, not refused (issue 26, item 4)."""
    x, y = regression_batch(11, seed=3)
    batches = [{"x": x[i:i + 3], "y": y[i:i + 3], "idx": torch.tensor(i)} for i in range(0, 11, 3)]
    seen = []

    def loss_fn(model, mb):
        seen.append(int(mb["idx"]))
        return mse(model, (mb["x"], mb["y"]))

    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "adamw")
    results = list(Accumulator(model, opt).train(batches, loss_fn, accum_steps=3, num_items=num_items))
    reference_epochs(ref, ref_opt, (x, y), [9, 2], epochs=1)
    assert [r.num_items for r in results] == [9, 2] and seen == [0, 3, 6, 9]
    assert_params_close(model, ref)


def test_the_resume_recipe_on_a_finished_run_trains_nothing():
    """Issue 34, item 4: docs/guides/train.md's `epochs=E - acc.epoch` is 0 once the run is finished;
    that raised "epochs must be a positive int, got 0". Now it trains nothing, as the CLI does."""
    loader, _ = loader_of(12, 3)
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(list(acc.train(loader, mse, accum_steps=2, epochs=2))) == 4 and acc.epoch == 2
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "acc": acc.state_dict()}
    fresh = regression_model(seed=5)
    fresh.load_state_dict(state["model"])
    resumed = Accumulator(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    resumed.load_state_dict(state["acc"])
    assert list(resumed.train(loader, mse, accum_steps=2, epochs=2 - resumed.epoch)) == []
    assert resumed.steps == 4 and all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
