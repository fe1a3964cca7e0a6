"""Accumulator: one step on a window equals one step on the concatenated batch (float64, rtol 1e-10)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, ConfigurationError, StepResult, causal_lm_loss
from helpers import (RTOL, assert_params_close, clone_pair, concat, mse, reference_step,
                     regression_batch, regression_model)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 3, 7, 10, 16])
def test_split_batch_equals_full_batch(opt_name, micro_batch_size):
    """Any split of a 10-item batch, two windows in a row (momentum/Adam state carries over)."""
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, opt_name)
    acc = Accumulator(model, opt)
    for seed in (1, 2):
        batch = regression_batch(10, seed=seed)
        result = acc.step(batch, mse, micro_batch_size=micro_batch_size)
        ref_loss = reference_step(ref, ref_opt, lambda: mse(ref, batch))
        assert_params_close(model, ref)
        assert result.loss == pytest.approx(ref_loss, rel=RTOL)
        assert result.num_items == 10
        assert result.micro_batches == math.ceil(10 / micro_batch_size)
        assert result.micro_batch_size == min(micro_batch_size, 10)  # the size used: 16 runs all 10 at once
        assert not result.skipped
    assert acc.steps == 2


def test_a_micro_batch_size_larger_than_the_batch_reports_the_size_used():
    """10 rows at micro_batch_size=1000 run as one micro-batch of 10, and the result says 10 (it said 1000, a
    size no micro-batch had), as micro_batch_size="auto" reports the size it settled on."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = acc.step(regression_batch(10), mse, micro_batch_size=1000)
    assert (result.micro_batch_size, result.micro_batches, result.num_items) == (10, 1, 10)
    result = acc.step(regression_batch(10), mse, micro_batch_size=4)
    assert (result.micro_batch_size, result.micro_batches) == (4, 3)


@pytest.mark.parametrize("sizes", [[5, 1, 3], [1, 1, 1, 9], [2, 7], [4]])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_uneven_window_is_item_weighted(sizes, opt_name):
    """Micro-batches of different sizes count by items, not by 1/N each."""
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, opt_name)
    window = [regression_batch(n, seed=10 + i) for i, n in enumerate(sizes)]
    result = Accumulator(model, opt).step(window, mse)
    ref_loss = reference_step(ref, ref_opt, lambda: mse(ref, concat(window)))
    assert_params_close(model, ref)
    assert result.loss == pytest.approx(ref_loss, rel=RTOL)
    assert result.num_items == sum(sizes)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + torch.tanh(self.mix(h.cumsum(dim=1)))  # causal mixing
        return self.out(h)


def padded_micro_batch(lengths, seed, vocab=11, pad_to=None):
    g = torch.Generator().manual_seed(seed)
    t = pad_to or max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    labels = torch.full((len(lengths), t), -100)
    for i, n in enumerate(lengths):
        seq = torch.randint(1, vocab, (n,), generator=g)
        ids[i, :n] = seq
        labels[i, :n] = seq
    return {"input_ids": ids, "labels": labels, "note": "kept"}


def lm_loss(model, mb):
    assert mb["note"] == "kept"
    return causal_lm_loss(model(mb["input_ids"]), mb["labels"])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_padded_sequences_weight_by_tokens(opt_name):
    """Variable token counts per micro-batch: the step is the mean over every target token."""
    torch.manual_seed(0)
    model = TinyLM().double()
    ref, opt, ref_opt = clone_pair(model, opt_name)
    window = [padded_micro_batch([9, 2, 5], 1), padded_micro_batch([2], 2),
              padded_micro_batch([12, 12, 3, 7], 3), padded_micro_batch([1, 4], 4)]
    result = Accumulator(model, opt).step(window, lm_loss)

    big = padded_micro_batch([9, 2, 5, 2, 12, 12, 3, 7, 1, 4], 0, pad_to=12)
    for key in ("input_ids", "labels"):  # the same sequences, padded together as one batch
        big[key] = torch.cat([nn.functional.pad(mb[key], (0, 12 - mb[key].shape[1]),
                                                value=0 if key == "input_ids" else -100) for mb in window])
    ref_loss = reference_step(ref, ref_opt, lambda: lm_loss(ref, big)[0])
    assert_params_close(model, ref)
    assert result.num_items == (9 - 1) + (2 - 1) + (5 - 1) + 1 + 11 + 11 + 2 + 6 + 0 + 3
    assert result.loss == pytest.approx(ref_loss, rel=RTOL)


def test_dividing_by_n_would_be_caught():
    """The bug the popular tools have: (1/N) sum of micro-batch means differs from the item mean."""
    model = regression_model()
    ref = copy.deepcopy(model)
    window = [regression_batch(n, seed=i) for i, n in enumerate([6, 1])]
    Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5)).step(window, mse)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    reference_step(ref, ref_opt, lambda: sum(mse(ref, mb) for mb in window) / len(window))
    with pytest.raises(AssertionError):
        assert_params_close(model, ref)


