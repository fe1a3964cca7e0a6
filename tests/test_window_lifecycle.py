"""The window core's lifecycle as a framework's loop drives it (_weights.WindowWeights), the one home of what
ExactTrainer and Lightning's ExactAccumulation both do from their hooks: open the float32 buffers, hand the
window's gradient over at its scale R / N (buffers rounded once), drop a skipped window's gradient, judge
the norm the framework measured, record.

The oracle is written out here: the window's float64 gradient of sum_k S_k / N, and its float32 sum
rounded once to bf16. The drivers' own exactness tests (test_precision.py's trainer-driver tests,
test_lightning.py, test_hf_trainer.py) run through it; these pin each step on its own.
Also: the one ``swapped`` (and ``Swaps``) both drivers patch with (_patching.py), and the evaluation set's
item-weighted mean (_batch_items.SetMean)."""
from __future__ import annotations

import weakref

import pytest
import torch

from gradaccum._batch_items import BatchItems, SetMean
from gradaccum._gradients import AccumulationBuffers
from gradaccum._weights import Verdict, backward_weight
from gradaccum._patching import NoStep, Swaps, swapped
from gradaccum._state import AccumulatorState
from gradaccum._weights import WindowWeights


def _micro_batches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64))
            for n in (3, 1, 5)]


def _summed(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x @ w - y) ** 2).sum()


def _big_batch_grad(batches, n):
    w = torch.linspace(-1, 1, 4, dtype=torch.float64, requires_grad=True)
    sum(_summed(w, x, y) for x, y in batches).div(n).backward()
    return w.grad


@pytest.mark.parametrize("counted_first", [True, False])
def test_the_window_hands_over_the_big_batchs_gradient(counted_first):
    """Counted first (R = N, scale 1) or on the running R (scale R / N at the boundary): the .grad the
    framework steps on is the big batch's, float64 to rounding; the state records one step and N."""
    batches = _micro_batches()
    n = sum(len(y) for _, y in batches)
    state = AccumulatorState()
    p = torch.nn.Parameter(torch.linspace(-1, 1, 4, dtype=torch.float64))
    window = WindowWeights(state, 1, num_items=n if counted_first else None)
    count = 0  # the driver's running count (Lightning's)
    for x, y in batches:
        if window.reference is None:
            window.fix_reference(2 * len(y))  # a driver's first guess at N (Lightning's: A * n_0)
        count += len(y)
        (_summed(p, x, y) / len(y) * window.mean_weight(len(y))).backward()
    closing = window.hand_over([p], None if counted_first else count)
    assert closing.steps and (closing.scale == 1.0) is counted_first
    torch.testing.assert_close(p.grad, _big_batch_grad(batches, n), rtol=1e-12, atol=0)
    window.record(closing)
    assert (state.steps, state.skipped, state.last_window_items) == (1, 0, float(n))


def test_weigh_puts_the_weight_on_the_gradient_and_computes_each_counts_weight_once(monkeypatch):
    """Lightning's micro-batch: the framework backpropagates its loss divided by A itself; the hook weigh puts
    on it multiplies the gradient by A n_k W / R, so that the window's gradient is the big batch's (float64
    to rounding). The weight of a Python count is computed once per window and kept in weight_of (the one
    cache the Accumulator's window reads too): a second micro-batch of 3 items asks for no weight."""
    batches = _micro_batches() + _micro_batches(1)[:1]  # 3, 1, 5 and 3 items
    n = sum(len(y) for _, y in batches)
    asked = []
    real = WindowWeights.mean_weight
    monkeypatch.setattr(WindowWeights, "mean_weight", lambda self, k, *a: asked.append(k) or real(self, k, *a))
    window = WindowWeights(AccumulatorState(), 1, num_items=n)
    p = torch.nn.Parameter(torch.linspace(-1, 1, 4, dtype=torch.float64))
    for x, y in batches:
        loss = _summed(p, x, y) / len(y)
        with window.weigh(loss, len(y), lambda: [p], divided_by=4):
            (loss / 4).backward()
    assert asked == [3, 1, 5] and window.weight_of == {3: 3 / n, 1: 1 / n, 5: 5 / n}
    torch.testing.assert_close(p.grad, _big_batch_grad(batches, n), rtol=1e-12, atol=0)


