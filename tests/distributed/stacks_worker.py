"""The stacks users train with, under torchrun with 2 gloo processes on the CPU (#10; see test_stacks.py):
DDP over torch.compile (eager, aot_eager, inductor), Accelerate (prepared objects, its scheduler, its
dynamo_backend), ZeroRedundancyOptimizer, and a transformers GPT-2 with uneven data across ranks.

Each scenario compares against single-process float64 steps on the union of both ranks' windows,
computed on every rank, and prints ``PASS <name>`` on rank 0, ``FAIL <name>: <why>``, or ``SKIP`` when
the machine lacks what it needs (a C++ compiler for inductor); the run goes on. Checks that could
fail on one rank only compare both ranks' values, so both fail together. Collectives time out after
60 s: a hang ends the run within a minute, and the scenarios that did not report fail.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: hf_helpers

from gradaccum import Accumulator, count_targets  # noqa: E402
from gradaccum.sync import DDPSync  # noqa: E402
from distributed.launch import Skip, run_modules  # noqa: E402
from worker import close, counting_hook, data, make_opt, model_fn, mse, reference  # noqa: E402

RANK, WORLD = 0, 1


# each rank's window: micro-batch sizes, a different number of micro-batches per rank. No size 1:
# torch.compile specialises on it, so the number of graphs would depend on the order sizes come in
SHARES = {0: [4, 4, 3], 1: [5, 2]}


def windows(offset: int, n: int, shares=SHARES):
    """``n`` steps, each holding every rank's window: what the reference steps on."""
    return [[[data(r, offset + 10 * s + k, size) for k, size in enumerate(shares[r])] for r in range(WORLD)]
            for s in range(n)]


def replicas_identical(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], other) for other in every[1:])


def gathered(obj):
    """Every rank's ``obj``, in rank order."""
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- DDP over torch.compile

def _ddp_over_compiled(backend: str, steps: int) -> str:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)  # counts the graphs dynamo hands the backend
    inner = model_fn()
    model = DDP(torch.compile(inner, backend=counter))
    hook_fn, hook = counting_hook()
    model.register_comm_hook(None, hook_fn)
    acc = Accumulator(model, make_opt(model, "adamw"))
    assert isinstance(acc.sync, DDPSync), acc.sync
    plan = windows(200, steps)
    graphs = []
    for s in range(steps):
        result = acc.step(plan[s][RANK], mse)
        assert result.num_items == 11 + 7, result.num_items
        graphs.append(counter.frame_count)
    # the first micro-batch compiles; the short last one recompiles (its batch dimension then dynamic);
    # nothing after that, neither the other rank's sizes nor the next windows. Checked on both ranks'
    # counts at once, so that both fail together instead of one waiting for the other
    counts = gathered((graphs, hook.calls))
    assert counts == [([2] * steps, steps)] * WORLD, f"per rank (graphs after each window, all-reduces): {counts}"
    close(inner, reference(plan))
    return f"{backend}: exact, graphs {graphs}, {hook.calls} all-reduces"


def ddp_over_compiled_eager_and_aot_eager():
    return "; ".join(_ddp_over_compiled(b, 3) for b in ("eager", "aot_eager"))


def ddp_over_compiled_inductor():
    """inductor once, on the tiny model. Cold, its compiles cost ~40 s on 2 cores, mostly a pool of
    compile workers starting and g++ probing the CPU's vector ISAs; in-process compiles of scalar
    kernels (float64, what the test is about) take a few seconds."""
    import torch._inductor.config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - whatever inductor raises when it finds none
        raise Skip(f"inductor on the CPU needs a C++ compiler: {e}") from e
    with inductor_config.patch({"compile_threads": 1, "cpp.vec_isa_ok": False}):
        return _ddp_over_compiled("inductor", 2)


# --------------------------------------------------------------------------- Accelerate

