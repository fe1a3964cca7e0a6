"""Property-based tests (Hypothesis) of the core contract: whatever window is drawn, the step equals
ONE optimizer step on the item-weighted mean loss over the whole window (float64, rtol 1e-10).

Every drawn window is built from seeded generators, so an example replays exactly and a failure
shrinks to the smallest window that shows it (fewest, smallest micro-batches; seed 0). The Hypothesis
profiles live in conftest.py: "ci" (the default) is derandomized and small, so every machine runs the
same examples; ``HYPOTHESIS_PROFILE=dev`` draws many more.
"""
from __future__ import annotations

import copy
import math
from typing import List, Tuple

import pytest
import torch
from hypothesis import assume, event, example, given, note
from hypothesis import strategies as st
from torch import nn

from gradaccum import Accumulator, causal_lm_loss, count_targets
from helpers import assert_params_close, mse, regression_batch, regression_model

RTOL, ATOL = 1e-10, 1e-12


# -- strategies and builders -----------------------------------------------------------------

#: one window: the sizes of its micro-batches, uneven
window_sizes = st.lists(st.integers(1, 7), min_size=1, max_size=5)
#: the data's seed (shrinks to 0)
seeds = st.integers(0, 2 ** 16)
#: plain SGD (the update is proportional to the gradient), SGD with momentum and weight decay, AdamW
optimizers = st.sampled_from(["sgd", "momentum", "adamw"])


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def model_pair(opt_name: str, model: nn.Module = None):
    """A float64 model and its reference copy, each with its own optimizer."""
    model = regression_model() if model is None else model
    ref = copy.deepcopy(model)
    return model, ref, make_optimizer(opt_name, model.parameters()), make_optimizer(opt_name, ref.parameters())


def regression_window(sizes: List[int], seed: int) -> Tuple[list, tuple]:
    """Micro-batches of the given sizes, and the one batch they are the rows of."""
    x, y = regression_batch(sum(sizes), seed=seed)
    return list(zip(x.split(sizes), y.split(sizes))), (x, y)


def reference(ref: nn.Module, ref_opt: torch.optim.Optimizer, full_loss, max_grad_norm=None) -> Tuple[float, float]:
    """One step by hand on the whole window: zero grads, full-batch mean loss, backward, optional
    clip, step. Returns the loss and the gradient's total norm before clipping."""
    ref_opt.zero_grad(set_to_none=True)
    loss = full_loss()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf if max_grad_norm is None else max_grad_norm)
    ref_opt.step()
    return loss.item(), norm.item()


def same_params(model: nn.Module, ref: nn.Module) -> None:
    assert_params_close(model, ref, rtol=RTOL, atol=ATOL)


# -- 1. uneven micro-batches -----------------------------------------------------------------

@given(windows=st.lists(window_sizes, min_size=1, max_size=2), opt_name=optimizers, seed=seeds)
def test_uneven_micro_batches_step_as_one_batch(windows, opt_name, seed):
    """A list of micro-batches of any sizes (two windows in a row, so momentum/Adam state carries):
    the parameters, StepResult.loss and num_items are those of one step on the concatenated batch."""
    model, ref, opt, ref_opt = model_pair(opt_name)
    acc = Accumulator(model, opt)
    for k, sizes in enumerate(windows):
        window, full = regression_window(sizes, seed + k)
        result = acc.step(window, mse)
        ref_loss, _ = reference(ref, ref_opt, lambda: mse(ref, full))
        same_params(model, ref)
        assert math.isclose(result.loss, ref_loss, rel_tol=RTOL)
        assert result.num_items == sum(sizes) and result.micro_batches == len(sizes)
        assert result.step == k + 1 and not result.skipped


# -- 2. one batch split by any micro_batch_size ----------------------------------------------

@given(batches=st.lists(st.integers(1, 24), min_size=1, max_size=2), micro_batch_size=st.integers(1, 30),
       opt_name=optimizers, seed=seeds)
