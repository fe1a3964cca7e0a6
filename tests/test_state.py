"""AccumulatorState: what one window teaches the next lives in one object; state_dict is derived from
it, every saved field round-trips, nothing is written onto the user's objects, and what a window will
do (plan, R, exchange, padding) is a function of the state and the request, testable without ranks."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from gradaccum import Accumulator, ConfigurationError, WindowLoss
from gradaccum._ranks import RankAgreement, Rules, Plan, Request, local_plan, padded_count, window_setup
from gradaccum._state import SAVED_KEYS, AccumulatorState
from gradaccum.sync import GradSync
from helpers import assert_params_close, clone_pair, mse, reference_step, regression_batch, regression_model

ALONE = Rules(shares_windows=False, needs_equal_counts=False)
DDP = Rules(shares_windows=True, needs_equal_counts=False)
FSDP = Rules(shares_windows=True, needs_equal_counts=True)


def _distinct_values():
    """A value for every saved field, none its default, each of the field's type."""
    return {"steps": 7, "skipped": 2, "epoch": 3, "reference": 41.0, "count_ratio": 2.5,
            "last_window_items": 96.0, "auto_micro_batch_size": 16,
            "counts_first": True, "scheduler_at": 5}


def test_every_saved_field_round_trips_through_state_dict():
    saved = [f.name for f in dataclasses.fields(AccumulatorState) if f.metadata.get("saved")]
    values = _distinct_values()
    assert sorted(saved) == sorted(values), "a saved field has no test value: add it here"
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for name, value in values.items():
        setattr(acc.state, name, value)
    state = acc.state_dict()
    assert set(state) == set(SAVED_KEYS) | {"precision"}
    other = regression_model()
    restored = Accumulator(other, torch.optim.SGD(other.parameters(), lr=0.1))
    restored.load_state_dict(state)
    assert {name: getattr(restored.state, name) for name in values} == values
    assert restored.steps == 7 and restored.epoch == 3 and restored.auto_micro_batch_size == 16


