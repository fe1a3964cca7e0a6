"""WindowSampler: data order from the seed alone, whatever the world size; resumable anywhere."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradaccum import Accumulator, WindowSampler
from helpers import assert_params_close, mse, reference_step, regression_batch, regression_model


def all_ranks(world: int, **kw):
    return [WindowSampler(rank=r, world_size=world, **kw) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("size, batch, micro, drop_last", [(23, 8, 3, False), (23, 8, 3, True), (16, 16, 4, False),
                                                           (10, 3, 1, False), (7, 4, 8, False)])
def test_global_windows_do_not_depend_on_the_world_size(world, size, batch, micro, drop_last):
    """Each window's items are the same on any number of ranks; ranks split it as evenly as the items
    allow (shares differ by at most one), each share cut into micro-batches of at most m."""
    kw = dict(dataset_size=size, global_batch_size=batch, micro_batch_size=micro, seed=3, drop_last=drop_last)
    single = WindowSampler(rank=0, world_size=1, **kw)
    ranks = all_ranks(world, **kw)
    per_rank = [list(s.windows()) for s in ranks]
    assert {s.num_windows for s in ranks} == {single.num_windows}
    for w, expected in enumerate(single.windows()):
        union = [i for r in range(world) for mb in per_rank[r][w] for i in mb]
        assert union == [i for mb in expected for i in mb] == single.window_items(w)
        shares = [sum(len(mb) for mb in per_rank[r][w]) for r in range(world)]
        assert max(shares) - min(shares) <= 1
        assert all(0 < len(mb) <= micro for r in range(world) for mb in per_rank[r][w])
        assert [len(per_rank[r][w]) for r in range(world)] == [s.window_sizes()[w] for s in ranks]
    items = [i for w in range(single.num_windows) for i in single.window_items(w)]
    assert len(items) == len(set(items)) == (size - size % batch if drop_last else size)


def test_fewer_items_than_ranks_leaves_some_ranks_empty():
    ranks = all_ranks(4, dataset_size=6, global_batch_size=2, micro_batch_size=4, seed=0)
    assert [s.window_sizes() for s in ranks] == [[0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]]


def test_the_order_is_the_seed_and_the_epoch():
    a, b = (WindowSampler(50, 10, 5, seed=1, rank=0, world_size=1) for _ in range(2))
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first and sorted(i for mb in a for i in mb) == list(range(50))
    assert [i for mb in WindowSampler(50, 10, 5, shuffle=False, rank=0, world_size=1) for i in mb] == list(range(50))


def test_position_and_resume_on_another_world_size_and_micro_batch_size():
    kw = dict(dataset_size=40, global_batch_size=8, seed=5)
    whole = WindowSampler(micro_batch_size=4, rank=0, world_size=1, **kw)
    whole.set_epoch(2)
    expected = [whole.window_items(w) for w in range(3, 5)]
    saved = WindowSampler(micro_batch_size=4, rank=0, world_size=2, **kw)
    saved.set_epoch(2)
    saved.advance(3)
    state = saved.state_dict()
    assert state["epoch"] == 2 and state["window"] == 3 and "rank" not in state and "world_size" not in state
    resumed = all_ranks(3, micro_batch_size=3, **kw)
    for s in resumed:
        s.load_state_dict(state)
        s.set_epoch(2)  # the current epoch keeps its position
    remaining = [list(s.windows()) for s in resumed]  # windows 3 and 4 of epoch 2, on 3 ranks
    assert [sorted(i for rank in remaining for i_mb in rank[w] for i in i_mb) for w in range(2)] == \
        [sorted(e) for e in expected]
    resumed[0].set_epoch(3)
    assert resumed[0].start_window == 0


def test_a_state_for_another_data_order_is_refused():
    state = WindowSampler(40, 8, 4, seed=5, rank=0, world_size=1).state_dict()
    other = WindowSampler(40, 16, 4, seed=6, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"another data order: seed=5 \(here 6\), global_batch_size=8 \(here 16\)"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="lacks window"):
        other.load_state_dict({"epoch": 0})


@pytest.mark.parametrize("kw, match", [
    ({"global_batch_size": 0}, "global_batch_size must be a positive int, got 0"),
    ({"micro_batch_size": 2.0}, "micro_batch_size must be a positive int, got 2.0"),
    ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, 2\), got 2"),
    ({"drop_last": True, "dataset_size": 3}, "drop_last=True with dataset_size=3 < global_batch_size=8"),
])
def test_bad_arguments(kw, match):
    args = dict(dataset_size=40, global_batch_size=8, micro_batch_size=4, rank=0, world_size=1)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        WindowSampler(**args)


def test_built_under_a_launcher_before_the_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 before the process group exists.*init_process_group"):
        WindowSampler(40, 8, 4)
    assert WindowSampler(40, 8, 4, rank=1, world_size=2).rank == 1  # told explicitly: fine


def data():
    x, y = regression_batch(29, seed=11)
    return TensorDataset(x, y), x, y


def reference_run(model, opt_name, x, y, sampler_kw, epochs):
    ref, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1) if opt_name == "adamw" else None
    order = WindowSampler(rank=0, world_size=1, **sampler_kw)
    for epoch in range(epochs):
        order.set_epoch(epoch)
        for w in range(order.num_windows):
            idx = torch.tensor(order.window_items(w))
            reference_step(ref, ref_opt, lambda: mse(ref, (x[idx], y[idx])))
    return ref


@pytest.mark.parametrize("workers", [0, 2])
def test_train_over_a_window_sampler_is_one_step_per_global_window(workers):
    dataset, x, y = data()
    kw = dict(dataset_size=29, global_batch_size=8, seed=2)
    model = regression_model()
    ref = reference_run(model, "adamw", x, y, dict(micro_batch_size=3, **kw), epochs=2)
    sampler = WindowSampler(micro_batch_size=3, rank=0, world_size=1, **kw)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers)
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    results = list(acc.train(loader, mse, epochs=2))
    assert [r.num_items for r in results] == [8, 8, 8, 5] * 2
    assert [(r.epoch, r.window) for r in results] == [(e, w) for e in range(2) for w in range(4)]
    assert [r.micro_batches for r in results] == [3, 3, 3, 2] * 2
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["window"] == 4
    assert_params_close(model, ref)


@pytest.mark.parametrize("resume_micro, stop_at", [(3, 5), (2, 5), (3, 8)])
def test_train_resumes_mid_epoch_from_the_sampler_state(resume_micro, stop_at):
    """Stop after 5 windows (mid-epoch) or 8 (the last of epoch 1), save model, optimizer,
    Accumulator and sampler; continue in fresh objects with ``epochs=3 - acc.epoch``. Same
    micro-batch size: bit-identical to the uninterrupted run. Another one: equal in float64."""
    dataset, x, y = data()
    kw = dict(dataset_size=29, global_batch_size=8, seed=2, rank=0, world_size=1)

    def fresh(micro):
        model = regression_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        sampler = WindowSampler(micro_batch_size=micro, **kw)
        return model, opt, Accumulator(model, opt), sampler, DataLoader(dataset, batch_sampler=sampler)

    whole_model, _, whole_acc, _, whole_loader = fresh(3)
    list(whole_acc.train(whole_loader, mse, epochs=3))
    model, opt, acc, sampler, loader = fresh(3)
    for result in acc.train(loader, mse, epochs=3):
        if result.step == stop_at:
            saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                   "acc": acc.state_dict(), "sampler": sampler.state_dict()})
            break
    assert (saved["sampler"]["epoch"], saved["sampler"]["window"]) == ((1, 1) if stop_at == 5 else (1, 4))
    assert saved["acc"]["epoch"] == (1 if stop_at == 5 else 2)  # finished epochs
    model, opt, acc, sampler, loader = fresh(resume_micro)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    acc.load_state_dict(saved["acc"])
    sampler.load_state_dict(saved["sampler"])
    rest = list(acc.train(loader, mse, epochs=3 - acc.epoch))  # what is left of 3 epochs
    assert [r.step for r in rest] == list(range(stop_at + 1, 13))
    assert (rest[0].epoch, rest[0].window) == ((1, 1) if stop_at == 5 else (2, 0))
    if resume_micro == 3:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole_model.parameters()))
    else:
        assert_params_close(model, whole_model)


def test_a_window_that_raised_is_not_counted_done_and_a_resume_trains_it():
    """A window whose step raised (a preemption inside loss_fn, nonfinite="raise") took no step: the sampler's
    position, which a checkpoint saves, still points at it, so a resume from the checkpoint taken after the
    error trains it, and the run is the uninterrupted one bit for bit. A position counted as done would skip
    the window's items."""
    dataset, _, _ = data()
    kw = dict(dataset_size=29, global_batch_size=8, micro_batch_size=3, seed=2, rank=0, world_size=1)

    def fresh():
        model = regression_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        sampler = WindowSampler(**kw)
        return model, opt, Accumulator(model, opt), sampler, DataLoader(dataset, batch_sampler=sampler)

    whole_model, _, whole_acc, _, whole_loader = fresh()
    list(whole_acc.train(whole_loader, mse))
    calls = []

    class Preempted(Exception):
        pass

    def preempted(model, mb):
        calls.append(1)
        if len(calls) == 5:  # window 1's second micro-batch (3 per window of 8)
            raise Preempted
        return mse(model, mb)

    model, opt, acc, sampler, loader = fresh()
    with pytest.raises(Preempted):
        list(acc.train(loader, preempted))
    assert acc.steps == 1 and sampler.state_dict()["window"] == 1  # window 1 is still to do
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict(),
                           "sampler": sampler.state_dict()})
    model, opt, acc, sampler, loader = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    acc.load_state_dict(saved["acc"])
    sampler.load_state_dict(saved["sampler"])
    rest = list(acc.train(loader, mse, epochs=1 - acc.epoch))
    assert [(r.window, r.step) for r in rest] == [(1, 2), (2, 3), (3, 4)]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole_model.parameters()))