def test_any_micro_batch_size_steps_as_one_batch(batches, micro_batch_size, opt_name, seed):
    """One batch split along dim 0 by any micro_batch_size (a short last chunk, or one chunk when the
    size exceeds the batch) steps as the whole batch does."""
    model, ref, opt, ref_opt = model_pair(opt_name)
    acc = Accumulator(model, opt)
    for k, n in enumerate(batches):
        batch = regression_batch(n, seed=seed + k)
        result = acc.step(batch, mse, micro_batch_size=micro_batch_size)
        ref_loss, _ = reference(ref, ref_opt, lambda: mse(ref, batch))
        same_params(model, ref)
        assert math.isclose(result.loss, ref_loss, rel_tol=RTOL)
        assert result.num_items == n and result.micro_batches == math.ceil(n / micro_batch_size)
        assert result.micro_batch_size == min(micro_batch_size, n)  # the size used


# -- 3. token counts with ignored labels -----------------------------------------------------

VOCAB = 11


class TinyLM(nn.Module):
    """Embedding + causal mixing + linear head: position t sees only positions <= t, so right
    padding changes no counted logit."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.out(h + torch.tanh(self.mix(h.cumsum(dim=1))))


#: one micro-batch: its sequences' lengths (0 and 1 have no next-token target)
sequence_lengths = st.lists(st.integers(0, 6), min_size=1, max_size=3)
lm_window = st.lists(sequence_lengths, min_size=1, max_size=4)


def lm_micro_batches(window: List[List[int]], extra_pad: int, seed: int) -> list:
    """Each micro-batch padded to its own width (longest + extra_pad); labels are -100 past each length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in window:
        width = max(1, max(lengths)) + extra_pad
        ids = torch.zeros(len(lengths), width, dtype=torch.long)
        labels = torch.full((len(lengths), width), -100)
        for i, n in enumerate(lengths):
            seq = torch.randint(1, VOCAB, (n,), generator=g)
            ids[i, :n], labels[i, :n] = seq, seq
        out.append({"input_ids": ids, "labels": labels})
    return out


def lm_full_batch(micro_batches: list) -> dict:
    """The same sequences as one batch, padded to the widest micro-batch."""
    width = max(mb["input_ids"].shape[1] for mb in micro_batches)
    pad = lambda t, value: nn.functional.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
    return {"input_ids": torch.cat([pad(mb["input_ids"], 0) for mb in micro_batches]),
            "labels": torch.cat([pad(mb["labels"], -100) for mb in micro_batches])}


def lm_pair(model, mb):
    return causal_lm_loss(model(mb["input_ids"]), mb["labels"])  # (mean over targets, count)


def lm_mean(model, mb):
    return lm_pair(model, mb)[0]  # a bare mean, as Hugging Face's outputs.loss


@given(windows=st.lists(lm_window, min_size=1, max_size=2), extra_pad=st.integers(0, 2),
       mode=st.sampled_from(["pair", "counter", "pair+counter"]), opt_name=st.sampled_from(["momentum", "adamw"]),
       seed=seeds)
@example(windows=[[[1, 0], [5, 3]], [[2], [0], [1, 1, 1]]], extra_pad=1, mode="pair", opt_name="momentum", seed=0)
@example(windows=[[[1], [6, 2]]], extra_pad=0, mode="counter", opt_name="momentum", seed=0)
def test_token_counts_weigh_the_window_by_targets(windows, extra_pad, mode, opt_name, seed):
    """Padded sequences of random lengths (labels -100 past each length; micro-batches where every
    label is ignored included): whether loss_fn returns (mean, count), or a bare mean with
    num_items=count_targets, or both, the step is one on the token-weighted mean over the window."""
    targets = [[max(n - 1, 0) for n in lengths] for window in windows for lengths in window]
    event(f"micro-batch with no target: {any(sum(t) == 0 for t in targets)}")
    for window in windows:
        assume(sum(max(n - 1, 0) for lengths in window for n in lengths) > 0)  # a window with no target is skipped
    torch.manual_seed(0)
    model, ref, opt, ref_opt = model_pair(opt_name, TinyLM().double())
    acc = Accumulator(model, opt)
    loss_fn = lm_mean if mode == "counter" else lm_pair
    counter = (lambda mb: count_targets(mb["labels"])) if "counter" in mode else None
    for k, window in enumerate(windows):
        micro_batches = lm_micro_batches(window, extra_pad, seed + k)
        full = lm_full_batch(micro_batches)
        result = acc.step(micro_batches, loss_fn, num_items=counter)
        ref_loss, _ = reference(ref, ref_opt, lambda: lm_mean(ref, full))
        same_params(model, ref)
        assert math.isclose(result.loss, ref_loss, rel_tol=RTOL)
        assert result.num_items == count_targets(full["labels"]) and not result.skipped