def test_parameters_do_not_move_inside_a_window_and_grads_are_cleared():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    window = [regression_batch(3, seed=i) for i in range(4)]
    with acc.window(len(window)) as w:
        assert w.micro_batches == 4
        for mb in window:
            with w.micro_batch():
                w.backward(mse(model, mb), num_items=3)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert all(p.grad is not None for p in model.parameters())
        result = w.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert result.step == 1 and result.micro_batches == 4


def test_lower_level_window_matches_step():
    """The hand-written loop path and step() are the same machinery and give the same result."""
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "adamw")
    window = [regression_batch(n, seed=20 + n) for n in (4, 2, 5)]
    acc = Accumulator(model, opt)
    with acc.window(3) as w:
        for x, y in window:
            with w.micro_batch():
                w.backward(nn.functional.mse_loss(model(x), y), num_items=x.shape[0])
        w.step()
    reference_step(ref, ref_opt, lambda: mse(ref, concat(window)))
    assert_params_close(model, ref)


def test_stale_gradients_do_not_leak_into_the_window():
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    batch = regression_batch(6)
    Accumulator(model, opt).step(batch, mse, micro_batch_size=4)
    reference_step(ref, ref_opt, lambda: mse(ref, batch))
    assert_params_close(model, ref)


@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e6])
def test_clipping_applies_to_the_normalized_window_gradient(max_norm):
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    batch = regression_batch(9)
    result = Accumulator(model, opt, max_grad_norm=max_norm).step(batch, mse, micro_batch_size=2)
    ref_opt.zero_grad()
    mse(ref, batch).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    ref_opt.step()
    assert_params_close(model, ref)
    assert result.grad_norm == pytest.approx(ref_norm, rel=1e-9)


def masked_mse(model: torch.nn.Module, batch):
    """A mean over the rows the mask keeps, counted by loss_fn itself: nothing is known up front, so the
    window is weighed by a reference count R and rescaled by R / N at the boundary."""
    x, y, keep = batch
    per_row = (model(x) - y).pow(2).mean(dim=1)
    return (per_row * keep).sum() / keep.sum(), keep.sum()


@pytest.mark.parametrize("max_norm", [1e-3, 0.5])
@pytest.mark.parametrize("loop", ["step", "own_loop"])
def test_clipping_by_the_norm_after_the_boundary_rescale(loop, max_norm):
    """Issue 48, item 7: with counts that come from loss_fn (R != N, a boundary scale other than 1), the
    clip coefficient is taken on the rescaled window gradient, as clip_grad_norm_ takes it on the float64
    big batch. Clipping by the norm before the rescale moves the weights by the scale's error."""
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    x, y = regression_batch(9)
    keep = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.float64)  # 1, 2, 2 and 1 kept per micro-batch
    acc = Accumulator(model, opt, max_grad_norm=max_norm)
    if loop == "step":
        result = acc.step((x, y, keep), masked_mse, micro_batch_size=2)
    else:
        with acc.window(5) as window:
            for i in range(0, 9, 2):
                with window.micro_batch():
                    window.backward(*masked_mse(model, (x[i:i + 2], y[i:i + 2], keep[i:i + 2])))
            result = window.step()
    ref_opt.zero_grad()
    masked_mse(ref, (x, y, keep))[0].backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    ref_opt.step()
    assert result.num_items == 6 and result.grad_norm == pytest.approx(ref_norm, rel=1e-9)
    assert ref_norm > 2 * max_norm  # the clip engaged
    assert_params_close(model, ref)


def test_scheduler_steps_once_per_optimizer_step_and_never_on_a_skipped_one():
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = Accumulator(model, opt, scheduler=sched)
    batch = regression_batch(8)
    r1 = acc.step(batch, mse, micro_batch_size=2)
    assert (r1.lr, opt.param_groups[0]["lr"]) == (1.0, 0.5)
    bad = (batch[0], batch[1] * float("nan"))
    with pytest.warns(UserWarning, match="was not finite, so it was skipped"):
        r2 = acc.step(bad, mse, micro_batch_size=2)
    assert r2.skipped and opt.param_groups[0]["lr"] == 0.5 and r2.step == 1
    r3 = acc.step(batch, mse, micro_batch_size=4)
    assert r3.lr == 0.5 and opt.param_groups[0]["lr"] == 0.25 and r3.step == 2


def test_nonfinite_window_is_skipped_and_the_next_is_exact():
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "adamw")
    acc = Accumulator(model, opt)
    x, y = regression_batch(6)
    y_bad = y.clone()
    y_bad[4] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="loss was not finite, so it was skipped"):
        result = acc.step((x, y_bad), mse, micro_batch_size=2)
    assert result.skipped and not math.isfinite(result.loss) and result.step == 0
    assert acc.skipped == 1 and acc.state_dict()["skipped"] == 1
    assert acc.step((x, y_bad), mse, micro_batch_size=2).skipped  # warned once only (warnings are errors here)
    assert acc.skipped == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert opt.state == {} or all(not s for s in opt.state.values())
    acc.step((x, y), mse, micro_batch_size=4)
    reference_step(ref, ref_opt, lambda: mse(ref, (x, y)))
    assert_params_close(model, ref)


