"""Automatic micro-batch size, float32 accumulation buffers, the BatchNorm warning (the equivalence
checker is tests/test_checking.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gradaccum import Accumulator
from helpers import assert_params_close, clone_pair, mse, reference_step, regression_batch, regression_model

OOM_ERRORS = {
    "cuda": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cpu": lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: can't allocate memory: "
                                "you tried to allocate 8589934592 bytes."),
}


def oom_above(limit: int, kind: str, log: list):
    """A loss_fn that runs out of memory on micro-batches above ``limit`` items, but only from the
    second micro-batch of an attempt on: the first one's backward has run, so a failed attempt leaves
    partial gradients behind (a single-micro-batch attempt fails at once)."""
    def loss_fn(model, batch):
        n = batch[0].shape[0]
        first_of_attempt = not log or log[-1] != n
        log.append(n)
        loss = mse(model, batch)
        if n > limit and not (first_of_attempt and n * 2 <= max(log)):
            raise OOM_ERRORS[kind]()
        return loss
    return loss_fn


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_auto_halves_on_oom_and_stays_exact(kind, opt_name):
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, opt_name)
    acc = Accumulator(model, opt)
    log: list = []
    batch = regression_batch(20)
    # partial gradients of the failed attempts must not leak: the window starts again from zero
    with acc.window(1) as w:  # leave stale gradients on the model first
        with w.micro_batch():
            w.backward(mse(model, regression_batch(3, seed=9)), 3)
        result = w.step()
    reference_step(ref, ref_opt, lambda: mse(ref, regression_batch(3, seed=9)))
    result = acc.step(batch, oom_above(6, kind, log), micro_batch_size="auto")
    reference_step(ref, ref_opt, lambda: mse(ref, batch))
    assert_params_close(model, ref)
    assert log[:3] == [20, 10, 10], log  # the 10-item attempt backpropagated once, then failed
    assert result.micro_batch_size == 5 and acc.auto_micro_batch_size == 5
    assert result.num_items == 20 and result.micro_batches == 4 and result.step == 2
    # the size that worked is remembered: the next window does not hit the wall again
    log.clear()
    acc.step(regression_batch(20, seed=3), oom_above(6, kind, log), micro_batch_size="auto")
    assert log == [5, 5, 5, 5]


def test_auto_starts_from_the_whole_batch_when_it_fits():
    model = regression_model()
    ref, opt, ref_opt = clone_pair(model, "sgd")
    log: list = []
    result = Accumulator(model, opt).step(regression_batch(12), oom_above(100, "cpu", log), micro_batch_size="auto")
    assert log == [12] and result.micro_batch_size == 12


def test_auto_lets_other_errors_through_unchanged():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]

    def broken(m, b):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        acc.step(regression_batch(8), broken, micro_batch_size="auto")
    with pytest.raises(KeyError):
        acc.step(regression_batch(8), lambda m, b: {}["x"], micro_batch_size="auto")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and acc.auto_micro_batch_size is None


def test_auto_gives_up_at_one_item_with_a_clear_error():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(torch.OutOfMemoryError, match="micro-batches of 1 item"):
        acc.step(regression_batch(4), oom_above(0, "cuda", []), micro_batch_size="auto")


def test_out_of_memory_without_auto_propagates():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        acc.step(regression_batch(8), oom_above(2, "cpu", []), micro_batch_size=4)
    assert all(p.grad is None for p in model.parameters())


# -- float32 accumulation buffers ----------------------------------------------------------

def _bf16_window_gradient(n_micro: int, accum_dtype):
    """The gradient a bf16 linear model hands its optimizer after a window of ``n_micro``
    micro-batches of 4, and the exact full-batch gradient in float64.

    Weights, inputs and targets are small integers, so every micro-batch's bf16 gradient is exact
    (multiples of 1/16 well inside bf16's 8 bits): the only rounding left is the accumulation's. That
    makes the comparison independent of the CPU's bf16 kernels and of thread counts.
    """
    g = torch.Generator().manual_seed(1)
    model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-1, 2, (8, 8), generator=g).to(torch.bfloat16))
    x = torch.randint(-1, 2, (4 * n_micro, 8), generator=g).to(torch.bfloat16)
    y = torch.randint(-8, 9, (4 * n_micro, 8), generator=g).to(torch.bfloat16)
    ref = model.weight.detach().double().clone().requires_grad_()
    nn.functional.mse_loss(x.double() @ ref.T, y.double()).backward()
    captured = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            captured["g"] = model.weight.grad.double().clone()

    acc = Accumulator(model, Capture(model.parameters(), lr=0.0), accum_dtype=accum_dtype)
    acc.step((x, y), lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1].float()), micro_batch_size=4)
    return captured["g"], ref.grad


BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits


@pytest.mark.parametrize("n_micro", [8, 128, 512])
def test_fp32_buffers_round_the_window_gradient_once(n_micro):
    """With float32 buffers the window's sum is exact and rounded to bf16 once: every element is
    within bf16's unit roundoff of the exact gradient, however many micro-batches."""
    got, exact = _bf16_window_gradient(n_micro, torch.float32)
    assert ((got - exact).abs() <= BF16_UNIT_ROUNDOFF * exact.abs()).all()


def test_plain_bf16_accumulation_drifts_where_buffers_do_not():
    """Without buffers the running bf16 sum rounds at every micro-batch: the error is many roundings."""
    got, exact = _bf16_window_gradient(128, None)
    fp32, _ = _bf16_window_gradient(128, torch.float32)
    plain_rel = ((got - exact).norm() / exact.norm()).item()
    fp32_rel = ((fp32 - exact).norm() / exact.norm()).item()
    assert ((got - exact).abs() / exact.abs().clamp_min(1e-30)).max() > 4 * BF16_UNIT_ROUNDOFF
    assert plain_rel > 4 * fp32_rel, (plain_rel, fp32_rel)


def test_fp32_buffers_hand_the_optimizer_a_rounded_gradient_and_clear_themselves():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accum_dtype=torch.float32)
    x, y = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8, 2, dtype=torch.bfloat16)
    result = acc.step((x, y), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), micro_batch_size=2)
    assert not result.skipped and result.micro_batches == 4
    assert all(p.grad is None for p in model.parameters()) and acc.buffers.tensors() == []
    # outside a window the hooks do nothing: a user's own backward keeps its .grad
    nn.functional.mse_loss(model(x), y).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_the_norm_of_a_bf16_models_window_is_read_in_float32_beside_its_bf16_losses():
    """A bf16 model whose loss_fn returns a bf16 mean: the window's norm, measured on the float32 buffers'
    sum, is read from the device in float32 with its bf16 losses (one copy, in the wider of their dtypes),
    not rounded to bf16 (8 bits: up to 0.4% off, which StepResult.grad_norm and the clip coefficient would
    carry). Small integers make every micro-batch's bf16 gradient exact, so the float64 big batch's norm is
    the oracle to float32's rounding (1e-6); its bf16 rounding, measured beside, is over 100 times that off."""
    g = torch.Generator().manual_seed(2)
    model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-1, 2, (8, 8), generator=g).to(torch.bfloat16))
    x = torch.randint(-1, 2, (16, 8), generator=g).to(torch.bfloat16)
    y = torch.randint(-8, 9, (16, 8), generator=g).to(torch.bfloat16)
    ref = model.weight.detach().double().clone().requires_grad_()
    nn.functional.mse_loss(x.double() @ ref.T, y.double()).backward()
    exact = ref.grad.norm().item()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), compute_grad_norm=True)
    bf16_mean = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    result = acc.step((x, y), bf16_mean, micro_batch_size=4)
    assert bf16_mean(model, (x, y)).dtype == torch.bfloat16
    assert result.grad_norm == pytest.approx(exact, rel=1e-6)
    rounded = torch.tensor(exact).bfloat16().item()
    assert abs(rounded - exact) > 1e-4 * exact  # the test has teeth: a norm read in bf16 is this far off


