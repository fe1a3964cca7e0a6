"""Accelerate as a client (#10), single process: the prepared model, optimizer and DataLoader go to
the Accumulator, the raw scheduler to ``scheduler=``. Two processes: distributed/stacks_worker.py."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from torch.utils.data import DataLoader  # noqa: E402

from gradaccum import Accumulator, num_steps  # noqa: E402
from helpers import assert_params_close  # noqa: E402
from hf_helpers import gpt2, lm_loss, pad, reference_step, sequences, unpad  # noqa: E402


@pytest.fixture
def accelerator():
    """Accelerate keeps its state in process-wide singletons: reset them before the test (a Trainer stopped by
    an error mid-window, in an earlier test of this process, leaves sync_gradients False) and after it."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_prepared_model_optimizer_and_loader_are_exact(accelerator):
    """Micro-batches of 2 padded sequences, windows of 2 (the last one short), AdamW, a warmup schedule:
    every step equals one on the window's sequences as one padded batch."""
    data = sequences([9, 3, 6, 2, 8, 5, 4, 7, 2, 5], seed=3)
    loader = DataLoader(data, batch_size=2, collate_fn=pad)
    model, ref = gpt2(), gpt2()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref))
    total = num_steps(len(loader), 2)
    sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: (s + 1) / (total + 1)) for o in (opt, ref_opt))
    p_model, p_opt, p_loader = accelerator.prepare(model, opt, loader)
    assert isinstance(p_opt, accelerate.optimizer.AcceleratedOptimizer)
    acc = Accumulator(p_model, p_opt, scheduler=sched)
    results = list(acc.train(p_loader, lm_loss, accum_steps=2))
    seen = [unpad(mb) for mb in loader]
    for w, result in enumerate(results):
        window = [s for mb in seen[2 * w:2 * w + 2] for s in mb]
        assert result.loss == pytest.approx(reference_step(ref, ref_opt, window, ref_sched), rel=1e-12)
    assert len(results) == total == 3 and sched.last_epoch == total
    assert_params_close(model, ref)


def test_an_optimizer_with_accelerates_grad_scaler_is_refused_with_the_fix(accelerator):
    """``Accelerator(mixed_precision="fp16")`` on a GPU gives the prepared optimizer a GradScaler, and
    ``AcceleratedOptimizer.step()`` runs ``scaler.step()``: it divides gradaccum's (unscaled) gradients by
    the loss scale. The first window raises GradScaler's "did not use scaler.scale(loss)" AssertionError,
    which names neither gradaccum nor the fix; once anything has called ``scaler.scale`` (one
    ``accelerator.backward`` anywhere), every step is 65536 times too small and reported as taken.
    Here the scaler is built on the CPU, as Accelerate builds it on a GPU."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = torch.nn.Linear(4, 1)
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"GradScaler.*precision='fp16'"):
        Accumulator(model, opt)


def test_accelerates_own_accumulation_is_refused_and_its_prepared_scheduler_is_stepped_once(accelerator):
    """A script moved onto gradaccum that keeps ``with accelerator.accumulate(model):`` around ``acc.step``: off
    Accelerate's boundary the prepared optimizer's ``step()`` does nothing, so half of gradaccum's steps were
    dropped while ``StepResult.step`` counted them (a probe: 0.68 off one big batch). Refused at the window's
    boundary, before its step; ``Accelerator(gradient_accumulation_steps=2)`` without ``accumulate()`` is one big
    batch per window. The prepared scheduler, which steps the one inside once per process, is unwrapped: one
    scheduler step per optimizer step."""
    from accelerate.state import GradientState

    GradientState._reset_state()
    grouped = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (s + 1))
    p_model, p_opt, p_sched = grouped.prepare(model, opt, sched)
    acc = Accumulator(p_model, p_opt, scheduler=p_sched)
    assert acc.scheduler is sched
    mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g,
                                                                             dtype=torch.float64)) for n in (7, 5)]
    for batch in batches:
        result = acc.step(batch, mse, micro_batch_size=3)
        ref_opt.zero_grad()
        mse(ref, batch).backward()
        ref_opt.step()
        ref_sched.step()
    assert result.step == 2 and sched.last_epoch == ref_sched.last_epoch == 2
    assert_params_close(model, ref)
    with grouped.accumulate(p_model):  # its first call: off Accelerate's boundary
        with pytest.raises(ValueError, match=r"sync_gradients is False.*leave out accelerator.accumulate\(\)"):
            acc.step(batches[0], mse, micro_batch_size=3)
    assert_params_close(model, ref)  # no step taken


def test_a_resumed_run_reads_the_epoch_order_an_uninterrupted_one_reads():
    """A probe: with use_seedable_sampler=True, Accelerate's prepared loader shuffles by a count of its own,
    which starts again at 0 in a resumed process, so a run resumed at epoch 2 trained on epoch 0's order (9.0e-3
    off the uninterrupted run, each step exact on the window it got). acc.train tells the loader itself the epoch."""
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import TensorDataset

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = accelerate.Accelerator(
            cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(use_seedable_sampler=True))
        dataset = TensorDataset(torch.arange(24, dtype=torch.float64)[:, None], torch.zeros(24, 1, dtype=torch.float64))

        def orders(start_epoch: int, epochs: int):
            model = torch.nn.Linear(1, 1).double()
            loader = accelerator.prepare(DataLoader(dataset, batch_size=4, shuffle=True))
            acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
            acc.epoch = start_epoch  # as acc.load_state_dict would set it
            seen = []

            def loss(m, b):
                seen.append(b[0][:, 0].tolist())
                return torch.nn.functional.mse_loss(m(b[0]), b[1])

            list(acc.train(loader, loss, accum_steps=3, epochs=epochs))
            return [sum(seen[e * 6:(e + 1) * 6], []) for e in range(epochs)]

        uninterrupted = orders(0, 3)
        assert uninterrupted[0] != uninterrupted[2]
        assert orders(2, 1) == [uninterrupted[2]]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