def test_bf16_gradients_sum_in_float32_and_round_once():
    """The buffers fold each micro-batch's bf16 gradient into float32; close scales them (R / N) and
    rounds once into .grad: exactly the float32 sum's rounding, not the bf16 running sum's."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    buffers = AccumulationBuffers([p], torch.float32)
    grads = [torch.full((64,), 1.0 + k / 256, dtype=torch.bfloat16) * (1 + torch.arange(64) / 64).bfloat16()
             for k in range(16)]
    state = AccumulatorState()
    window = WindowWeights(state, 1, buffers=buffers)
    window.fix_reference(8.0)
    for g in grads:
        (p * g).sum().backward()
    closing = window.hand_over(num_items=16)  # R = 8, N = 16: scale 1/2
    assert closing.scale == 0.5 and not buffers.active
    want = (torch.stack([g.float() for g in grads]).sum(0) * 0.5).bfloat16()
    assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, want)
    running = torch.zeros(64, dtype=torch.bfloat16)
    for g in grads:
        running += g  # what .grad would hold without the buffers
    assert not torch.equal((running * 0.5), want)  # the test has teeth: the bf16 sum rounds differently


def test_the_float32_buffers_are_let_go_once_handed_over():
    """The buffers cost 4 bytes a parameter while a window is open, and no longer: hand_over rounds them into
    .grad and lets them go, so that the framework's optimizer step (Adam's first allocates its states) and
    whatever runs between windows do not hold a float32 copy of the gradient. Measured on the buffer itself:
    alive until the boundary, freed by it."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    buffers = AccumulationBuffers([p], torch.float32)
    window = WindowWeights(AccumulatorState(), 1, num_items=2, buffers=buffers)
    for k in (1, 2):
        (p * k).sum().backward()
    held = weakref.ref(buffers.tensors()[0])
    assert held() is not None and held().dtype == torch.float32 and p.grad is None  # folded, the bf16 .grad gone
    closing = window.hand_over()
    assert closing.steps and p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, torch.full((64,), 3.0).bfloat16())
    assert buffers.tensors() == [] and held() is None  # rounded once into .grad, then freed


def test_a_skipped_window_leaves_no_gradient_and_counts_a_skip():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    buffers = AccumulationBuffers([q], torch.float32)
    state = AccumulatorState()
    window = WindowWeights(state, 1, num_items=0, buffers=buffers)
    assert window.empty and window.sum_weight() == 0.0
    (p.sum() + q.float().sum()).backward()
    closing = window.hand_over([p, q])
    assert closing.verdict is Verdict.SKIP_EMPTY
    assert p.grad is None and q.grad is None and buffers.tensors() == []
    window.record(closing)
    assert (state.steps, state.skipped) == (0, 1)