# -- 4. consecutive windows and the short last one under train() -----------------------------

@st.composite
def train_runs(draw):
    """accum_steps N, and micro-batch sizes whose count L is not a multiple of N."""
    accum_steps = draw(st.integers(2, 4))
    length = draw(st.integers(0, 2)) * accum_steps + draw(st.integers(1, accum_steps - 1))
    return accum_steps, draw(st.lists(st.integers(1, 7), min_size=length, max_size=length))


@given(run=train_runs(), epochs=st.integers(1, 2), opt_name=optimizers, seed=seeds)
def test_train_steps_each_window_and_the_short_last_one_exactly(run, epochs, opt_name, seed):
    """acc.train(loader, accum_steps=N) over L micro-batches (L not a multiple of N): every window,
    the short last one included, is one reference step on exactly its micro-batches, in sequence."""
    accum_steps, sizes = run
    model, ref, opt, ref_opt = model_pair(opt_name)
    acc = Accumulator(model, opt)
    loader, _ = regression_window(sizes, seed)
    windows = [loader[i:i + accum_steps] for i in range(0, len(loader), accum_steps)] * epochs
    taken = 0
    for result, window in zip(acc.train(loader, mse, accum_steps=accum_steps, epochs=epochs), windows):
        full = tuple(torch.cat(parts) for parts in zip(*window))
        ref_loss, _ = reference(ref, ref_opt, lambda: mse(ref, full))
        same_params(model, ref)
        assert math.isclose(result.loss, ref_loss, rel_tol=RTOL)
        assert result.num_items == len(full[0]) and result.micro_batches == len(window)
        taken += 1
    assert taken == len(windows) == acc.steps and acc.epoch == epochs


# -- 5. clipping the window's gradient -------------------------------------------------------

@given(sizes=window_sizes, max_grad_norm=st.floats(1e-3, 2.0), opt_name=st.sampled_from(["sgd", "momentum"]),
       seed=seeds)
def test_clipping_clips_the_full_batch_gradient(sizes, max_grad_norm, opt_name, seed):
    """max_grad_norm clips the normalized window gradient as clip_grad_norm_ clips the full-batch
    one (coefficient max / (norm + 1e-6)); StepResult.grad_norm is the full batch's norm."""
    model, ref, opt, ref_opt = model_pair(opt_name)
    window, full = regression_window(sizes, seed)
    result = Accumulator(model, opt, max_grad_norm=max_grad_norm).step(window, mse)
    _, ref_norm = reference(ref, ref_opt, lambda: mse(ref, full), max_grad_norm)
    event(f"clipped: {ref_norm > max_grad_norm}")
    same_params(model, ref)
    assert math.isclose(result.grad_norm, ref_norm, rel_tol=RTOL)


def test_clipping_engages_in_the_drawn_range():
    """The drawn max_grad_norm range really clips: on a window the property draws, the norm exceeds
    it and the clipped step differs from the unclipped one (which the property would then catch)."""
    window, full = regression_window([5, 1, 3], 0)
    model, ref, opt, ref_opt = model_pair("sgd")
    unclipped = copy.deepcopy(model)
    result = Accumulator(model, opt, max_grad_norm=0.5).step(window, mse)
    assert result.grad_norm > 0.5
    reference(ref, ref_opt, lambda: mse(ref, full), 0.5)
    same_params(model, ref)
    reference(unclipped, torch.optim.SGD(unclipped.parameters(), lr=0.1), lambda: mse(unclipped, full))
    assert not all(torch.allclose(p, q, rtol=1e-3) for p, q in zip(model.parameters(), unclipped.parameters()))