def test_train_refuses_accum_steps_or_drop_last_beside_a_window_sampler():
    dataset, _, _ = data()
    loader = DataLoader(dataset, batch_sampler=WindowSampler(29, 8, 3, rank=0, world_size=1))
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already cuts the epoch into windows .* drop accum_steps"):
        acc.train(loader, mse, accum_steps=4)
    with pytest.raises(ValueError, match=r"WindowSampler\(..., drop_last=True\)"):
        acc.train(loader, mse, drop_last=True)
    with pytest.raises(ValueError, match="accum_steps is required"):
        acc.train(list(loader), mse)


def test_train_called_once_per_epoch_trains_a_new_epoch_each_time():
    """The usual loop with an evaluation between epochs: each call continues from the sampler's
    position (a finished epoch moves on to the next), bit-identical to one call for all epochs."""
    dataset, _, _ = data()
    kw = dict(dataset_size=29, global_batch_size=8, micro_batch_size=3, seed=2, rank=0, world_size=1)

    def fresh():
        model = regression_model()
        sampler = WindowSampler(**kw)
        return model, Accumulator(model, torch.optim.AdamW(model.parameters(), lr=0.01)), sampler, \
            DataLoader(dataset, batch_sampler=sampler)

    once, acc, _, loader = fresh()
    whole = list(acc.train(loader, mse, epochs=3))
    model, acc, sampler, loader = fresh()
    per_epoch = [list(acc.train(loader, mse)) for _ in range(3)]
    assert [[(r.epoch, r.window) for r in rs] for rs in per_epoch] == \
        [[(e, w) for w in range(4)] for e in range(3)]
    assert [r.loss for rs in per_epoch for r in rs] == [r.loss for r in whole]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), once.parameters()))