def test_fp32_buffers_are_refused_where_they_cannot_work():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="accum_dtype with precision='fp16'"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", accum_dtype=torch.float32)


def test_accumulator_warns_once_about_batchnorm_in_training_mode():
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=r"BatchNorm layers in training mode \(1\)"):
        acc.step(regression_batch(8), mse, micro_batch_size=4)
    acc.step(regression_batch(8), mse, micro_batch_size=4)  # no second warning (warnings are errors here)
    model.eval()
    Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)).step(regression_batch(8), mse, micro_batch_size=4)


def test_a_batchnorm_held_in_eval_mode_for_a_warm_up_is_warned_about_when_it_trains():
    """A BatchNorm frozen (eval) while the rest trains, for a first window, then trained: the warning comes at
    the window where it trains (the first window used the warning up, so the second, 0.5 off one big batch,
    ran without a word)."""
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[1].eval()
    acc.step(regression_batch(8), mse, micro_batch_size=4)  # nothing to warn about (warnings are errors here)
    model[1].train()
    with pytest.warns(UserWarning, match=r"BatchNorm layers in training mode \(1\)"):
        acc.step(regression_batch(8), mse, micro_batch_size=4)
    acc.step(regression_batch(8), mse, micro_batch_size=4)  # once


def test_a_short_window_does_not_shrink_the_remembered_size():
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    log: list = []
    acc.step(regression_batch(16), oom_above(100, "cpu", log), micro_batch_size="auto")
    acc.step(regression_batch(5), oom_above(100, "cpu", log), micro_batch_size="auto")
    acc.step(regression_batch(16), oom_above(100, "cpu", log), micro_batch_size="auto")
    assert log == [16, 5, 16] and acc.auto_micro_batch_size == 16