def test_nonfinite_raise_is_a_clear_error_and_moves_nothing():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), nonfinite="raise")
    x, y = regression_batch(4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match="not finite"):
        acc.step((x, y * float("nan")), mse, micro_batch_size=2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_window_with_zero_items_takes_no_step_and_says_so_once():
    """Every label ignored: no loss to step on. The loss is nan (not a misleading 0.0), the window is
    skipped (weight decay does not move the model either), and a warning says why, once."""
    torch.manual_seed(0)
    model = TinyLM().double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1))
    mb = padded_micro_batch([1, 1], 0)  # one token each: no next-token target after the shift
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="counted 0 items"):
        result = acc.step([mb], lm_loss)
    assert result.skipped and result.num_items == 0 and math.isnan(result.loss) and result.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert acc.step([mb], lm_loss).skipped  # no second warning (warnings are errors in this suite)


@pytest.mark.parametrize("first", ["empty", "nonfinite"])
def test_a_skipped_window_of_each_kind_is_said_once_on_its_own(first):
    """A window of no item and a window whose loss is not finite are two warnings, each given once: the
    one given first (either) does not use up the other's, so a run whose labels once were all ignored
    still hears that a later window's loss overflowed and was skipped."""
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_batch(4)
    windows = {"empty": ((x, y), dict(num_items=lambda mb: 0), "counted 0 items"),
               "nonfinite": ((x, y * float("nan")), {}, "loss was not finite, so it was skipped")}
    order = [first, "nonfinite" if first == "empty" else "empty"]
    for kind in order:
        batch, kw, said = windows[kind]
        with pytest.warns(UserWarning, match=said):
            assert acc.step(batch, mse, micro_batch_size=2, **kw).skipped
    for kind in order:  # each said once (warnings are errors in this suite)
        batch, kw, _ = windows[kind]
        assert acc.step(batch, mse, micro_batch_size=2, **kw).skipped
    assert acc.skipped == 4 and acc.steps == 0


def test_bf16_autocast_runs_and_matches_fp32_roughly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    batch = tuple(t.float() for t in regression_batch(12))
    Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16").step(batch, mse, micro_batch_size=5)
    reference_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), lambda: mse(ref, batch))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


def test_fp16_scaler_unscales_once_and_backs_off_on_overflow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt, precision="fp16", max_grad_norm=10.0)
    x, y = (t.float() for t in regression_batch(12))
    scale0 = acc.precision.scaler.get_scale()
    result = acc.step((x, y), mse, micro_batch_size=5)
    assert not result.skipped
    reference_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), lambda: mse(ref, (x, y)), max_grad_norm=10.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)  # fp16 forward; unscaled exactly once
    before = [p.detach().clone() for p in model.parameters()]
    result = acc.step((x, y * 1e3), mse, micro_batch_size=5)  # a finite loss whose scaled gradient overflows fp16
    assert result.skipped and math.isfinite(result.loss)
    assert acc.precision.scaler.get_scale() < scale0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_under_fp16_a_loss_that_is_not_finite_is_no_overflow_of_the_scale(nonfinite):
    """A probe: under precision="fp16" a nan from the data (a nan input) was skipped in silence, window after
    window, even with nonfinite="raise": every non-finite window was taken for the loss scaler's overflow. A
    gradient that overflows behind a finite loss is how the scaler learns (skipped without a word, above); a
    loss that is not finite is judged by nonfinite, as without fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", nonfinite=nonfinite)
    x, y = (t.float() for t in regression_batch(12))
    x[7, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    if nonfinite == "raise":
        with pytest.raises(FloatingPointError, match="the window's loss is not finite"):
            acc.step((x, y), mse, micro_batch_size=5)
    else:
        with pytest.warns(UserWarning, match="loss was not finite, so it was skipped"):
            assert acc.step((x, y), mse, micro_batch_size=5).skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and acc.steps == 0
    x[7, 0] = 0.0  # a review: the refusal left the scaler unscaled, and the next window failed in torch
    assert not acc.step((x, y), mse, micro_batch_size=5).skipped and acc.steps == 1


def test_step_result_fields():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.3))
    r = acc.step([regression_batch(2), regression_batch(3)], mse)
    assert isinstance(r, StepResult)
    assert (r.num_items, r.micro_batches, r.step, r.lr, r.skipped, r.micro_batch_size) == (5, 2, 1, 0.3, False, None)
    assert isinstance(r.loss, float) and r.grad_norm is None  # not measured unless asked: a pass saved
    assert set(r.to_dict()) >= {"loss", "num_items", "micro_batches", "grad_norm", "skipped", "lr", "step",
                                "micro_batch_size"}


def test_state_dict_round_trip():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.step(regression_batch(4), mse, micro_batch_size=2)
    other = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other.load_state_dict(acc.state_dict())
    assert other.steps == 1
    with pytest.raises(ValueError, match="precision"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16").load_state_dict(acc.state_dict())


class Float32Island(nn.Module):
    """A float64 model whose middle computes in float32, as Llama's RMSNorm does (hidden states are
    upcast to float32, normalized and cast back): that part rounds to float32 whatever the model's
    dtype, so it matches the full batch only if it sees the very values the full batch feeds it."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids).cumsum(dim=1)))
        h32 = h.float()
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.out(self.scale * h32.to(h.dtype))