# -- 6. float32 accumulation buffers for a bfloat16 model ------------------------------------

@st.composite
def dyadic_windows(draw):
    """Micro-batches as (size, scale): sizes of at most 8 summing to a power of two N (2 to 32), so
    every backward weight n_k / N and mean 1 / (8 n_k) is a power of two; scales are the power of two
    (2^0 to 2^5) each micro-batch's inputs and targets are multiplied by, so that the micro-batches'
    gradients differ by up to 2^10 and their sum needs more bits than bf16 holds."""
    parts = [2 ** draw(st.integers(1, 5))]
    while True:
        splittable = [i for i, p in enumerate(parts) if p > 1]
        too_big = [i for i, p in enumerate(parts) if p > 8]
        if too_big:
            i = too_big[0]
        elif splittable and len(parts) < 8 and draw(st.booleans()):
            i = draw(st.sampled_from(splittable))
        else:
            break
        parts[i:i + 1] = [parts[i] // 2, parts[i] // 2]
    return [(n, draw(st.integers(0, 5))) for n in parts]


def bf16_window_gradient(window, seed: int, accum_dtype):
    """The gradient a bfloat16 linear model hands its optimizer after the window, and the exact
    full-batch gradient in float64.

    Weights in {-1, 0, 1}, inputs 2^s * {-1, 0, 1} and targets 2^s * [-8, 8] (s the micro-batch's
    scale): each micro-batch's bf16 gradient is 2^(2s) times a sum of at most 8 integers of at most
    16, times a power of two, so it is exact on any CPU kernel, and so is the float32 sum of them all
    (under 2^22). With buffers, the one rounding left is the final round-to-nearest-even cast.
    """
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-1, 2, (8, 8), generator=g).to(torch.bfloat16))
    micro_batches = [(torch.randint(-1, 2, (n, 8), generator=g) * 2.0 ** s,
                      torch.randint(-8, 9, (n, 8), generator=g) * 2.0 ** s) for n, s in window]
    x, y = (torch.cat(parts) for parts in zip(*micro_batches))
    exact = model.weight.detach().double().clone().requires_grad_()
    nn.functional.mse_loss(x.double() @ exact.T, y.double()).backward()
    captured = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            captured.append(model.weight.grad.clone())

    acc = Accumulator(model, Capture(model.parameters(), lr=0.0), accum_dtype=accum_dtype)
    bf16 = [(a.to(torch.bfloat16), b.to(torch.bfloat16)) for a, b in micro_batches]
    result = acc.step(bf16, lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1].float()))
    assert result.num_items == len(x) and len(captured) == 1 and captured[0].dtype == torch.bfloat16
    return captured[0], exact.grad


@given(window=dyadic_windows(), seed=seeds)
def test_fp32_buffers_hand_the_optimizer_the_exact_gradient_rounded_once(window, seed):
    """A bfloat16 model with accum_dtype=torch.float32 over uneven micro-batches: the gradient the
    optimizer gets is bitwise bf16(exact full-batch gradient), i.e. rounded once. Machine-independent
    by construction (see bf16_window_gradient): nothing else rounds."""
    got, exact = bf16_window_gradient(window, seed, torch.float32)
    want = exact.to(torch.bfloat16)
    note(f"max difference {(got.double() - want.double()).abs().max().item()}")
    assert torch.equal(got, want)


def test_plain_bf16_accumulation_breaks_the_rounded_once_property():
    """Without buffers the running bf16 sum rounds at every micro-batch: on a window the property
    draws, the gradient is not bf16(exact). (So the property tells buffers from no buffers.)"""
    window = [(8, 0), (8, 0), (8, 2), (8, 0)]  # what the property shrinks to when buffers sum in bf16
    got, exact = bf16_window_gradient(window, 0, None)
    assert not torch.equal(got, exact.to(torch.bfloat16))
    got, exact = bf16_window_gradient(window, 0, torch.float32)
    assert torch.equal(got, exact.to(torch.bfloat16))


# -- 7. micro_batch_size="auto" with injected out-of-memory errors ---------------------------