def test_a_checkpoint_of_an_earlier_version_still_loads():
    """The keys earlier gradaccum wrote (reference_items, last_items: now reference, last_window_items, the
    fields' names), and a state without the newer ones."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.load_state_dict({"steps": 5, "skipped": 1, "epoch": 2, "auto_micro_batch_size": None,
                         "reference_items": 12.0, "count_ratio": 1.5, "last_items": 30.0,
                         "precision": acc.precision.state_dict()})
    assert (acc.state.reference, acc.state.count_ratio, acc.state.last_window_items) == (12.0, 1.5, 30.0)
    assert set(acc.state_dict()) >= {"reference", "last_window_items"}
    assert not set(acc.state_dict()) & {"reference_items", "last_items"}
    acc.load_state_dict({"steps": 9, "precision": acc.precision.state_dict()})
    assert acc.steps == 9 and acc.state.reference is None and acc.state.count_ratio == 1.0


def test_a_bad_saved_value_is_refused_before_any_field_changes():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.state.steps = 3
    fp16 = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    before = copy.deepcopy(fp16.precision.state_dict())
    changed = copy.deepcopy(before)
    changed["scaler"]["scale"] = 8.0
    for target, precision in ((acc, acc.precision.state_dict()), (fp16, changed)):
        target.state.steps = 3
        with pytest.raises(ConfigurationError, match="count_ratio='many' is not a number"):
            target.load_state_dict({"steps": 8, "count_ratio": "many", "precision": precision})
        assert target.steps == 3
    assert fp16.precision.state_dict() == before  # the scaler is not loaded either


def _own_window(acc, model, micro_batches):
    """A hand-written window opened without an item count: R is fixed by its first backward."""
    with acc.window(len(micro_batches)) as w:
        for mb in micro_batches:
            with w.micro_batch():
                w.backward(mse(model, mb), num_items=len(mb[0]))
        return w.step()


def test_a_resumed_run_is_bit_identical_with_a_learned_reference():
    """R fixed by the first window (no count up front) is saved: the resumed run divides by the same
    R and rounds as the uninterrupted one, bit for bit."""
    windows = [[regression_batch(n, seed=s) for n, s in [(3, 1), (5, 2)]],
               [regression_batch(n, seed=s) for n, s in [(4, 3), (2, 4)]],
               [regression_batch(n, seed=s) for n, s in [(6, 5), (1, 6)]]]
    model = regression_model()
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    for w in windows[:2]:
        _own_window(acc, model, w)
    ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": copy.deepcopy(acc.optimizer.state_dict()), "acc": acc.state_dict()}
    assert ckpt["acc"]["reference"] == 3.0  # the first micro-batch's count, kept
    _own_window(acc, model, windows[2])
    again = regression_model(seed=9)
    again.load_state_dict(ckpt["model"])
    opt = torch.optim.AdamW(again.parameters(), lr=0.1)
    opt.load_state_dict(ckpt["opt"])
    resumed = Accumulator(again, opt)
    resumed.load_state_dict(ckpt["acc"])
    _own_window(resumed, again, windows[2])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def _counted_window(acc, model, micro_batches, counts):
    """A hand-written window whose micro-batches count ``counts`` items (0: every item ignored)."""
    with acc.window(len(micro_batches)) as w:
        for mb, n in zip(micro_batches, counts):
            with w.micro_batch():
                w.backward(mse(model, mb), num_items=n)
        return w.step()


def test_a_resume_after_a_skipped_window_is_the_uninterrupted_run():
    """Windows 1-3 (the second of 0 items: skipped, AdamW with weight decay would move on it), a
    checkpoint, windows 4-5 of which the first starts with a micro-batch of 0 items: the resumed run
    (model, optimizer, acc.state_dict()) ends bit-identical to the uninterrupted one, its state counting
    the skip and dividing by the saved R (3, not the resumed run's own first count)."""
    batches = [regression_batch(n, seed=s) for n, s in [(3, 1), (5, 2), (4, 3), (2, 4), (6, 5), (1, 6),
                                                        (2, 7), (5, 8), (4, 9), (3, 10)]]
    counts = [3, 5, 0, 0, 6, 1, 0, 5, 4, 3]
    windows = [(batches[i:i + 2], counts[i:i + 2]) for i in range(0, 10, 2)]
    model = regression_model()
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1))
    with pytest.warns(UserWarning, match="counted 0 items"):
        results = [_counted_window(acc, model, *w) for w in windows[:3]]
    assert [r.skipped for r in results] == [False, True, False] and acc.state.skipped == 1
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(acc.optimizer.state_dict()),
            "acc": acc.state_dict()}
    for w in windows[3:]:
        _counted_window(acc, model, *w)
    again = regression_model(seed=9)
    again.load_state_dict(ckpt["model"])
    opt = torch.optim.AdamW(again.parameters(), lr=0.1, weight_decay=0.1)
    opt.load_state_dict(ckpt["opt"])
    resumed = Accumulator(again, opt)
    resumed.load_state_dict(ckpt["acc"])
    for w in windows[3:]:
        _counted_window(resumed, again, *w)
    assert (resumed.state.steps, resumed.state.skipped, resumed.state.reference) == (4, 1, 3.0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_nothing_is_written_onto_the_users_window_loss():
    """The replay check of a WindowLoss is remembered in acc.state (weakly), not on the user's object."""
    model = torch.nn.Linear(4, 3).double()
    loss = WindowLoss(lambda m, b: m(b), lambda m, z: (z - z.mean(0)).pow(2).mean())
    before = dict(vars(loss))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.step(torch.randn(8, 4, dtype=torch.float64), loss, micro_batch_size=3)
    assert vars(loss) == before and loss in acc.state.checked_replays
    other = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert loss not in other.state.checked_replays  # each Accumulator checks its own first window


def test_a_window_learns_r_and_the_count_source_into_the_state():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.step([regression_batch(3), regression_batch(5, seed=2)], lambda m, b: (mse(m, b), 2 * len(b[0])))
    assert acc.state.count_ratio == 2.0 and acc.state.steps == 1
    with acc.window(1) as w:  # no count up front: R fixed by the first backward, kept in the state
        with w.micro_batch():
            w.backward(mse(model, regression_batch(6)), num_items=6)
        assert w.weights.reference == 6.0 == acc.state.reference
        w.step()


# -- what a window will do, without any rank ---------------------------------------------------------

def test_one_process_plans_alone_with_r_its_count():
    state = AccumulatorState()
    plan = local_plan(state, ALONE, Request(3, items=12))
    setup = window_setup(state, ALONE, Request(3, items=12), plan)
    assert plan == Plan(3, 3, 3, 12.0) and setup.reference == 12.0 and setup.padding == 0
    state.count_ratio = 1.5  # loss_fn counted 1.5 tokens per row last time: R follows
    assert window_setup(state, ALONE, Request(3, items=12), plan).reference == 18.0
    # opened without a size: R is the count given, else fixed at the first backward (None here)
    assert window_setup(state, ALONE, Request(None, items=5), None).reference == 5.0
    assert window_setup(state, ALONE, Request(None), None).reference is None


def test_ddp_plans_alone_only_once_every_rank_can_pad():
    state = AccumulatorState()
    assert local_plan(state, DDP, Request(2, can_pad=True)) is None  # the first window asks
    state.peers_can_pad = True
    assert local_plan(state, DDP, Request(0, can_pad=True)) == Plan(0, 1, 0, None)
    assert local_plan(state, DDP, Request(2, can_pad=False)) is None
    assert local_plan(state, FSDP, Request(2, can_pad=True)) is None  # FSDP2 always asks
    setup = window_setup(state, DDP, Request(0, can_pad=True), Plan(0, 1, 0, None))
    assert setup.reference is None and setup.padding == 1 and setup.counted is None
    state.last_window_items = 40.0  # planned alone once a window had items: R is that N, rescaled at the boundary
    assert window_setup(state, DDP, Request(0, can_pad=True), Plan(0, 1, 0, None)).reference == 40.0


def test_only_the_first_window_across_ranks_counts_first():
    """Planned alone (or over equal shares) once every rank counted its items up front in the last
    window (state.counts_first, the same on every rank), a window with no N before it opens
    an all-reduce of the counts (a stand-in sync sums one rank's here) and R is that N, times the last
    window's count ratio; a rank without a count this time still takes part (nan: then R runs on every
    rank). Once a window had items, R is its N (the same on every rank), no count is asked, and the
    boundary's one all-reduce rescales by R / N: one collective per window. Where the agreement was
    asked (it carries N or says some rank has none), nothing is counted."""
    state = AccumulatorState(peers_can_pad=True)
    ranks = RankAgreement(GradSync(), torch.device("cpu"), state, DDP)
    assert ranks.open(Request(2, items=7, can_pad=True)).counted is None  # not yet known of every rank
    state.counts_first = True
    setup = ranks.open(Request(2, items=7, can_pad=True))
    assert setup.counted is not None and setup.reference is None and setup.counted.value is None
    assert ranks.reference(setup) == 7.0 and setup.counted.value == 7.0  # read at the first backward
    state.count_ratio = 2.0
    assert ranks.reference(ranks.open(Request(2, items=7, can_pad=True))) == 14.0
    without = ranks.open(Request(2, can_pad=True))  # no count up front here: takes part, R runs
    assert without.counted is not None and ranks.reference(without) is None and without.counted.value is None
    asked = Plan(2, 2, 2, None, asked=True)
    assert ranks.open(Request(2, items=7, can_pad=True, plan=asked)).counted is None
    known = ranks.open(Request(2, items=7, can_pad=True, plan=Plan(2, 2, 2, 9.0, asked=True)))
    assert known.counted is None and known.reference == 18.0  # the agreement's N: nothing more to count
    state.last_window_items = 40.0  # a window had items: the next ones weigh by its N and count nothing first
    later = ranks.open(Request(2, items=7, can_pad=True))
    assert later.counted is None and later.reference == 40.0
    alone = RankAgreement(GradSync(), torch.device("cpu"), AccumulatorState(), ALONE)
    assert alone.open(Request(2, items=7)).counted is None  # one process: N is its own count


def test_padding_is_what_the_agreement_asks_of_this_rank():
    state = AccumulatorState()
    assert window_setup(state, FSDP, Request(1, can_pad=True), Plan(1, 4, 1, None, asked=True)).padding == 3
    assert window_setup(state, DDP, Request(1, can_pad=True), Plan(1, 4, 1, None, asked=True)).padding == 0
    assert padded_count(0, 4, equal_counts=False) == 1
    with pytest.raises(AssertionError, match="lets no rank pad that cannot"):
        window_setup(state, FSDP, Request(1, can_pad=False), Plan(1, 4, 1, None, asked=True))


def test_a_samplers_plan_weighs_by_its_own_n_across_ranks():
    """A WindowSampler's shares give every rank the window's N without asking: R is that N (the
    boundary scale is 1), also once a window had items; a plan that does not carry N, or one the
    ranks were asked for, weighs by the last window's N instead, rescaled at the boundary."""
    state = AccumulatorState(last_window_items=40.0)
    sampled = RankAgreement(GradSync(), torch.device("cpu"), state, DDP).known_plan(2, [2, 2], 20.0)
    assert sampled == Plan(2, 2, 2, 20.0)
    assert window_setup(state, DDP, Request(2, can_pad=True), sampled).reference == 20.0
    assert window_setup(state, DDP, Request(2, can_pad=True), Plan(2, 2, 2, 20.0, asked=True)).reference == 40.0
    assert window_setup(state, DDP, Request(2, can_pad=True), Plan(2, 2, 2, None)).reference == 40.0


# -- a micro-batch with no item (issue 34, item 5) ---------------------------------------------------

@pytest.mark.parametrize("where", [0, 1, 2])
def test_an_empty_micro_batch_adds_nothing_and_the_window_is_exact(where):
    """A micro-batch of 0 items: its mean is nan, but it weighs 0 in an item-weighted window. The step
    equals the big batch on the other items (it was skipped with a warning to lower the learning rate)."""
    torch.manual_seed(0)
    model = regression_model().double()
    ref, opt, ref_opt = clone_pair(model, "adamw")
    x, y = regression_batch(9)
    x, y = x.double(), y.double()
    window = [(x[:4], y[:4]), (x[4:], y[4:])]
    window.insert(where, (x[:0], y[:0]))
    acc = Accumulator(model, opt, max_grad_norm=0.5)
    result = acc.step(window, mse)
    assert not result.skipped and result.num_items == 9 and acc.skipped == 0
    big_loss = reference_step(ref, ref_opt, lambda: mse(ref, (x, y)), max_grad_norm=0.5)
    assert_params_close(model, ref)
    assert result.loss == pytest.approx(big_loss, rel=1e-12)


def test_a_micro_batch_whose_targets_are_all_ignored_adds_nothing_with_a_device_count():
    """The same when loss_fn counts its targets on the device: (cross_entropy with ignore_index, (y != -100).sum());
    a micro-batch whose every label is ignored has a nan mean and a 0 count, selected away without a host sync."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 4).double()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    x = torch.randn(10, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (10,))
    y[:4] = -100  # micro-batch 0 (4 rows) has no target at all

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1], ignore_index=-100), (b[1] != -100).sum()

    acc = Accumulator(model, opt)
    result = acc.step([(x[:4], y[:4]), (x[4:], y[4:])], loss_fn)
    assert not result.skipped and result.num_items == 6
    reference_step(ref, ref_opt, lambda: torch.nn.functional.cross_entropy(ref(x), y, ignore_index=-100))
    assert_params_close(model, ref)