def test_known_counts_weigh_each_backward_as_the_full_batch_does():
    """Counts known before the first backward (here the leading dimensions of a bare mean loss): each
    micro-batch's backward weighs n_k / N, so even a float32 island rounds as in one big batch.
    (SGD: its update is proportional to the gradient; Adam's first step is about lr * sign(g).)"""
    torch.manual_seed(0)
    model = Float32Island().double()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    window = [padded_micro_batch([5] * n, 30 + i, pad_to=5) for i, n in enumerate([3, 1, 4, 2])]
    loss = lambda m, mb: nn.functional.cross_entropy(m(mb["input_ids"]).flatten(0, 1), mb["input_ids"].flatten())  # noqa: E731
    Accumulator(model, opt).step(window, loss)
    big = {"input_ids": torch.cat([mb["input_ids"] for mb in window])}
    reference_step(ref, ref_opt, lambda: loss(ref, big))
    assert_params_close(model, ref, rtol=1e-12, atol=1e-15)


def test_a_token_counter_makes_a_padded_lm_window_round_as_the_full_batch():
    """With ``num_items=count_targets`` the window's token count is known up front: the same n_k / N
    weights as the full batch, through the float32 island too."""
    from gradaccum import count_targets

    torch.manual_seed(0)
    model = Float32Island().double()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    window = [padded_micro_batch([9, 2, 5], 1, pad_to=12), padded_micro_batch([2], 2, pad_to=12),
              padded_micro_batch([12, 12, 3, 7], 3, pad_to=12)]
    result = Accumulator(model, opt).step(window, lm_loss, num_items=lambda mb: count_targets(mb["labels"]))
    big = {key: torch.cat([mb[key] for mb in window]) for key in ("input_ids", "labels")}
    big["note"] = "kept"
    reference_step(ref, ref_opt, lambda: lm_loss(ref, big)[0])
    assert result.num_items == 8 + 1 + 4 + 1 + 11 + 11 + 2 + 6
    assert_params_close(model, ref, rtol=1e-12, atol=1e-15)


def test_a_bare_mean_over_tokens_is_weighted_by_the_counter():
    """A loss_fn returning only a mean over tokens (as Hugging Face's outputs.loss) is weighted by the
    micro-batch's sequences unless a counter says how many tokens it is a mean over."""
    from gradaccum import count_targets

    torch.manual_seed(0)
    model = TinyLM().double()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    window = [padded_micro_batch([9, 2], 1, pad_to=9), padded_micro_batch([3, 3, 4], 2, pad_to=9)]
    mean_only = lambda m, mb: lm_loss(m, mb)[0]  # noqa: E731
    Accumulator(model, opt).step(window, mean_only, num_items=lambda mb: count_targets(mb["labels"]))
    big = {key: torch.cat([mb[key] for mb in window]) for key in ("input_ids", "labels")}
    big["note"] = "kept"
    reference_step(ref, ref_opt, lambda: lm_loss(ref, big)[0])
    assert_params_close(model, ref)


def test_a_wrong_counter_still_steps_exactly():
    """The counts loss_fn returns are what the step normalizes by; a counter only fixes the backward
    weights up front, so a wrong one costs a scaling pass, never exactness."""
    torch.manual_seed(0)
    model = TinyLM().double()
    ref, opt, ref_opt = clone_pair(model, "adamw")
    window = [padded_micro_batch([9, 2, 5], 1, pad_to=9), padded_micro_batch([4], 2, pad_to=9)]
    Accumulator(model, opt).step(window, lm_loss, num_items=lambda mb: 1000)
    big = {key: torch.cat([mb[key] for mb in window]) for key in ("input_ids", "labels")}
    big["note"] = "kept"
    reference_step(ref, ref_opt, lambda: lm_loss(ref, big)[0])
    assert_params_close(model, ref)


def test_fractional_weights_are_reported_as_floats():
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    a, b = regression_batch(2, seed=1), regression_batch(2, seed=2)
    acc = Accumulator(model, opt)
    with acc.window(2) as w:
        for mb, weight in ((a, 2.5), (b, 1.0)):
            with w.micro_batch():
                w.backward(mse(model, mb), weight)
        result = w.step()
    assert result.num_items == 3.5 and isinstance(result.num_items, float)
    reference_step(ref, ref_opt, lambda: (2.5 * mse(ref, a) + 1.0 * mse(ref, b)) / 3.5)
    assert_params_close(model, ref)
    with acc.window(1) as w:
        with w.micro_batch():
            w.backward(mse(model, a), 2.0)
        assert isinstance(w.step().num_items, int)