def _kept_mean_oom_above(limit: int, log: list):
    """A bare mean over the rows a mask keeps (their count is given as ``num_items``, not returned), out of
    memory on micro-batches above ``limit`` rows."""
    def loss_fn(model, batch):
        x, y, keep = batch
        log.append(len(x))
        if len(x) > limit:
            raise OOM_ERRORS["cuda"]()
        return ((model(x) - y).pow(2).mean(dim=1) * keep).sum() / keep.sum()
    return loss_fn


@pytest.mark.parametrize("via", ["step", "train"])
def test_auto_weighs_a_bare_mean_by_num_items_after_backing_off(via):
    """micro_batch_size="auto" with num_items=: each re-split micro-batch's bare mean weighs by the items
    num_items counts in it (here 5, 1, 4 and 2 kept rows of 5), not by its rows; the window is the big
    batch's mean over its 12 kept rows. Weighing by rows (what num_items=None does) moves the weights
    elsewhere, which the test measures beside."""
    x, y = regression_batch(20)
    keep = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.float64)
    batch, count = (x, y, keep), (lambda mb: int(mb[2].sum()))

    def run(num_items):
        model = regression_model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5))
        log: list = []
        if via == "step":
            result = acc.step(batch, _kept_mean_oom_above(6, log), micro_batch_size="auto", num_items=num_items)
        else:  # one window of four loader micro-batches, joined and re-split
            loader = [(x[i:i + 5], y[i:i + 5], keep[i:i + 5]) for i in range(0, 20, 5)]
            [result] = acc.train(loader, _kept_mean_oom_above(6, log), accum_steps=4, micro_batch_size="auto",
                                 num_items=num_items)
        assert log[:2] == [20, 10] and acc.auto_micro_batch_size == 5  # it backed off twice
        return model, result

    model, result = run(count)
    ref = regression_model()
    big_batch = _kept_mean_oom_above(20, [])  # one mean over the 12 kept rows of 20
    ref_loss = reference_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), lambda: big_batch(ref, batch))
    assert result.num_items == 12 and result.loss == pytest.approx(ref_loss, rel=1e-10)
    assert_params_close(model, ref)
    by_rows, rows_result = run(None)
    assert rows_result.num_items == 20
    with pytest.raises(AssertionError):  # the test has teeth: weighing by rows is not the big batch
        assert_params_close(by_rows, ref, rtol=1e-4, atol=1e-6)
