"""Accelerate as a client (#10), single process: the prepared model, optimizer and DataLoader go to
the Accumulator, the raw scheduler to ``scheduler=``. Two processes: distributed/stacks_worker.py."""
from __future__ import annotations

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


def test_accelerates_own_accumulation_and_prepared_scheduler_are_refused_with_the_fix(accelerator):
    """A script moved onto gradaccum that keeps ``Accelerator(gradient_accumulation_steps=2)``: the prepared
    optimizer's ``step()`` does nothing off Accelerate's boundary, so half of gradaccum's steps were dropped while
    ``StepResult.step`` counted them (a probe: 0.68 off one big batch). And the prepared scheduler steps the raw
    one once per process: on 2 processes the schedule ran twice as fast. Both refused as the Accumulator is
    built, naming the fix; the raw scheduler, and the optimizer prepared without accumulation, are taken."""
    from accelerate.state import GradientState

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    p_model, p_opt, p_sched = accelerator.prepare(model, opt, sched)
    with pytest.raises(ValueError, match=r"scheduler is Accelerate's prepared one \(AcceleratedScheduler\).*raw"):
        Accumulator(p_model, p_opt, scheduler=p_sched)
    Accumulator(p_model, p_opt, scheduler=sched)
    GradientState._reset_state()
    grouped = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    p_model, p_opt = grouped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"Accelerator\(gradient_accumulation_steps=2\).*without "
                                         r"gradient_accumulation_steps.*accelerator.accumulate\(\)"):
        Accumulator(p_model, p_opt)