def test_a_scheduler_that_raises_after_the_step_leaves_the_step_counted():
    """OneCycleLR sized for 5 steps raises in the 6th step's scheduler.step(), after the optimizer
    stepped: acc.steps counts that step (6, as the optimizer did), the error reaches the caller, and
    the gradients are cleared."""
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = []
    opt.register_step_post_hook(lambda *_: taken.append(1))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5)
    acc = Accumulator(model, opt, scheduler=sched)
    batch = regression_batch(4)
    for _ in range(5):
        acc.step(batch, mse, micro_batch_size=2)
    with pytest.raises(ValueError, match="Tried to step 6 times"):
        acc.step(batch, mse, micro_batch_size=2)
    assert acc.steps == len(taken) == 6
    assert all(p.grad is None for p in model.parameters())


def test_compute_grad_norm_reports_the_full_batch_norm():
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    batch = regression_batch(9)
    result = Accumulator(model, opt, compute_grad_norm=True).step(batch, mse, micro_batch_size=2)
    ref_opt.zero_grad()
    mse(ref, batch).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    ref_opt.step()
    assert result.grad_norm == pytest.approx(ref_norm, rel=1e-12)
    assert_params_close(model, ref)


def test_a_nonfinite_gradient_behind_a_finite_loss_is_skipped_when_the_norm_is_measured():
    """sqrt at 0 has an infinite derivative: the loss is finite, the gradient is not. Measuring the
    norm (compute_grad_norm or max_grad_norm) catches it; the loss-only default check cannot."""
    for kwargs in ({"compute_grad_norm": True}, {"max_grad_norm": 1.0}):
        model = regression_model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        before = [p.detach().clone() for p in model.parameters()]
        x, y = regression_batch(4)
        sqrt_loss = lambda m, b: (m(b[0]) * 0).sqrt().mean() + mse(m, b)  # noqa: E731
        with pytest.warns(UserWarning, match="gradient was not finite"):
            result = acc.step((x, y), sqrt_loss, micro_batch_size=2)
        assert math.isfinite(result.loss) and not math.isfinite(result.grad_norm) and result.skipped
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_token_counted_windows_keep_the_backward_near_a_mean_loss():
    """causal_lm_loss counts tokens while the window's up-front count is sequences: the first window
    learns the ratio, and later windows divide by about their token count, so the backward stays at
    a mean loss's magnitude (what fp16's loss scale needs) instead of tokens-per-sequence times it.
    The steps stay exact, and the ratio is in state_dict so a resume rounds the same."""
    torch.manual_seed(0)
    model = TinyLM().double()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    acc = Accumulator(model, opt)
    windows = [[padded_micro_batch([9, 12, 5], 1, pad_to=12), padded_micro_batch([11], 2, pad_to=12)],
               [padded_micro_batch([12, 10], 3, pad_to=12), padded_micro_batch([8, 12], 4, pad_to=12)]]
    first = acc.step(windows[0], lm_loss)
    assert acc.state.count_ratio == first.num_items / 4  # tokens per sequence in window 1
    weights = []
    with acc.window(2, num_items=4) as w:  # 4 sequences up front, as step() would count them
        weights.append(w.weights.reference)
        for mb in windows[1]:
            with w.micro_batch():
                w.backward(*lm_loss(model, mb))
        second = w.step()
    assert weights[0] == 4 * first.num_items / 4 and abs(weights[0] - second.num_items) < 0.2 * second.num_items
    for window in windows:
        big = {key: torch.cat([mb[key] for mb in window]) for key in ("input_ids", "labels")}
        big["note"] = "kept"
        reference_step(ref, ref_opt, lambda: lm_loss(ref, big)[0])
    assert_params_close(model, ref)
    restored = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    restored.load_state_dict(acc.state_dict())
    assert restored.state.count_ratio == acc.state.count_ratio


def test_reduce_lr_on_plateau_is_stepped_with_the_window_loss():
    """ReduceLROnPlateau needs a metric: the window's loss is given, and only on steps taken."""
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    acc = Accumulator(model, opt, scheduler=sched)
    batch = regression_batch(8)
    first = acc.step(batch, mse, micro_batch_size=4)
    assert sched.best == first.loss
    for _ in range(3):
        acc.step((batch[0], batch[1] * 100), mse, micro_batch_size=4)  # worse: the lr halves
    assert opt.param_groups[0]["lr"] < 1.0


def test_a_scheduler_over_another_optimizer_is_refused():
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    other = torch.optim.SGD(regression_model().parameters(), lr=1.0)
    with pytest.raises(ValueError, match="over another optimizer"):
        Accumulator(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))