def _accelerator(**kwargs):
    """A fresh Accelerator. Accelerate keeps its settings in a process-wide singleton that a second
    Accelerator silently reuses (a new dynamo_backend would be ignored): reset it, keeping the process
    group (PartialState)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def accelerate_prepared_exact_with_raw_scheduler():
    """The prepared model (DDP), optimizer and DataLoader given to the Accumulator, the raw scheduler to
    ``scheduler=``: exact on the union of what each rank's prepared loader yielded, and the schedule
    advances once per optimizer step. With ``even_batches=False`` ranks get 5 and 4 micro-batches
    (no sample counted twice) and are still exact."""
    from accelerate import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from hf_helpers import gpt2, lm_loss, pad, reference_step, sequences, unpad

    notes = []
    for even in (True, False):
        accelerator = _accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even))
        docs = sequences([9, 3, 6, 2, 8, 5, 4, 7, 2, 5, 6, 3, 9, 4, 2, 8, 3, 5], seed=7)  # 9 batches of 2
        model, ref = gpt2(), gpt2()
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref))
        sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in (opt, ref_opt))
        p_model, p_opt, p_loader = accelerator.prepare(model, opt, DataLoader(docs, batch_size=2, collate_fn=pad))
        assert isinstance(p_model, DDP), type(p_model)
        seen = []

        def loss_fn(m, mb):
            seen.append(unpad(mb))
            return lm_loss(m, mb)

        acc = Accumulator(p_model, p_opt, scheduler=sched)
        results = list(acc.train(p_loader, loss_fn, accum_steps=2))
        per_rank = gathered(seen)
        # uneven: in the last window rank 1 has none of its own; it repeats its 4th with zero weight
        # (DDP's forward collectives), which the reference must not count
        assert [len(s) for s in per_rank] == [5, 5], [len(s) for s in per_rank]
        if not even:
            spare, last = per_rank[1][4], per_rank[1][3]
            assert len(spare) == len(last) and all(torch.equal(a, b) for a, b in zip(spare, last))
            per_rank[1] = per_rank[1][:4]
        assert [r.step for r in results] == [1, 2, 3], [r.step for r in results]
        lrs = []
        for w, result in enumerate(results):
            window = [s for mbs in per_rank for mb in mbs[2 * w:2 * w + 2] for s in mb]
            lrs.append(ref_opt.param_groups[0]["lr"])
            ref_loss = reference_step(ref, ref_opt, window, ref_sched)
            assert abs(result.loss - ref_loss) <= 1e-12 * ref_loss, (result.loss, ref_loss)
        assert [r.lr for r in results] == lrs and sched.last_epoch == acc.steps == 3, (lrs, sched.last_epoch)
        close(model, ref)
        assert replicas_identical(model)
        notes.append(f"even_batches={even}: micro-batches per rank {[len(s) for s in per_rank]}, exact")
    return "; ".join(notes) + "; raw scheduler once per step"


def accelerate_prepared_scheduler_is_stepped_once_per_step():
    """Issue item 7, Accelerate's own behaviour: its prepared scheduler advances ``num_processes`` times per
    call unless ``split_batches=True`` (measured here: one call, WORLD steps), so through it the schedule ran
    WORLD times too fast. The Accumulator unwraps it and steps the scheduler inside once per optimizer step."""
    from accelerate.scheduler import AcceleratedScheduler

    accelerator = _accelerator()
    model = model_fn()
    opt = make_opt(model, "sgd")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    p_model, p_opt, p_sched = accelerator.prepare(model, opt, sched)
    p_sched.step()
    assert sched.last_epoch == WORLD, sched.last_epoch
    acc = Accumulator(p_model, p_opt, scheduler=p_sched)
    assert acc.scheduler is sched
    for window in windows(300, 2):
        acc.step(window[RANK], mse)
    assert (acc.steps, sched.last_epoch) == (2, WORLD + 2), (acc.steps, sched.last_epoch)
    split = AcceleratedScheduler(sched, p_opt, split_batches=True)
    split.step()
    assert sched.last_epoch == WORLD + 3, sched.last_epoch
    return (f"prepared scheduler: {WORLD} scheduler steps per call (num_processes={WORLD}); through the "
            "Accumulator: 1 per optimizer step; split_batches=True: 1 per call")


def accelerate_dynamo_backend_is_compiled_ddp_and_exact():
    """Issue item 1: ``Accelerator(dynamo_backend=...)`` on several processes builds
    ``torch.compile(DDP(model))``. With 3 micro-batches on one rank and 2 on the other: exact."""
    from torch._dynamo.eval_frame import OptimizedModule

    torch._dynamo.reset()
    accelerator = _accelerator(dynamo_backend="eager")
    inner = model_fn()
    p_model, p_opt = accelerator.prepare(inner, make_opt(inner, "adamw"))
    assert isinstance(p_model, OptimizedModule) and isinstance(p_model._orig_mod, DDP), type(p_model)
    hook_fn, hook = counting_hook()
    p_model._orig_mod.register_comm_hook(None, hook_fn)
    acc = Accumulator(p_model, p_opt)
    assert isinstance(acc.sync, DDPSync), acc.sync
    plan = windows(400, 2)
    for window in plan:
        acc.step(window[RANK], mse)
    close(inner, reference(plan))
    assert hook.calls == 2, f"{hook.calls} all-reduces for 2 windows"
    return "torch.compile(DDP(model)) found through OptimizedModule, exact, 1 all-reduce per window"


def accelerate_prepared_window_sampler_is_refused_with_the_fix():
    """A library gap found here, now closed. A WindowSampler already gives each rank its share of every
    window; ``accelerator.prepare`` on 2 processes wraps it in a BatchSamplerShard that shards it again,
    so each rank sees every other micro-batch of its share (here 7 of the 20 items are never seen).
    ``acc.train`` then no longer sees the WindowSampler and asks for ``accum_steps``, which, given,
    trains on that data in silence. It should refuse the loader and say not to prepare it."""
    from torch.utils.data import DataLoader, TensorDataset

    from gradaccum import WindowSampler

    accelerator = _accelerator()
    dataset = TensorDataset(*data(0, 600, 20))
    sampler = WindowSampler(len(dataset), global_batch_size=8, micro_batch_size=3, shuffle=False)
    inner = model_fn()
    p_model, p_opt, p_loader = accelerator.prepare(inner, make_opt(inner, "sgd"),
                                                   DataLoader(dataset, batch_sampler=sampler))
    acc = Accumulator(p_model, p_opt)
    try:
        list(acc.train(p_loader, mse))
    except ValueError as e:
        assert "WindowSampler" in str(e) and "prepare" in str(e), str(e)
        return "refused, naming accelerator.prepare"
    raise AssertionError("a WindowSampler sharded again by Accelerate was accepted")


# --------------------------------------------------------------------------- ZeRO, transformers

def zero_redundancy_optimizer_uneven_counts():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = model_fn()
    model = DDP(inner)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    acc = Accumulator(model, opt)
    plan = windows(500, 2, {0: [4, 4, 3], 1: [5, 1]})
    for window in plan:
        acc.step(window[RANK], mse)
    close(inner, reference(plan, "adamw"))
    assert replicas_identical(inner)
    return "AdamW sharded over 2 ranks, 3 and 2 micro-batches per window: exact, replicas identical"


def hf_gpt2_ddp_uneven_data_train():
    """A transformers GPT-2 under DDP; rank 0 holds 5 windows of 2 padded micro-batches, rank 1 holds 4.
    ``acc.train`` steps 5 times on both ranks (rank 1 contributes no tokens to the 5th), with the token
    counts from ``loss_fn`` and, again, known up front (``num_items=count_targets``)."""
    from hf_helpers import gpt2, lm_loss, pad, reference_step, sequences, unpad

    def lengths(rank, k):
        g = torch.Generator().manual_seed(700 + 10 * rank + k)
        return torch.randint(2, 10, (1 + k % 3,), generator=g).tolist()

    # micro-batches of 1 to 3 sequences of 2 to 9 tokens, each padded to its longest
    loaders = [[pad(sequences(lengths(r, k), seed=800 + 10 * r + k)) for k in range(10 - 2 * r)]
               for r in range(WORLD)]
    notes = []
    for counted in (False, True):
        inner, ref = gpt2(), gpt2()
        model = DDP(inner)
        acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        results = list(acc.train(loaders[RANK], lm_loss, accum_steps=2,
                                 num_items=(lambda mb: count_targets(mb["labels"])) if counted else None))
        assert [r.step for r in results] == [1, 2, 3, 4, 5], [r.step for r in results]
        for w, result in enumerate(results):
            window = [s for r in range(WORLD) for mb in loaders[r][2 * w:2 * w + 2] for s in unpad(mb)]
            ref_loss = reference_step(ref, ref_opt, window)
            assert abs(result.loss - ref_loss) <= 1e-12 * ref_loss, (w, result.loss, ref_loss)
        assert replicas_identical(inner), "the replicas differ"
        close(inner, ref)
        notes.append(f"{'num_items' if counted else 'counts from loss_fn'}: 5 steps each, bit-identical, exact")
    return "; ".join(notes)


SCENARIOS = [ddp_over_compiled_eager_and_aot_eager, ddp_over_compiled_inductor,
             accelerate_prepared_exact_with_raw_scheduler, accelerate_prepared_scheduler_is_stepped_once_per_step,
             accelerate_dynamo_backend_is_compiled_ddp_and_exact,
             accelerate_prepared_window_sampler_is_refused_with_the_fix, zero_redundancy_optimizer_uneven_counts,
             hf_gpt2_ddp_uneven_data_train]


if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