def oom_above(limit: int, fail_at: int, n: int, log: list):
    """A loss_fn that runs out of memory in every attempt whose micro-batches hold more than
    ``limit`` items, at its micro-batch ``fail_at`` (or its last): after that many backwards ran, so
    the failed attempt leaves partial gradients. The batch carries its row indices as a third tensor."""
    attempt = {}

    def loss_fn(model, mb):
        x, y, rows = mb
        start = int(rows[0])
        if start == 0:  # the first micro-batch of an attempt fixes its size
            attempt["size"] = len(rows)
        size = attempt["size"]
        position, chunks = start // size, math.ceil(n / size)
        log.append((size, position))
        loss = mse(model, (x, y))
        if size > limit and position == min(fail_at, chunks - 1):
            raise torch.OutOfMemoryError("injected")
        return loss

    return loss_fn


@st.composite
def oom_windows(draw):
    """Batch sizes of one or two windows, and a memory limit: below the first batch (the first
    attempts fail) but for limit = n, and often below half of it (an attempt of several micro-batches
    fails after a backward)."""
    n = draw(st.integers(2, 16))
    limit = draw(st.one_of(st.integers(1, max(1, n // 3)), st.integers(1, n)))
    return [n] + draw(st.lists(st.integers(1, 16), max_size=1)), limit


@given(run=oom_windows(), fail_at=st.integers(0, 2), opt_name=optimizers, seed=seeds)
@example(run=([16], 5), fail_at=1, opt_name="sgd", seed=0)
@example(run=([7, 3], 1), fail_at=2, opt_name="momentum", seed=0)
def test_auto_size_after_out_of_memory_still_steps_exactly(run, fail_at, opt_name, seed):
    """micro_batch_size="auto" with an out-of-memory error above ``limit`` items, raised possibly
    after some backwards of the attempt ran: the partial gradients are dropped, the size halves until
    it fits (so auto_micro_batch_size <= limit), and each window is exactly one big-batch step."""
    batches, limit = run
    model, ref, opt, ref_opt = model_pair(opt_name)
    acc = Accumulator(model, opt)
    expected = batches[0]
    while expected > limit:
        expected //= 2
    failed_late = False
    for k, n in enumerate(batches):
        x, y = regression_batch(n, seed=seed + k)
        log: list = []
        result = acc.step((x, y, torch.arange(n)), oom_above(limit, fail_at, n, log), micro_batch_size="auto")
        failed_late = failed_late or any(size > limit and position > 0 for size, position in log)
        reference(ref, ref_opt, lambda: mse(ref, (x, y)))
        same_params(model, ref)
        assert acc.auto_micro_batch_size == expected <= limit
        assert result.micro_batch_size == min(expected, n) and result.num_items == n
        assert result.step == k + 1
    event(f"an attempt failed after a backward ran: {failed_late}")


# -- 8. a window never steps inside ----------------------------------------------------------

@given(windows=st.lists(window_sizes, min_size=1, max_size=3), counts_up_front=st.booleans(),
       opt_name=optimizers, seed=seeds)
def test_a_hand_written_window_steps_once_and_only_at_its_end(windows, counts_up_front, opt_name, seed):
    """acc.window(n) in a hand-written loop: the parameters are bitwise unchanged until window.step(),
    which calls optimizer.step() exactly once, clears the gradients and equals the reference step."""
    model, ref, opt, ref_opt = model_pair(opt_name)
    calls = []
    inner = opt.step

    def counting_step(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    opt.step = counting_step
    acc = Accumulator(model, opt)
    for k, sizes in enumerate(windows):
        window, full = regression_window(sizes, seed + k)
        before = [p.detach().clone() for p in model.parameters()]
        with acc.window(len(window), num_items=sum(sizes) if counts_up_front else None) as w:
            for x, y in window:
                with w.micro_batch():
                    w.backward(nn.functional.mse_loss(model(x), y), num_items=len(x))
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                assert len(calls) == k
            result = w.step()
        assert len(calls) == k + 1 and result.step == k + 1
        assert all(p.grad is None for p in model.parameters())
        reference(ref, ref_opt, lambda: mse(ref, full))
        same_params(model, ref)