def test_the_checked_settings_are_kept_frozen_and_a_bad_one_is_refused_before_the_model_is_read():
    """acc.settings: the keyword settings as checked (max_grad_norm a float), not to be changed under a
    built Accumulator; a bad setting is refused before the model and optimizer are looked at."""
    import dataclasses

    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=2, compute_grad_norm=1)
    assert (acc.settings.max_grad_norm, acc.settings.compute_grad_norm, acc.settings.nonfinite) == (2.0, True, "skip")
    assert type(acc.settings.max_grad_norm) is float and acc.max_grad_norm == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        acc.settings.max_grad_norm = 1.0  # type: ignore[misc]
    refused = r"Accumulator\(nonfinite='ignore'\): nonfinite must be 'skip' .* or 'raise'"
    with pytest.raises(ConfigurationError, match=refused):
        Accumulator("not a model", None, nonfinite="ignore")  # type: ignore[arg-type]


def test_load_state_dict_of_none_names_what_to_pass():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"takes the dict Accumulator.state_dict\(\) returned, got NoneType"):
        acc.load_state_dict(None)


def test_a_plain_backward_inside_a_window_names_window_backward():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = regression_batch(4)
    with pytest.raises(RuntimeError, match=r"window.backward\(\) never ran.*plain loss.backward\(\)"):
        with acc.window(1) as window:
            with window.micro_batch():
                mse(model, batch).backward()
            window.step()


def test_train_with_auto_micro_batches_equals_one_step_per_window():
    """train(micro_batch_size="auto") joins each window's micro-batches and backs off on
    out-of-memory errors; every window still equals one big step on its items."""
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "adamw")
    x, y = regression_batch(20)
    loader = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 20, 4)]  # 5 micro-batches: windows of 3 and 2

    def fails_above_5(m, b):
        if b[0].shape[0] > 5:
            raise torch.OutOfMemoryError("injected")
        return mse(m, b)

    acc = Accumulator(model, opt)
    results = list(acc.train(loader, fails_above_5, accum_steps=3, micro_batch_size="auto"))
    assert [r.num_items for r in results] == [12, 8] and acc.auto_micro_batch_size <= 5
    for sl in (slice(0, 12), slice(12, 20)):
        reference_step(ref, ref_opt, lambda: mse(ref, (x[sl], y[sl])))
    assert_params_close(model, ref)
    with pytest.raises(ValueError, match="takes 'auto' or None"):
        acc.train(loader, mse, accum_steps=3, micro_batch_size=4)


def test_a_stop_request_reaches_the_next_boundary_even_when_it_arrives_during_one():
    """request_stop() may run in a signal handler at any moment: one made after a boundary read the
    flag (here: inside the optimizer step) is carried by the next window, never lost."""
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, opt)
    batch = regression_batch(4)
    assert not acc.step(batch, mse, micro_batch_size=2).stop_requested
    step = opt.step

    def step_and_ask(*a, **k):
        acc.request_stop()
        return step(*a, **k)

    opt.step = step_and_ask
    assert not acc.step(batch, mse, micro_batch_size=2).stop_requested  # asked after this boundary's read
    opt.step = step
    assert acc.step(batch, mse, micro_batch_size=2).stop_requested      # carried by the next
    assert not acc.step(batch, mse, micro_batch_size=2).stop_requested  # and only once


def test_loss_every_is_gone():
    """Issue 48 item 4: every window exchanges its loss at its boundary, so ``loss_every`` went (no
    alias before the first release): old code gets Python's own TypeError, naming the argument."""
    model = regression_model()
    with pytest.raises(TypeError, match="loss_every"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_every=3)