def test_a_step_the_framework_did_not_apply_is_recorded_skipped():
    """An fp16 engine whose loss scale overflowed took no step: recorded as a non-finite skip."""
    state = AccumulatorState()
    window = WindowWeights(state, 1, num_items=4)
    closing = window.record(window.hand_over(), applied=False)
    assert closing.verdict is Verdict.SKIP_NONFINITE and (state.steps, state.skipped) == (0, 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_gradient_that_is_not_finite_is_skipped_or_raises(bad):
    """The Accumulator's rule on the gradient handed over: its norm (measured here, or the framework's) not
    finite skips under nonfinite='skip' (the .grad dropped, a skip recorded, the norm kept), raises under
    'raise' naming the window and the fix; a finite one steps and keeps its norm."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    state = AccumulatorState()
    window = WindowWeights(state, 1, num_items=4)
    skip = dict(nonfinite="skip", who="ExactTrainer")
    p.grad = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64)
    closing = window.judge(window.hand_over([p]), [p], **skip)
    assert closing.verdict is Verdict.STEP and closing.grad_norm == 5.0 and p.grad is not None
    p.grad = torch.tensor([1.0, bad, 0.0], dtype=torch.float64)
    closing = window.judge(window.hand_over([p]), [p], **skip)
    assert closing.verdict is Verdict.SKIP_NONFINITE and p.grad is None
    with pytest.warns(UserWarning, match=r"ExactTrainer: a window's gradient was not finite"):
        window.record(closing, warn_nonfinite=window.judged_skip_warning("ExactTrainer", closing,
                                                                         "skipped counts them"))
    assert (state.steps, state.skipped) == (0, 1)
    raising = WindowWeights(state, 1, num_items=4)
    with pytest.raises(FloatingPointError, match=r"window 2 of this run .*ExactTrainer\(nonfinite='skip'\)"):
        raising.judge(raising.hand_over(), grad_norm=torch.tensor(bad), nonfinite="raise", who="ExactTrainer")
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.full((2,), 60000.0, dtype=torch.float16)  # finite, with a norm past float16's range
    assert window.judge(window.hand_over([half]), [half], **skip).grad_norm == pytest.approx(60000.0 * 2 ** 0.5)
    empty = WindowWeights(state, 1, num_items=0)
    assert empty.judge(empty.hand_over(), grad_norm=bad, **skip).verdict is Verdict.SKIP_EMPTY  # nothing to judge


@pytest.mark.parametrize("rows, tokens", [(4, 7), (4, 0)])
def test_a_second_mean_is_weighed_over_its_own_count(rows, tokens):
    """GRPO's entropy bonus (a token mean) in a step whose loss averages over its sequences: the summed
    terms of each mean times W / its own count, over two ranks (float64 against the two means written out),
    the bonus's weight as ExactGRPOTrainer takes it (``backward_weight(1, max(T, 1), W)``); a mean over no
    token weighs a zero sum (W / 1), the window still steps on its rows."""
    g = torch.Generator().manual_seed(0)
    loss_terms, bonus_terms = torch.randn(rows, dtype=torch.float64, generator=g), torch.randn(
        tokens, dtype=torch.float64, generator=g)
    state = AccumulatorState()
    window, bonus_weight = WindowWeights(state, 2, num_items=rows), backward_weight(1, max(tokens, 1), 2)
    got = (loss_terms.sum() * window.sum_weight() + bonus_terms.sum() * bonus_weight) / 2
    want = loss_terms.mean() + (bonus_terms.mean() if tokens else 0.0)
    assert torch.allclose(got, torch.as_tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)
    assert bonus_weight == 2 / max(tokens, 1) and window.record(window.hand_over()).steps


def test_a_failed_window_folds_nothing_into_the_next():
    q = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    buffers = AccumulationBuffers([q], torch.float32)
    window = WindowWeights(AccumulatorState(), 1, num_items=2, buffers=buffers)
    q.float().sum().backward()
    assert buffers.tensors()
    window.abort()
    assert buffers.tensors() == [] and not buffers.active
    q.float().sum().backward()  # after the failure: not folded
    assert buffers.tensors() == [] and q.grad is not None


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(1, 1)
        self.flag = True

    def hook(self) -> str:
        return "class"


def test_swapped_puts_back_what_was_there_also_on_an_exception():
    holder, stand_in = _Holder(), torch.nn.Identity()
    model = holder.model
    with swapped(holder, "model", stand_in), swapped(holder, "flag", False), swapped(holder, "hook", lambda: "mine"):
        assert holder.model is stand_in and holder.flag is False and holder.hook() == "mine"
    assert holder.model is model and holder.flag is True and holder.hook() == "class"
    assert "hook" not in vars(holder)  # the class's method shows through again, no bound copy left behind
    with pytest.raises(KeyError):
        with swapped(holder, "flag", 0):
            raise KeyError("inside")
    assert holder.flag is True


def test_swaps_wrap_each_attribute_once_until_restored():
    """What Lightning's callback does to the module's hooks for a fit, and the Trainer driver to its optimizer
    for a skipped window's end: each attribute wrapped once (a second wrap would wrap the wrapper), all put
    back by restore, which may be called again."""
    holder, swaps = _Holder(), Swaps()
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    holder.optimizer = optimizer
    assert not swaps
    for _ in range(2):
        swaps.wrap(holder, "optimizer", NoStep)
        swaps.wrap(holder, "hook", lambda hook: lambda: "wrapped " + hook())
    assert swaps and holder.hook() == "wrapped class" and holder.optimizer.inner is optimizer
    assert holder.optimizer.step() is None and holder.optimizer.param_groups is optimizer.param_groups
    swaps.restore()
    swaps.restore()
    assert not swaps and holder.optimizer is optimizer and "hook" not in vars(holder) and holder.hook() == "class"
    other = _Holder()  # two owners' attributes of one name are two swaps
    swaps.wrap(holder, "hook", lambda hook: lambda: "one")
    swaps.wrap(other, "hook", lambda hook: lambda: "two")
    assert (holder.hook(), other.hook()) == ("one", "two")
    swaps.restore()
    with pytest.raises(AttributeError):  # a wrap that fails holds nothing, and the attribute can be wrapped later
        swaps.wrap(holder, "missing", lambda value: value)
    assert not swaps
    holder.missing = 1
    swaps.wrap(holder, "missing", lambda value: value + 1)
    assert holder.missing == 2
    swaps.restore()
    assert holder.missing == 1


def test_the_evaluation_mean_weighs_items_not_batches():
    """Two batches of 1 and 3 labelled rows: the set's mean is the item-weighted one (float64), which a
    mean of batch means is not."""
    items = BatchItems("rows", None, -100, None, torch.device("cpu"))
    mean = SetMean(items, gather=lambda t: t)
    batches = [({"input_ids": torch.zeros(1, 2)}, torch.tensor(4.0, dtype=torch.float64)),
               ({"input_ids": torch.zeros(3, 2)}, torch.tensor(1.0, dtype=torch.float64))]
    for batch, batch_mean in batches:
        mean.keep_mean(batch_mean, batch)
    metrics: dict = {}
    mean.report(metrics, "eval")
    assert metrics == {"eval_loss": (4.0 * 1 + 1.0 * 3) / 4}
    assert metrics["eval_loss"] != (4.0 + 1.0) / 2
    mean.report(metrics := {}, "eval")
    assert metrics == {}  # the tally starts again with each evaluation