def _stepped_scheduler():
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def test_a_scheduler_also_stepped_by_hand_is_refused_before_the_next_window():
    """Issue 26, item 2: a user's own scheduler.step() after passing scheduler= halves the learning
    rate twice per step; the next window refuses, before its forward, naming the fix."""
    model, opt, sched = _stepped_scheduler()
    acc = Accumulator(model, opt, scheduler=sched)
    batch = regression_batch(8)
    acc.step(batch, mse, micro_batch_size=4)
    sched.step()  # the user's own, on top of the Accumulator's
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigurationError, match=r"was stepped outside it: its last_epoch went from 1 to 2 .*"
                                           r"Remove your own scheduler.step\(\) call"):
        acc.step(batch, mse, micro_batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and acc.steps == 1


def test_two_accumulators_stepping_one_scheduler_are_refused():
    model, opt, sched = _stepped_scheduler()
    first, second = Accumulator(model, opt, scheduler=sched), Accumulator(model, opt, scheduler=sched)
    batch = regression_batch(8)
    first.step(batch, mse, micro_batch_size=4)
    second.step(batch, mse, micro_batch_size=4)  # it first sees the scheduler here: nothing to compare yet
    with pytest.raises(ConfigurationError, match="another Accumulator given the same scheduler"):
        first.step(batch, mse, micro_batch_size=4)


def test_a_scheduler_resumed_from_a_checkpoint_is_not_taken_for_a_second_stepper():
    """The usual resume order (build, load the scheduler's and the Accumulator's state, train on)
    moves last_epoch between construction and the first window: that is no misuse."""
    model, opt, sched = _stepped_scheduler()
    acc = Accumulator(model, opt, scheduler=sched)
    batch = regression_batch(8)
    acc.step(batch, mse, micro_batch_size=4)
    saved, acc_state = sched.state_dict(), acc.state_dict()
    acc.step(batch, mse, micro_batch_size=4)
    sched.load_state_dict(saved)  # back to where the checkpoint was
    acc.load_state_dict(acc_state)
    assert acc.step(batch, mse, micro_batch_size=4).step == 2
    model2, opt2, sched2 = _stepped_scheduler()
    acc2 = Accumulator(model2, opt2, scheduler=sched2)
    sched2.load_state_dict(saved)  # a fresh process: loaded after the Accumulator was built
    assert acc2.step(batch, mse, micro_batch_size=4).step == 1 and sched2.last_epoch == 2


def test_a_resume_whose_scheduler_was_not_loaded_is_refused_and_one_that_was_goes_on_as_the_run():
    """A checkpoint saved without the scheduler's state, resumed into a fresh scheduler: the learning rate would
    restart its schedule in silence (a probe: 6.7e-3 off the uninterrupted run after five steps). The
    Accumulator's state says where the scheduler stood; a resumed one elsewhere is refused before any forward,
    naming the fix. Loaded as the guide shows, the resumed run is the uninterrupted one to the bit."""
    batches = [regression_batch(7, seed=s) for s in range(4)]
    model, opt, sched = _stepped_scheduler()
    acc = Accumulator(model, opt, scheduler=sched)
    for batch in batches[:2]:
        acc.step(batch, mse, micro_batch_size=3)
    saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()),
             "scheduler": sched.state_dict(), "acc": acc.state_dict()}
    for batch in batches[2:]:
        acc.step(batch, mse, micro_batch_size=3)

    def resumed(load_scheduler: bool, acc_state: dict):
        model2, opt2, sched2 = _stepped_scheduler()
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optimizer"])
        if load_scheduler:
            sched2.load_state_dict(saved["scheduler"])
        acc2 = Accumulator(model2, opt2, scheduler=sched2)
        acc2.load_state_dict(acc_state)
        return model2, acc2

    model2, acc2 = resumed(False, saved["acc"])
    before = copy.deepcopy(model2.state_dict())
    with pytest.raises(ConfigurationError, match=r"has last_epoch=0, but the Accumulator's state was saved with it "
                                                 r"at 2: .*Save the scheduler's state_dict\(\) with the checkpoint"):
        acc2.step(batches[2], mse, micro_batch_size=3)
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items()) and acc2.steps == 2
    model2, acc2 = resumed(True, saved["acc"])
    for batch in batches[2:]:
        acc2.step(batch, mse, micro_batch_size=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    model3, acc3 = resumed(False, {k: v for k, v in saved["acc"].items() if k != "scheduler_at"})  # a new schedule
    assert acc3.step(batches[2], mse, micro_batch_size=3).step == 3


def test_a_numpy_count_is_a_count():
    """A probe: num_items returning np.int64(3), a finite number >= 0, was refused as not one."""
    import numpy as np

    results = []
    for as_count in (int, np.int64, np.float32):
        model = regression_model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        results.append((acc.step(regression_batch(7), mse, micro_batch_size=3,
                                 num_items=lambda mb: as_count(len(mb[0]))).num_items,
                        [p.detach().clone() for p in model.parameters()]))
    assert all(n == 7 and all(torch.equal(a, b) for a, b in zip(ps, results[0][1])) for n, ps in results)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_a_layer_unfrozen_after_the_accumulator_was_built_steps_as_one_big_batch(opt_name):
    """Gradual unfreezing: the first layer frozen when the Accumulator is built, unfrozen after one window.
    Its gradient is cleared, weighed and clipped with the window's (it was not: the parameters were taken
    once, the trainable ones, so its gradient carried over into the next window and escaped the clip)."""
    model = regression_model()
    model[0].requires_grad_(False)
    ref, opt, ref_opt = clone_pair(model, opt_name)
    acc = Accumulator(model, opt, max_grad_norm=0.05)
    for window, micro_batch_size in enumerate((4, 3, 4)):  # 10 items: 4+4+2 and 3+3+3+1
        if window == 1:
            for m in (model, ref):
                m[0].requires_grad_(True)
        batch = regression_batch(10, seed=window + 1)
        result = acc.step(batch, mse, micro_batch_size=micro_batch_size)
        reference_step(ref, ref_opt, lambda: mse(ref, batch), max_grad_norm=0.05)
        assert result.grad_norm > 0.05  # the clip engages
        assert_params_close(model, ref)
        assert all(p.grad is None for p in model.parameters())  # nothing left to leak into the next window


def test_an_optimizer_step_of_the_callers_own_inside_a_window_is_refused_and_the_next_window_is_exact():
    """A stock loop's ``optimizer.step()`` carried into a hand-written window stepped on a partial gradient,
    weighed by the running R and unclipped, and the window stepped again (a probe: 0.235 off one big batch,
    the result still reporting one clean step). Refused before it moves anything; the window's gradient is
    dropped as the block leaves, and the next window is one big batch's."""
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    acc = Accumulator(model, opt, max_grad_norm=0.05)
    x, y = batch = regression_batch(10, seed=1)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called while a window is open.*window.step\(\)"):
        with acc.window(3) as window:
            for i in range(0, 10, 4):
                with window.micro_batch():
                    window.backward(mse(model, (x[i:i + 4], y[i:i + 4])), len(x[i:i + 4]))
                opt.step()
    assert_params_close(model, ref)
    assert all(p.grad is None for p in model.parameters())
    acc.step(batch, mse, micro_batch_size=4)
    reference_step(ref, ref_opt, lambda: mse(ref, batch), max_grad_norm=0.05)
    assert_params_close(model, ref)
    opt.step()  # between windows the optimizer is the caller's (no gradient is left to step on)


def test_the_step_pre_hook_goes_with_the_accumulator_that_registered_it():
    """Successive Accumulators over one optimizer (a new one after an unfreezing, as the DDP refusal says): each
    registers its step pre-hook, held weakly and removed when the Accumulator goes, so hooks and slots do not pile
    up on the optimizer."""
    import gc

    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accs = [Accumulator(model, opt) for _ in range(3)]
    assert len(opt._optimizer_step_pre_hooks) == 3  # torch's registry of the optimizer's step pre-hooks
    del accs[:2]
    gc.collect()
    assert len(opt._optimizer_step_pre_hooks) == 1
    accs[0].step(regression_batch(6, seed=1), mse, micro_batch_size=4)
    opt.step()  # between windows: the hook lets it through
    del accs
    gc.collect()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_fp16_with_trainable_parameters_outside_the_optimizer_is_refused_with_the_fix():
    """``precision="fp16"`` with an optimizer over the head while the body still requires grad: GradScaler
    unscales only the optimizer's gradients, so the body's entered the window's norm times the loss scale
    (a probe: the norm read 44,571 for 1.22, the clipped step 4.8e-2 off one big batch). Refused as the
    Accumulator is built, naming the fix; with the body frozen, the clipped windows are one big batch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with pytest.raises(ConfigurationError, match=r"precision='fp16' with 2 trainable parameter\(s\) the optimizer "
                                                 r"does not hold \(0.weight, 0.bias\).*requires_grad_\(False\)"):
        Accumulator(model, torch.optim.SGD(model[2].parameters(), lr=0.1), precision="fp16")
    model[0].requires_grad_(False)
    later = Accumulator(model, torch.optim.SGD(model[2].parameters(), lr=0.1), precision="fp16")
    model[0].requires_grad_(True)  # unfrozen without add_param_group: refused as the next window opens
    with pytest.raises(ConfigurationError, match=r"does not hold \(0.weight, 0.bias\).*add_param_group"):
        later.step(regression_batch(10, seed=1), mse, micro_batch_size=3)
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    acc = Accumulator(model, torch.optim.SGD(model[2].parameters(), lr=0.1), precision="fp16", max_grad_norm=0.05)
    ref_opt = torch.optim.SGD(ref[2].parameters(), lr=0.1)
    for seed in (1, 2):
        batch = regression_batch(10, seed=seed)
        result = acc.step(batch, mse, micro_batch_size=3)
        reference_step(ref, ref_opt, lambda: mse(ref, batch), max_grad_norm=0.05)
        assert result.grad_norm > 0.05
        assert_params_close(model, ref)


def test_an_optimizer_over_parameters_outside_the_model_is_refused_with_the_fix():
    """An optimizer over a head the Accumulator's model does not hold: the head's gradient would be neither
    cleared, weighed nor clipped with the window's (two windows were 0.57 off one big batch each, clipped 18x).
    Refused as the Accumulator is built, naming the fix; a module holding both is exact."""
    body, head = nn.Linear(5, 8).double(), nn.Linear(8, 3).double()
    opt = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
    with pytest.raises(ConfigurationError, match=r"optimizer holds 2 parameter\(s\) that are not the "
                                                 r"Linear's.*nn.ModuleDict.*model.parameters\(\)"):
        Accumulator(body, opt)
    head.requires_grad_(False)  # frozen now, it may be unfrozen later: refused too
    with pytest.raises(ConfigurationError, match="not the Linear's"):
        Accumulator(body, opt)
    head.requires_grad_(True)
    both = nn.ModuleDict({"body": body, "head": head})
    ref = copy.deepcopy(both)
    acc = Accumulator(both, opt)
    ref_opt = torch.optim.SGD([*ref["body"].parameters(), *ref["head"].parameters()], lr=0.1)
    loss_fn = lambda m, b: mse(lambda x: m["head"](torch.tanh(m["body"](x))), b)  # noqa: E731
    for seed in (1, 2):
        batch = regression_batch(10, seed=seed)
        acc.step(batch, loss_fn, micro_batch_size=3)
        reference_step(ref, ref_opt, lambda: loss_fn(ref, batch))
        assert_params_close(both, ref)
