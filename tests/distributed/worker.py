"""Distributed scenarios, run by torchrun with 2 gloo processes on the CPU (see test_distributed.py).

Each scenario compares against a single-process float64 reference on the union of both ranks'
windows, computed on every rank from the same seed, and counts the gradient reductions. A scenario
prints ``PASS <name>`` on rank 0, or ``FAIL <name>: <why>`` and the run goes on.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: distributed.launch

from distributed.launch import run_guide_torchrun_blocks, run_modules  # noqa: E402
from gradaccum import Accumulator, ConfigurationError  # noqa: E402

RANK, WORLD = 0, 1
# each rank's window: micro-batch sizes (uneven shares: 11 items against 6)
SHARES = {0: [4, 4, 3], 1: [5, 1]}
# the same number of micro-batches per rank (uneven sizes), where every micro-batch communicates
EQUAL_COUNTS = {0: [4, 3], 1: [5, 1]}


def model_fn(unused_branch: bool = False, buffer: bool = False) -> nn.Module:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(5, 16)
            self.b = nn.Linear(16, 3)
            self.extra = nn.Linear(16, 3)  # used only by micro-batches flagged "extra"
            if buffer:  # DDP broadcasts buffers in forward: a collective in the first forward of a window
                self.register_buffer("scale", torch.full((3,), 2.0))

        def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            out = self.b(h) * self.scale if buffer else self.b(h)
            return out + self.extra(h) if extra else out

    net = Net().double()
    if not unused_branch:
        net.extra.requires_grad_(False)
    return net


def data(rank: int, k: int, n: int):
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)


def window_of(rank: int, offset: int = 0):
    return [data(rank, offset + k, n) for k, n in enumerate(SHARES[rank])]


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def reference(windows_per_step, opt_name: str = "adamw", unused_branch: bool = False, extra_of=None, model=None):
    """Single-process steps on the union of all ranks' windows (of ``model``, default model_fn())."""
    ref = model if model is not None else model_fn(unused_branch)
    opt = make_opt(ref, opt_name)
    for step_windows in windows_per_step:
        opt.zero_grad(set_to_none=True)
        items = sum(x.shape[0] for w in step_windows for x, _ in w)
        total = 0
        for r, w in enumerate(step_windows):
            for k, (x, y) in enumerate(w):
                extra = extra_of(r, k) if extra_of else False
                total = total + nn.functional.mse_loss(ref(x, extra), y, reduction="sum") / 3
        (total / items).backward()
        opt.step()
    return ref


def make_opt(model, name):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def close(a: nn.Module, b: nn.Module, rtol: float = 1e-10) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=1e-12, msg=lambda m: f"{name}: {m}")


class Counter:
    calls = 0
    bytes = 0


def counting_hook():
    """A DDP comm hook that counts bucket all-reduces and their bytes."""
    counter = Counter()

    def counting_allreduce_hook(state, bucket):
        counter.calls += 1
        counter.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(None, bucket)

    return counting_allreduce_hook, counter


class CountReduceScatters:
    """Counts torch.distributed reduce-scatter calls (FSDP2's gradient reduction) while active."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")

    def __enter__(self):
        self.calls = 0
        self._saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, fn in self._saved.items():
            setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def wrapper(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return wrapper

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


# --------------------------------------------------------------------------- scenarios

def ddp_uneven_exact():
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "adamw"))
    steps = [[window_of(r, 0) for r in range(WORLD)], [window_of(r, 10) for r in range(WORLD)]]
    for i in range(2):
        result = acc.step(steps[i][RANK], mse)
        assert result.num_items == 17, result.num_items  # global: 11 + 6
        assert result.micro_batches == len(SHARES[RANK])
    close(model.module, reference(steps))
    return "num_items global, params exact"


def ddp_loss_is_the_global_item_mean():
    model = DDP(model_fn())
    wins = [window_of(r, 70) for r in range(WORLD)]
    x = torch.cat([x for w in wins for x, _ in w])
    y = torch.cat([y for w in wins for _, y in w])
    expected = mse(model_fn(), (x, y)).item()
    result = Accumulator(model, make_opt(model, "sgd")).step(wins[RANK], mse)
    assert abs(result.loss - expected) <= 1e-12 * abs(expected), (result.loss, expected)
    return f"loss {result.loss:.6f} = the union's mean"


def ddp_one_reduction_per_window():
    model = DDP(model_fn(), bucket_cap_mb=25)
    hook_fn, hook = counting_hook()
    model.register_comm_hook(None, hook_fn)
    # baseline: one synchronised backward of the same model
    mse(model, data(RANK, 0, 4)).backward()
    per_backward = hook.calls
    model.zero_grad(set_to_none=True)
    hook.calls = 0
    acc = Accumulator(model, make_opt(model, "sgd"))
    win = [data(RANK, k, n) for k, n in enumerate(EQUAL_COUNTS[RANK])]
    seen_before_boundary = []
    with acc.window(len(win)) as w:
        for k, mb in enumerate(win):
            with w.micro_batch():
                w.backward(mse(model, mb), num_items=mb[0].shape[0])
            if k == 0:  # not reduced yet: the two ranks' gradients still differ
                g = model.module.a.weight.grad.detach().clone()
                other = [torch.zeros_like(g) for _ in range(WORLD)]
                dist.all_gather(other, g)
                seen_before_boundary.append(not torch.allclose(other[0], other[1]))
                seen_before_boundary.append(hook.calls)
        w.step()
    assert per_backward >= 1
    assert hook.calls == per_backward, f"{hook.calls} reductions in the window, {per_backward} in one backward"
    assert seen_before_boundary == [True, 0], seen_before_boundary
    return f"{hook.calls} all-reduce(s) per window = one synchronised backward; {hook.bytes} bytes"


def ddp_find_unused_parameters_exact():
    extra_of = lambda r, k: k == 0  # noqa: E731 - only the first micro-batch of each rank uses .extra
    model = DDP(model_fn(unused_branch=True), find_unused_parameters=True)
    acc = Accumulator(model, make_opt(model, "sgd"))
    steps = []
    for s in range(2):
        wins = [window_of(r, 20 * (s + 1)) for r in range(WORLD)]
        steps.append(wins)
        mine = [(x, y, k) for k, (x, y) in enumerate(wins[RANK])]
        acc.step(mine, lambda m, b: nn.functional.mse_loss(m(b[0], extra_of(RANK, b[2])), b[1]))
    close(model.module, reference(steps, "sgd", unused_branch=True, extra_of=extra_of))
    return "a parameter used by the first micro-batch only is reduced exactly"


def ddp_a_branch_unused_in_a_later_windows_last_micro_batch_is_refused_before_its_step():
    """A probe: without find_unused_parameters, a branch used in the first window's last micro-batch but only in
    the first micro-batch of the second (the run's last) left its bucket unreduced: the step went 0.40 of its move
    off one big batch and the replicas apart, and DDP said nothing, as no forward with gradients came after it.
    Refused on every rank (each skips the branch), before the step, from DDP's own check that its reducer finished."""
    from gradaccum import NotExactError

    model = DDP(model_fn(unused_branch=True))
    acc = Accumulator(model, make_opt(model, "sgd"))
    loss = lambda m, b: nn.functional.mse_loss(m(b[0], b[2]), b[1])  # noqa: E731 - b[2]: use .extra
    first = [(x, y, True) for x, y in window_of(RANK, 20)]
    acc.step(first, loss)
    second = [(x, y, k == 0) for k, (x, y) in enumerate(window_of(RANK, 40))]
    before = [p.detach().clone() for p in model.parameters()]
    try:
        acc.step(second, loss)
    except NotExactError as e:
        assert "find_unused_parameters=True" in str(e) and "No step was taken" in str(e), e
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and acc.steps == 1
        return "refused before the step, the parameters untouched"
    raise AssertionError("a bucket left unreduced was stepped on")


def ddp_static_graph_is_a_clear_error():
    model = DDP(model_fn(), static_graph=True)
    try:
        Accumulator(model, make_opt(model, "sgd"))
    except ValueError as e:
        assert "static_graph=True" in str(e) and "static_graph=False" in str(e), str(e)
        return "ValueError naming static_graph and the fix"
    raise AssertionError("no error for static_graph=True")


def ddp_reduce_every_micro_batch_exact():
    model = DDP(model_fn())
    hook_fn, hook = counting_hook()
    model.register_comm_hook(None, hook_fn)
    acc = Accumulator(model, make_opt(model, "adamw"), reduce_every_micro_batch=True)
    # every micro-batch communicates, so both ranks run the same number (uneven sizes: 7 vs 6)
    shares = EQUAL_COUNTS
    steps = [[[data(r, 30 + k, n) for k, n in enumerate(shares[r])] for r in range(WORLD)]]
    acc.step(steps[0][RANK], mse)
    close(model.module, reference(steps))
    assert hook.calls == 2, hook.calls
    return f"{hook.calls} reductions for 2 micro-batches, still exact"


def ddp_exception_restores_sync():
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))

    def boom(m, b):
        raise KeyError("boom")

    try:
        acc.step(window_of(RANK), boom)
    except KeyError:
        pass
    assert model.require_backward_grad_sync is True
    assert all(p.grad is None for p in model.parameters())
    steps = [[window_of(r, 40) for r in range(WORLD)]]
    acc.step(steps[0][RANK], mse)
    close(model.module, reference(steps, "sgd"))
    return "require_backward_grad_sync restored, next window exact"


def fsdp2_exact_and_one_reduce_scatter():
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for every in (False, True):
        model = model_fn()
        fully_shard(model.a, mesh=mesh)
        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        acc = Accumulator(model, make_opt(model, "adamw"), reduce_every_micro_batch=every)
        # FSDP2 all-gathers in every forward, so both ranks run the same number of micro-batches
        shares = EQUAL_COUNTS
        steps = [[[data(r, 50 + k, n) for k, n in enumerate(shares[r])] for r in range(WORLD)]]
        with CountReduceScatters() as comm:
            acc.step(steps[0][RANK], mse)
        rs = comm.calls
        close(model, reference(steps))
        assert model.a.weight.grad is None
        results[every] = rs
        # FSDP2 restores its sync flag: the next plain backward reduces again
    assert results[False] == 2, results  # one per sharded group (a, b) per window
    assert results[True] == 2 * 2, results  # once per micro-batch
    return f"exact; reduce-scatters per window: {results[False]} (skipping) vs {results[True]} (every micro-batch)"


def ddp_auto_micro_batch_agrees_on_oom():
    """Rank 1 runs out of memory above 2 items per micro-batch; both ranks back off together."""
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "adamw"))
    limit = 3 if RANK == 1 else 100  # rank 1 holds 6 items: 6 fails, 3 fits

    def loss_fn(m, b):
        if b[0].shape[0] > limit:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return mse(m, b)

    batches = [torch.cat([x for x, _ in window_of(r, 60)]) for r in range(WORLD)]
    ys = [torch.cat([y for _, y in window_of(r, 60)]) for r in range(WORLD)]
    result = acc.step((batches[RANK], ys[RANK]), loss_fn, micro_batch_size="auto")
    assert result.micro_batch_size == 3, result.micro_batch_size
    assert acc.auto_micro_batch_size == 3
    close(model.module, reference([[[(batches[r], ys[r])] for r in range(WORLD)]]))
    assert model.require_backward_grad_sync is True
    return "both ranks settled on 3 after rank 1 alone ran out of memory, exact"


# --------------------------------------------------------------------------- uneven data (#10)

def loader_of(rank: int, sizes, offset: int):
    """A rank's loader: micro-batches of the given sizes (a list stands in for a DataLoader)."""
    return [data(rank, offset + k, n) for k, n in enumerate(sizes)]


# rank 0 holds 5 windows of 2 micro-batches; rank 1 holds 3.5: its 4th window has 1 micro-batch,
# and it has nothing for the 5th
UNEVEN = {0: [3, 2, 4, 1, 2, 2, 3, 3, 1, 4], 1: [2, 2, 1, 3, 4, 4, 2]}


def windows_of(loaders, per_window: int):
    """Per step, every rank's window (possibly empty): the reference's view of the union."""
    steps = max(-(-len(rank_mbs) // per_window) for rank_mbs in loaders)
    return [[rank_mbs[w * per_window:(w + 1) * per_window] for rank_mbs in loaders] for w in range(steps)]


def params_equal_on_all_ranks(model: nn.Module) -> bool:
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], other) for other in every[1:])


def _train_uneven(model, opt_name: str, **acc_kwargs):
    loaders = [loader_of(r, UNEVEN[r], 100) for r in range(WORLD)]
    acc = Accumulator(model, make_opt(model, opt_name), **acc_kwargs)
    results = list(acc.train(loaders[RANK], mse, accum_steps=2))
    assert [r.step for r in results] == [1, 2, 3, 4, 5], [r.step for r in results]
    expected_items = [sum(x.shape[0] for w in step for x, _ in w) for step in windows_of(loaders, 2)]
    assert [r.num_items for r in results] == expected_items, ([r.num_items for r in results], expected_items)
    assert params_equal_on_all_ranks(model), "the replicas differ"
    return windows_of(loaders, 2), results


def ddp_train_uneven_windows():
    model = DDP(model_fn())
    steps, results = _train_uneven(model, "adamw")
    close(model.module, reference(steps))
    return f"5 steps on both ranks (rank 1's data ran out), items {[r.num_items for r in results]}, exact"


def ddp_every_micro_batch_uneven_windows():
    model = DDP(model_fn())
    steps, _ = _train_uneven(model, "sgd", reduce_every_micro_batch=True)
    close(model.module, reference(steps, "sgd"))
    return "reducing every micro-batch: rank 1 padded with zero-weight micro-batches, exact"


def fsdp2_train_uneven_windows():
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    model = model_fn()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    steps, _ = _train_uneven(model, "adamw")
    close(model, reference(steps))
    return "FSDP2: counts padded to the busiest rank, 5 steps each, exact"


def ddp_hand_written_window_with_no_data():
    """The hand-written loop's way: a rank without data opens acc.window(0, pad=True) and runs
    window.padding zero-weight micro-batches of any batch it has (DDP runs collectives in forward);
    without pad=True the same window is refused on both ranks. step([]) pads with set_padding's."""
    model = DDP(model_fn(buffer=True))
    acc = Accumulator(model, make_opt(model, "sgd"))
    wins = [window_of(0, 80), []]
    spare = data(1, 81, 2)
    try:
        acc.window(len(wins[RANK])).__enter__()
    except ValueError as e:
        assert "acc.window(n, pad=True)" in str(e) and "rank(s) [1]" in str(e), e
    else:
        raise AssertionError("a window with an empty rank and no padding was accepted")
    with acc.window(len(wins[RANK]), pad=True) as w:
        assert w.padding == (0 if RANK == 0 else 1), w.padding
        for x, y in wins[RANK]:
            with w.micro_batch():
                w.backward(mse(model, (x, y)), num_items=x.shape[0])
        for _ in range(w.padding):
            with w.micro_batch():
                w.backward_padding(mse(model, spare))
        result = w.step()
    assert result.num_items == 11 and result.step == 1 and result.micro_batches == len(wins[RANK]), result
    reference_model = model_fn(buffer=True)
    close(model.module, reference([wins], "sgd", model=reference_model))
    fresh = Accumulator(model, make_opt(model, "sgd"))
    fresh.set_padding(spare)
    again = fresh.step(wins[RANK], mse)  # step([]) on rank 1
    assert again.num_items == 11 and params_equal_on_all_ranks(model)
    return "refused without pad=True; with it (and set_padding for step([])): exact, no hang"


def ddp_a_rank_out_of_data_after_one_window_with_buffers():
    """Rank 1's data runs out after one window. After the first synchronised backward DDP rebuilds its
    buckets in the next forward, and a model with buffers broadcasts them in each window's first
    forward: both are collectives, so the rank without data must still run a forward (a zero-weight
    repeat of its last micro-batch). It used to skip it, and both ranks waited forever."""
    notes = []
    for sizes in ({0: [3, 2, 4, 1], 1: [2, 2]}, {0: [3, 2, 4, 1, 2, 2], 1: [1, 4]}):
        model = DDP(model_fn(buffer=True))
        loaders = [loader_of(r, sizes[r], 300) for r in range(WORLD)]
        acc = Accumulator(model, make_opt(model, "adamw"))
        results = list(acc.train(loaders[RANK], mse, accum_steps=2))
        steps = windows_of(loaders, 2)
        assert len(results) == len(steps) and params_equal_on_all_ranks(model)
        close(model.module, reference(steps, model=model_fn(buffer=True)))
        notes.append(f"{len(steps)} windows vs {len(sizes[1]) // 2}")
    return "exact, replicas identical: " + ", ".join(notes)


def ddp_a_fresh_rank_with_an_empty_first_share_needs_set_padding():
    """A fresh process (resumed, say) whose share of its first window is empty has no micro-batch to
    repeat: refused on both ranks alike, with the fix; with acc.set_padding it takes part."""
    model = DDP(model_fn(buffer=True))
    acc = Accumulator(model, make_opt(model, "sgd"))
    wins = [window_of(0, 90), []]
    try:
        acc.step(wins[RANK], mse)
    except ValueError as e:
        assert "acc.set_padding(micro_batch)" in str(e) and "rank(s) [1]" in str(e), e
    else:
        raise AssertionError("an empty first share without padding was accepted")
    if RANK == 1:
        acc.set_padding(data(1, 91, 3))
    acc.step(wins[RANK], mse)
    close(model.module, reference([wins], "sgd", model=model_fn(buffer=True)))
    return "refused alike on both ranks without it; exact with set_padding"


def ddp_empty_share_with_a_split_or_auto_size():
    """A rank whose share of a global window is empty (B < W, the short last window) passes an empty
    batch with micro_batch_size=M or "auto": it takes part with zero items, also in the OOM back-off."""
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "adamw"))
    x0, y0 = (torch.cat(t) for t in zip(*window_of(0, 85)))
    batches = [(x0, y0), (x0[:0], y0[:0])]
    acc.set_padding(data(RANK, 86, 2))  # rank 1 has no data yet: what it repeats with zero weight
    steps = [[[batches[0]], []]]
    result = acc.step(batches[RANK], mse, micro_batch_size=4)
    assert result.num_items == 11 and result.micro_batches == (3 if RANK == 0 else 0), result
    limit = 5  # rank 0 runs out of memory above 5 items; rank 1 has none and must follow its back-off

    def loss_fn(m, b):
        if b[0].shape[0] > limit:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return mse(m, b)

    result = acc.step(batches[RANK], loss_fn, micro_batch_size="auto")
    assert result.num_items == 11 and result.micro_batch_size == 5, result
    steps.append([[batches[0]], []])
    close(model.module, reference(steps))
    return "empty shares took part in a split step and in the auto back-off (11 -> 5), exact"


def fsdp2_hand_written_unequal_counts_is_one_error_on_every_rank():
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    model = model_fn()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    acc = Accumulator(model, make_opt(model, "sgd"))
    try:
        acc.window(len(SHARES[RANK])).__enter__()
    except ValueError as e:
        assert "as many micro-batches as the busiest" in str(e) and "acc.window(n, pad=True)" in str(e), e
        return "both ranks raised the same ValueError before any collective could wait"
    raise AssertionError("no error")


def fsdp2_a_parameter_in_no_fully_shard_is_refused_on_every_rank():
    """Submodules sharded, the root not: the last layer's parameters are plain tensors that no fully_shard
    reduces, and the replicas drifted apart (a probe: 0.79 off one big batch, no word; with max_grad_norm an
    error inside torch). Refused at the first window's boundary on every rank, before its step (the first
    window's replica check covers FSDP2's plain gradients too); with the root sharded, the same model is
    exact. A window loss's own parameter beside the sharded module is equal on every rank and passes
    (cached_worker.py's cached_fsdp2_exact)."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    steps = [[[data(r, 50 + 10 * s + k, n) for k, n in enumerate(EQUAL_COUNTS[r])] for r in range(WORLD)]
             for s in range(2)]
    model = model_fn()
    fully_shard(model.a, mesh=mesh)  # b in no fully_shard module
    before = [p.detach().clone() for p in model.b.parameters()]
    acc = Accumulator(model, make_opt(model, "sgd"))
    try:
        acc.step(steps[0][RANK], mse)
    except ConfigurationError as e:
        assert "in no fully_shard module differ" in str(e) and "fully_shard(model, mesh=mesh)" in str(e), e
    else:
        raise AssertionError("a parameter no fully_shard reduces was stepped")
    assert all(torch.equal(p, q) for p, q in zip(model.b.parameters(), before)), "a step was taken"
    model = model_fn()  # b frozen as the Accumulator is built (no gradient to reduce), unfrozen after a window
    fully_shard(model.a, mesh=mesh)
    model.b.requires_grad_(False)
    acc = Accumulator(model, make_opt(model, "sgd"))
    acc.step(steps[0][RANK], mse)
    model.b.requires_grad_(True)
    try:
        acc.step(steps[1][RANK], mse)
    except ConfigurationError as e:
        assert "in no fully_shard module differ" in str(e), e
    else:
        raise AssertionError("a parameter unfrozen outside fully_shard was stepped")
    model = model_fn()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    acc = Accumulator(model, make_opt(model, "sgd"))
    for s in range(2):
        acc.step(steps[s][RANK], mse)
    close(model, reference(steps, "sgd"))
    return ("refused at the first window on every rank, no step taken, and at the first after an unfreezing; "
            "exact once the root is sharded")


def compiled_ddp_exact_with_uneven_counts():
    """torch.compile(DDP(model)) is what Accelerate builds with dynamo_backend: it must reduce once per
    window and normalize by the global count, with 3 micro-batches on one rank and 2 on the other."""
    notes = []
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        ddp = DDP(model_fn())
        hook_fn, hook = counting_hook()
        ddp.register_comm_hook(None, hook_fn)
        per_backward = 1  # a model this small fits one bucket
        model = torch.compile(ddp, backend=backend)
        acc = Accumulator(model, make_opt(model, "adamw"))
        steps = [[window_of(r, 90 + 10 * s) for r in range(WORLD)] for s in range(2)]
        for s in range(2):
            result = acc.step(steps[s][RANK], mse)
            assert result.num_items == 17, result.num_items
        close(ddp.module, reference(steps))
        assert hook.calls == 2 * per_backward, f"{hook.calls} all-reduces for 2 windows"
        notes.append(f"{backend}: exact, {hook.calls} all-reduces / 2 windows")
    return "; ".join(notes)


def unwrapped_model_is_refused_and_per_rank_is_an_explicit_choice():
    model = model_fn()
    try:
        Accumulator(model, make_opt(model, "sgd"))
    except ValueError as e:
        assert "no DistributedDataParallel or fully_shard module" in str(e) and "data_parallel='none'" in str(e), e
    else:
        raise AssertionError("an unwrapped model was accepted under 2 ranks")
    acc = Accumulator(model, make_opt(model, "sgd"), data_parallel="none")
    result = acc.step(window_of(RANK, 95), mse)
    assert result.num_items == sum(SHARES[RANK]), result.num_items  # this rank's items only
    return "refused with the fix; data_parallel='none' steps each rank on its own items"


class CountCalls:
    """Counts, while active, the collectives issued from Python (``torch.distributed`` functions, and
    the functional collectives DTensor reduces with, e.g. an FSDP2 gradient norm; DDP's bucket
    all-reduces and FSDP2's own all-gathers and reduce-scatters are not counted) and the host
    synchronisations (``Tensor.item``, ``Tensor.tolist``, ``Tensor.cpu``). ``marks`` records the
    counts at chosen moments (e.g. each window's first forward)."""

    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
                   "all_gather_object", "broadcast_object_list", "barrier")
    FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "broadcast")
    SYNCS = ("item", "tolist", "cpu")

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol

        self.collectives = self.syncs = 0
        self.marks = []
        self._saved = [(dist, n, getattr(dist, n)) for n in self.COLLECTIVES if hasattr(dist, n)]
        self._saved += [(funcol, n, getattr(funcol, n)) for n in self.FUNCTIONAL if hasattr(funcol, n)]
        self._saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in self.SYNCS]
        for owner, name, fn in self._saved:
            setattr(owner, name, self._wrap(fn, "syncs" if owner is torch.Tensor else "collectives"))
        return self

    def _wrap(self, fn, field):
        def wrapper(*args, **kwargs):
            setattr(self, field, getattr(self, field) + 1)
            return fn(*args, **kwargs)
        return wrapper

    def mark(self):
        self.marks.append((self.collectives, self.syncs))

    def __exit__(self, *exc):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def _steady_counts(run_window, windows: int, warmup: int = 2):
    """Per-window (collectives, host syncs, syncs before the window's first forward) after ``warmup``."""
    for w in range(warmup):
        run_window(w, None)
    rows = []
    for w in range(warmup, warmup + windows):
        with CountCalls() as c:
            first = []
            run_window(w, lambda: first.append((c.collectives, c.syncs)) if not first else None)
        rows.append((c.collectives, c.syncs, first[0][1] if first else None, first[0][0] if first else None))
    return rows


def _train_counted(acc, loader, after=None, loss_fn=mse, **train):
    """``acc.train(loader, loss_fn, **train)``'s results, and per window the collectives and host syncs
    counted from the previous window's end to its own; ``after(results)`` runs after each window."""
    results = []
    with CountCalls() as c:
        for result in acc.train(loader, loss_fn, **train):
            c.mark()
            results.append(result)
            if after is not None:
                after(results)
    pairs = list(zip([(0, 0)] + c.marks, c.marks))
    return results, [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


def ddp_step_costs_one_small_collective_per_window():
    """acc.step with uneven counts across ranks and windows: besides DDP's buckets, one small all-reduce
    and one host sync per window, the boundary's: every backward weighs by the last window's N (R, the
    same on every rank) and the boundary rescales by R / N from the N its all-reduce brings; nothing
    before the first forward. Exact. (SGD: torch's single-tensor Adam reads its step counter with .item(),
    a sync the hand loop pays as well.)"""
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))
    steps = []

    def run(w, on_forward):
        wins = [[data(r, 40 + 4 * w + k, 4 + (w + r + k) % 3) for k in range(3)] for r in range(WORLD)]
        steps.append(wins)
        result = acc.step(wins[RANK], lambda m, b: (on_forward and on_forward(), mse(m, b))[1])
        assert result.num_items == sum(len(x) for win in wins for x, _ in win), result

    rows = _steady_counts(run, windows=4)
    assert all(r[0] == 1 and r[1] == 1 and r[2] == 0 and r[3] == 0 for r in rows), rows
    close(model.module, reference(steps, "sgd"))
    return f"(collectives, syncs, syncs before forward, collectives before forward) per window: {rows[0]}"


def ddp_step_with_a_loss_one_rank_finds_not_finite_costs_one_collective_per_window():
    """acc.step, uneven counts across ranks and windows: every window exchanges at its boundary, its one
    small collective. Exact, replicas bit-equal; a loss only rank 1 finds not finite is skipped on both
    ranks; a rank that opens a window without num_items weighs by the same R as the others."""
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))
    steps, results = [], []

    def run(w, on_forward):
        wins = [[data(r, 300 + 4 * w + k, 2 + (w + r + k) % 4) for k in range(3)] for r in range(WORLD)]
        bad = w == 7 and RANK == 1

        def loss_fn(m, b):
            if on_forward:
                on_forward()
            return mse(m, b) + (float("inf") if bad else 0.0)
        result = acc.step(wins[RANK], loss_fn)
        results.append(result)
        if w != 7:
            steps.append(wins)
        assert result.num_items == sum(len(x) for win in wins for x, _ in win), result

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = _steady_counts(run, windows=7)  # windows 2..8: acc's windows 2..8
    assert [r[0] for r in rows] == [1] * 7, rows
    assert [r[3] for r in rows] == [0] * 7, rows  # nothing before the first forward
    assert [r.skipped for r in results] == [w == 7 for w in range(9)], results
    run(9, None)
    # rank 1 opens window 10 without num_items: R is the last N on every rank all the same, and the
    # boundary's N rescales the gradient
    wins = [[data(r, 400 + k, 3 + r + k) for k in range(2)] for r in range(WORLD)]
    steps.append(wins)
    mine = wins[RANK]
    with acc.window(len(mine), num_items=sum(len(x) for x, _ in mine) if RANK == 0 else None, pad=True) as window:
        for mb in mine:
            with window.micro_batch():
                window.backward(mse(model, mb), len(mb[0]))
        late = window.step()
    assert late.num_items == sum(len(x) for win in wins for x, _ in win), late
    close(model.module, reference(steps, "sgd"))
    assert params_equal_on_all_ranks(model.module)
    return f"collectives per window {[r[0] for r in rows]}"


def ddp_step_with_a_rank_without_data_costs_the_same():
    """A window where rank 1 has no data: it repeats its last micro-batch with zero weight, decided
    alone (no agreement), and the step is exact on rank 0's items."""
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))
    steps = []

    def run(w, on_forward):
        wins = [[data(r, 60 + 4 * w + k, 3) for k in range(2)] for r in range(WORLD)]
        if w == 3:
            wins[1] = []
        steps.append(wins)
        result = acc.step(wins[RANK], lambda m, b: (on_forward and on_forward(), mse(m, b))[1])
        assert result.num_items == (6 if w == 3 else 12), result.num_items

    rows = _steady_counts(run, windows=2)
    assert all(r[0] == 1 and r[1] == 1 and r[2] == 0 for r in rows), rows
    close(model.module, reference(steps, "sgd"))
    assert params_equal_on_all_ranks(model.module)
    return f"the empty window: {rows[1]}"


def ddp_step_is_the_plain_loop_bit_for_bit_while_n_repeats():
    """float32, uneven counts across ranks and micro-batches: acc.step weighs every micro-batch by R, the
    window's own N in the first window (counted across ranks first) and the last window's N after it. While
    windows repeat their N (0-2), R = N and nothing is rescaled, so its parameters equal, bit for bit, those
    of a hand loop under DDP that backpropagates ``mean_k * n_k * W / N`` with N summed across ranks
    beforehand; a hand-written window given its num_items too. Window 3 holds another N: the boundary
    rescales by R / N, which rounds every gradient once more: equal to float32 rounding, not to the bit."""
    def float_model():
        return model_fn().float()

    def windows(w):
        sizes = [[2, 2, 2], [3, 4]] if w == 3 else [[2, 3, 4][w:] + [2, 3, 4][:w], [5, 6][w % 2:] + [5, 6][:w % 2]]
        return [[tuple(t.float() for t in data(r, 300 + 7 * w + k, n)) for k, n in enumerate(sizes[r])]
                for r in range(WORLD)]

    exact, plain, hand = DDP(float_model()), DDP(float_model()), DDP(float_model())
    acc = Accumulator(exact, make_opt(exact, "sgd"))
    acc_hand = Accumulator(hand, make_opt(hand, "sgd"))
    opt = make_opt(plain, "sgd")
    for w in range(4):
        mine = windows(w)[RANK]
        acc.step(mine, mse)
        with acc_hand.window(len(mine), num_items=sum(len(x) for x, _ in mine), pad=True) as window:
            for x, y in mine:
                with window.micro_batch():
                    window.backward(mse(hand, (x, y)), num_items=len(x))
            window.step()
        n = torch.tensor([float(sum(len(x) for x, _ in mine))], dtype=torch.float64)
        dist.all_reduce(n)
        opt.zero_grad(set_to_none=True)
        for k, (x, y) in enumerate(mine):
            ctx = plain.no_sync() if k < len(mine) - 1 else contextlib.nullcontext()
            with ctx:
                (mse(plain, (x, y)) * (len(x) * WORLD / n.item())).backward()
        opt.step()
        if w == 2:
            same = all(torch.equal(a, b) for a, b in zip(exact.parameters(), plain.parameters()))
            same = same and all(torch.equal(a, b) for a, b in zip(hand.parameters(), plain.parameters()))
            assert same, "windows repeating their N are not the plain loop bit for bit"
    rescaled = max((a - b).abs().max().item() for a, b in zip(exact.parameters(), plain.parameters()))
    assert 0 < rescaled < 1e-6, f"the rescaled window should round once more, within float32: {rescaled}"
    assert params_equal_on_all_ranks(exact)
    return f"bit-equal to the plain loop while N repeats; the rescaled window differs by {rescaled:.1e}"


def ddp_a_rank_without_num_items_weighs_as_the_others():
    """Hand-written windows with pad=True, where rank 1 gives no num_items in window 3: no window counts
    first (the first asks the ranks; the others weigh by the last window's N, the same on every rank,
    whatever a rank was given), so no rank can wait alone in a count, and the boundary rescales by the
    exchanged N. Exact, replicas bit-equal."""
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))
    steps, flags = [], []
    for w in range(6):
        wins = [[data(r, 700 + 5 * w + k, 2 + (w + r + k) % 3) for k in range(2 + r)] for r in range(WORLD)]
        steps.append(wins)
        mine = wins[RANK]
        count = None if (w == 3 and RANK == 1) else sum(len(x) for x, _ in mine)
        with acc.window(len(mine), num_items=count, pad=True) as window:
            for x, y in mine:
                with window.micro_batch():
                    window.backward(mse(model, (x, y)), num_items=len(x))
            counted = window.setup.counted is not None
            window.step()
        flags.append((counted, acc.state.counts_first))
    assert [f[0] for f in flags] == [False] * 6, flags
    close(model.module, reference(steps, "sgd"))
    assert params_equal_on_all_ranks(model.module)
    return f"(counted first, counts_first after) per window: {flags}"


def ddp_a_resumed_run_counting_first_is_the_uninterrupted_one():
    """float32 DDP, uneven windows, a loss_fn that counts its own items (a (mean, count) pair over the
    rows whose first target is above -0.5: not the rows counted up front, so R = N times the saved
    count ratio and the boundary rescales): stopped after 2 windows, restored into a fresh model,
    optimizer and Accumulator (whose first window asks the ranks, where the uninterrupted one plans alone:
    both weigh by the saved last window's N), the run ends bit-identical to the uninterrupted one on both
    ranks."""
    def windows(w):
        return [[tuple(t.float() for t in data(r, 500 + 7 * w + k, 3 + (2 * w + 3 * r + k) % 4))
                 for k in range(2 + (w + r) % 2)] for r in range(WORLD)]

    def loss_fn(m, b):
        x, y = b
        keep = y[:, 0] > -0.5
        rows = ((m(x) - y) ** 2).mean(dim=1)
        return (rows * keep).sum() / keep.sum().clamp(min=1), int(keep.sum())

    def fresh():
        model = DDP(model_fn().float())
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        return model, opt, Accumulator(model, opt)

    whole, whole_opt, whole_acc = fresh()
    for w in range(5):
        whole_acc.step(windows(w)[RANK], loss_fn)
    first, first_opt, first_acc = fresh()
    for w in range(2):
        first_acc.step(windows(w)[RANK], loss_fn)
    assert first_acc.state.count_ratio != 1.0, "the test must rescale: loss_fn counts other items"
    saved = copy.deepcopy((first.module.state_dict(), first_opt.state_dict(), first_acc.state_dict()))
    resumed, resumed_opt, resumed_acc = fresh()
    resumed.module.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    resumed_acc.load_state_dict(saved[2])
    for w in range(2, 5):
        resumed_acc.step(windows(w)[RANK], loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters())), "the resume differs"
    assert params_equal_on_all_ranks(resumed.module)
    return f"bit-identical after 3 resumed windows (count ratio {first_acc.state.count_ratio:.3f})"


def ddp_train_over_a_window_sampler_costs_one_collective_per_window():
    """acc.train over a WindowSampler: every rank knows every share, so no agreement at all, also in
    the first window and the short last one: one small all-reduce and one host sync per window, the
    boundary's, which also carries a stop request to every rank; the loss and the steps exact against
    the union of each global window, the replicas bit-equal."""
    from torch.utils.data import DataLoader, TensorDataset

    from gradaccum import WindowSampler

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(45, 5, generator=g, dtype=torch.float64), torch.randn(45, 3, generator=g, dtype=torch.float64)
    sampler = WindowSampler(45, global_batch_size=16, micro_batch_size=3, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))
    results, per_window, syncs = _train_counted(  # a stop request made on rank 0 in window 0 reaches both at window 1
        acc, loader, after=lambda done: acc.request_stop() if len(done) == 1 and RANK == 0 else None)
    # the first window also compares the replicas' gradients once (one more all-gather and sync)
    assert [r.num_items for r in results] == [16, 16, 13] and per_window == [2, 1, 1], (per_window, results)
    # the first window's extra .tolist() calls are the sampler cutting the epoch's order on the host
    assert syncs[1:] == [1, 1], syncs
    assert [r.stop_requested for r in results] == [False, True, False], results
    ref = model_fn()
    opt = make_opt(ref, "sgd")
    for w, result in enumerate(results):
        idx = sampler.window_items(w, epoch=0)
        opt.zero_grad(set_to_none=True)
        loss = mse(ref, (x[idx], y[idx]))
        loss.backward()
        opt.step()
        assert abs(result.loss - loss.item()) <= 1e-12 * abs(loss.item()), (w, result.loss, loss.item())
    close(model.module, ref)
    assert params_equal_on_all_ranks(model.module)
    return f"collectives per window {per_window}, host syncs {syncs}"


def ddp_a_bypassed_wrapper_is_refused_on_every_rank():
    """loss_fn runs ddp.module instead of the model it is given: DDP never reduces, and the first
    window raises on every rank (a gradient fingerprint compared once) before any step."""
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))
    before = [p.detach().clone() for p in model.parameters()]
    try:
        acc.step(window_of(RANK, 80), lambda m, b: mse(m.module, b))
    except ConfigurationError as e:
        assert "never reduced them" in str(e) and "ddp.module" in str(e), e
    else:
        raise AssertionError("a bypassed DDP stepped silently")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a step was taken"
    result = acc.step(window_of(RANK, 81), mse)  # the right loss_fn goes on, exactly
    assert result.step == 1 and params_equal_on_all_ranks(model.module)
    return "refused on both ranks, nothing moved"


def _sampler_loader(n: int, global_batch: int, micro: int):
    from torch.utils.data import DataLoader, TensorDataset

    from gradaccum import WindowSampler

    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)
    sampler = WindowSampler(n, global_batch_size=global_batch, micro_batch_size=micro, seed=1)
    return x, y, sampler, DataLoader(TensorDataset(x, y), batch_sampler=sampler)


def _sampler_reference(x, y, sampler, windows):
    """One float64 SGD step on each listed window of the sampler's epoch 0, as one big batch."""
    ref = model_fn()
    opt = make_opt(ref, "sgd")
    for w in windows:
        idx = sampler.window_items(w, epoch=0)
        opt.zero_grad(set_to_none=True)
        mse(ref, (x[idx], y[idx])).backward()
        opt.step()
    return ref


def ddp_a_loss_only_one_rank_finds_not_finite_stops_every_rank():
    """Over a WindowSampler, rank 1's loss is +inf (a constant: its gradient is finite), or nan with a
    zero gradient (every label ignored), in window 2: every rank skips it (the boundary's all-reduce
    brings every rank the loss sum), the replicas stay bit-equal and exact; with nonfinite="raise"
    every rank raises."""
    def lossy(bad_window, counts=None):
        seen = []

        def loss_fn(m, b):
            seen.append(1)
            window = (len(seen) - 1) // 2  # 2 micro-batches per rank per window
            loss = mse(m, b)
            if window != bad_window or RANK != 1:
                return loss
            if counts == "ignored":  # every label ignored: the mean is nan (0/0), the gradient exactly 0
                return nn.functional.cross_entropy(m(b[0]), torch.full((len(b[0]),), -100, dtype=torch.long))
            return loss + float("inf")
        return loss_fn

    for nonfinite, counts in (("skip", None), ("skip", "ignored"), ("raise", None), ("raise", "ignored")):
        x, y, sampler, loader = _sampler_loader(60, 12, 3)
        model = DDP(model_fn())
        acc = Accumulator(model, make_opt(model, "sgd"), nonfinite=nonfinite)
        results, raised = [], None
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                for result in acc.train(loader, lossy(2, counts)):
                    results.append(result)
        except FloatingPointError as e:
            raised = e
        if nonfinite == "raise":
            assert raised is not None and len(results) == 2, (results, raised)
            assert params_equal_on_all_ranks(model.module)
            continue
        assert raised is None and [r.skipped for r in results] == [False, False, True, False, False], results
        close(model.module, _sampler_reference(x, y, sampler, (0, 1, 3, 4)))
        assert params_equal_on_all_ranks(model.module)
    return "skipped on both ranks, raised on both ranks"


def _gathered_windows(recorded):
    """Every rank's recorded ``(window, x, y)`` micro-batches, joined per window (one big batch each)."""
    rows = [None] * WORLD
    dist.all_gather_object(rows, recorded)
    windows = {}
    for per_rank in rows:
        for w, x, y in per_rank:
            windows.setdefault(w, []).append((x, y))
    return [(torch.cat([x for x, _ in windows[w]]), torch.cat([y for _, y in windows[w]])) for w in sorted(windows)]


def _one_big_batch_steps(windows):
    ref = model_fn()
    opt = make_opt(ref, "sgd")
    for x, y in windows:
        opt.zero_grad(set_to_none=True)
        mse(ref, (x, y)).backward()
        opt.step()
    return ref


def ddp_counts_other_than_the_shares_are_summed_at_the_boundary():
    """Over a WindowSampler, where the items counted are not the sampler's shares: a loss_fn returning
    (mean, count) pairs, or a collate_fn dropping rows (on rank 1 only). Every window's boundary sums
    the real counts, one collective per window: exact against one big batch of the micro-batches
    really seen, replicas bit-equal."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.dataloader import default_collate

    from gradaccum import WindowSampler

    notes = []
    for case in ("pairs", "collate"):
        g = torch.Generator().manual_seed(21)
        x, y = torch.randn(60, 5, generator=g, dtype=torch.float64), torch.randn(60, 3, generator=g, dtype=torch.float64)
        drop_first = case == "collate" and RANK == 1

        def collate(items):
            xb, yb = default_collate(items)
            return (xb[1:], yb[1:]) if drop_first else (xb, yb)
        loader = DataLoader(TensorDataset(x, y), batch_sampler=WindowSampler(60, global_batch_size=12,
                                                                             micro_batch_size=3, seed=2),
                            collate_fn=collate)
        recorded, window = [], [0]

        def loss_fn(m, b):
            recorded.append((window[0], b[0], b[1]))
            return (mse(m, b), len(b[0])) if case == "pairs" else mse(m, b)
        model = DDP(model_fn())
        acc = Accumulator(model, make_opt(model, "sgd"))
        results, per_window, _ = _train_counted(acc, loader, after=lambda done: window.__setitem__(0, len(done)),
                                                loss_fn=loss_fn)
        assert per_window == [2, 1, 1, 1, 1] and not any(r.skipped for r in results), (case, per_window, results)
        close(model.module, _one_big_batch_steps(_gathered_windows(recorded)))
        assert params_equal_on_all_ranks(model.module)
        notes.append(f"{case} {per_window}")
    return "collectives per window: " + ", ".join(notes)


def ddp_train_over_a_distributed_sampler_asks_once_per_epoch():
    """acc.train over a DataLoader with a DistributedSampler: every rank holds as many batches, so the
    ranks confirm that once per epoch (one all-gather) and never agree per window. Each window weighs by
    the last window's N and exchanges its own at the boundary (rank 1's collate_fn drops a row from its
    batches), one collective, and the steps stay exact on the rows really seen. Two epochs, a short last
    window."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.dataloader import default_collate
    from torch.utils.data.distributed import DistributedSampler

    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(50, 5, generator=g, dtype=torch.float64), torch.randn(50, 3, generator=g, dtype=torch.float64)
    dataset = TensorDataset(x, y)

    def collate(items):  # rank 1 drops the first row of every batch that has more than one
        xb, yb = default_collate(items)
        return (xb[1:], yb[1:]) if RANK == 1 and len(xb) > 1 else (xb, yb)
    loader = DataLoader(dataset, batch_size=3, sampler=DistributedSampler(dataset, shuffle=True, seed=3),
                        collate_fn=collate)
    recorded, window = [], [0]

    def loss_fn(m, b):
        recorded.append((window[0], b[0], b[1]))
        return mse(m, b)
    model = DDP(model_fn())
    acc = Accumulator(model, make_opt(model, "sgd"))
    results, per_window, _ = _train_counted(acc, loader, after=lambda done: window.__setitem__(0, len(done)),
                                            loss_fn=loss_fn, accum_steps=3, epochs=2)
    # 25 items a rank: batches of 3, 3, ..., 1; rank 1 keeps 2, 2, ..., 1 of them
    assert [r.num_items for r in results] == [15, 15, 12] * 2 and not any(r.skipped for r in results), results
    # every window: the boundary's exchange; window 0: the epoch's check, the count first and the replica
    # check too; window 3: the next epoch's check too
    assert per_window == [4, 1, 1, 2, 1, 1], per_window
    close(model.module, _one_big_batch_steps(_gathered_windows(recorded)))
    assert params_equal_on_all_ranks(model.module)
    return f"collectives per window {per_window}"

def clipped_train_over_a_window_sampler_costs_one_collective_per_window():
    """Clipping under torchrun, over a WindowSampler, exact against float64 clip_grad_norm_ on the
    union of each global window. DDP: one all-reduce per window (the first also compares the
    replicas). FSDP2: the norm of the sharded gradient rides in that same all-reduce (each rank adds
    its shards' squared norm), so clipping costs no collective of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    notes = []
    for kind in ("ddp", "fsdp2"):
        x, y, sampler, loader = _sampler_loader(40, 12, 3)
        if kind == "ddp":
            model = DDP(model_fn())
        else:
            mesh = init_device_mesh("cpu", (WORLD,))
            model = model_fn()
            fully_shard(model.a, mesh=mesh)
            fully_shard(model.b, mesh=mesh)
            fully_shard(model, mesh=mesh)
        acc = Accumulator(model, make_opt(model, "sgd"), max_grad_norm=0.05)
        results, per_window, _ = _train_counted(acc, loader)
        expected = [2, 1, 1, 1] if kind == "ddp" else [1, 1, 1, 1]
        assert [r.num_items for r in results] == [12, 12, 12, 4] and per_window == expected, (kind, per_window)
        ref = model_fn()
        opt = make_opt(ref, "sgd")
        for w, result in enumerate(results):
            idx = sampler.window_items(w, epoch=0)
            opt.zero_grad(set_to_none=True)
            mse(ref, (x[idx], y[idx])).backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            assert abs(result.grad_norm - norm.item()) <= 1e-10 * norm.item(), (kind, w, result.grad_norm, norm)
            opt.step()
        assert all(r.grad_norm > 0.05 for r in results), "the test must clip"
        close(model if kind == "fsdp2" else model.module, ref)
        notes.append(f"{kind} {per_window}")
    return "collectives per window: " + ", ".join(notes)


def ddp_a_layer_unfrozen_after_wrapping_is_refused_on_every_rank():
    """DDP reduces the parameters that required grad when it wrapped the model: a layer unfrozen later is never
    reduced, and the replicas drift apart (0.042 after three windows). Refused at the next window on every
    rank, before anything changes; freezing it again is the state DDP was built for, and trains on."""
    model = DDP(model_fn())  # its `extra` branch frozen
    acc = Accumulator(model, make_opt(model, "sgd"))
    acc.step(window_of(RANK), mse)
    model.module.extra.requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        acc.step(window_of(RANK, 10), mse)
    except ConfigurationError as e:
        assert "wrap the model in DDP again" in str(e), e
    else:
        raise AssertionError("a layer unfrozen under DDP was trained without a word")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and acc.steps == 1
    model.module.extra.requires_grad_(False)
    acc.step(window_of(RANK, 10), mse)
    close(model.module, reference([[window_of(r) for r in range(WORLD)], [window_of(r, 10) for r in range(WORLD)]],
                                  "sgd"))
    return "refused on every rank, nothing changed; frozen again, exact"


def _masked_window(rank: int):
    """Rank 0: 3 micro-batches, the middle one of 0 items; rank 1: 2, the last (the reducing one) of 0."""
    masks = {0: [[1, 0, 1], [0, 0], [1, 1, 0, 1]], 1: [[1, 1, 0, 1], [0, 0, 0]]}[rank]
    return [data(rank, 40 + k, len(m)) + (torch.tensor(m, dtype=torch.float64),) for k, m in enumerate(masks)]


def _masked_mean(model, batch):
    x, y, m = batch
    return (((model(x) - y) ** 2).mean(1) * m).sum() / m.sum()  # nan over a micro-batch of 0 items


def _masked_big_batch(wins):
    """Two SGD steps on every rank's windows as one float64 batch (a micro-batch of 0 items adds none), and
    the joined mask."""
    ref = model_fn()
    opt = make_opt(ref, "sgd")
    x, y, m = (torch.cat([b[i] for w in wins for b in w]) for i in range(3))
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        _masked_mean(ref, (x, y, m)).backward()
        opt.step()
    return ref, m


def ddp_a_micro_batch_of_no_item_weighs_nothing():
    """A masked mean over a micro-batch of 0 items is nan, and its backward brings 0 / 0 = nan: on rank 0 in
    the middle of the window (its backward skipped), on rank 1 as the last micro-batch, whose backward
    reduces (its gradient replaced by 0 before DDP reduces it). Int counts and tensor counts, against the
    float64 big batch of both ranks' items; a stock DDP loop on the same data ends with nan weights."""
    wins = [_masked_window(r) for r in range(WORLD)]
    ref, m = _masked_big_batch(wins)
    notes = []
    for name, count in (("int", lambda b: int(b[2].sum())), ("tensor", lambda b: b[2].sum())):
        model = DDP(model_fn())
        acc = Accumulator(model, make_opt(model, "sgd"))
        for _ in range(2):
            result = acc.step(wins[RANK], _masked_mean, num_items=count)
            assert not result.skipped and result.num_items == int(m.sum()), result
        assert params_equal_on_all_ranks(model.module)
        close(model.module, ref)
        notes.append(name)
    stock = DDP(model_fn())  # the stock loop: each micro-batch's loss / k, DDP's no_sync before the last
    for k, batch in enumerate(wins[RANK]):
        with stock.no_sync() if k < len(wins[RANK]) - 1 else contextlib.nullcontext():
            (_masked_mean(stock, batch) / len(wins[RANK])).backward()
    assert not all(torch.isfinite(p.grad).all() for p in stock.parameters() if p.grad is not None), "no teeth"
    return f"exact ({', '.join(notes)} counts); the stock loop's gradient is nan"


def fsdp2_a_micro_batch_of_no_item_weighs_nothing():
    """FSDP2 (the same number of micro-batches on each rank): rank 0's first micro-batch holds no item (its
    backward skipped), rank 1's last, the reducing one, holds none: int and tensor counts, the big batch."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    masks = {0: [[0, 0], [1, 1, 0]], 1: [[1, 1, 0, 1], [0, 0, 0]]}
    wins = [[data(r, 40 + k, len(mk)) + (torch.tensor(mk, dtype=torch.float64),) for k, mk in enumerate(masks[r])]
            for r in range(WORLD)]
    ref, m = _masked_big_batch(wins)
    mesh = init_device_mesh("cpu", (WORLD,))
    for name, count in (("int", lambda b: int(b[2].sum())), ("tensor", lambda b: b[2].sum())):
        model = model_fn()
        fully_shard(model.a, mesh=mesh)
        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        acc = Accumulator(model, make_opt(model, "sgd"))
        for _ in range(2):
            result = acc.step(wins[RANK], _masked_mean, num_items=count)
            assert not result.skipped and result.num_items == int(m.sum()), (name, result)
        close(model, ref)
    return "exact (int, tensor counts)"


def torchrun_guide_runs_as_written():
    """docs/guides/torchrun.md's two scripts (DDP, FSDP2), as written, in this launch: 3 epochs of 1,000
    items in windows of 256 over the 2 ranks, 12 steps each, rank 0 printing them."""
    (_, ddp), (_, fsdp2) = run_guide_torchrun_blocks("torchrun.md")
    if RANK != 0:
        assert ddp == fsdp2 == "", (ddp, fsdp2)
        return "rank 1 printed nothing"
    items = [int(line.rsplit(" over ", 1)[1].split()[0]) for line in ddp.splitlines()]
    assert items == [256, 256, 256, 232] * 3, ddp
    assert fsdp2.startswith("12 steps, loss "), fsdp2
    return f"DDP: {len(items)} steps; FSDP2: {fsdp2.strip()}"


SCENARIOS = [ddp_uneven_exact, ddp_loss_is_the_global_item_mean, ddp_one_reduction_per_window, ddp_find_unused_parameters_exact,
             ddp_a_branch_unused_in_a_later_windows_last_micro_batch_is_refused_before_its_step,
             ddp_static_graph_is_a_clear_error, ddp_reduce_every_micro_batch_exact,
             ddp_exception_restores_sync, fsdp2_exact_and_one_reduce_scatter,
             ddp_auto_micro_batch_agrees_on_oom, ddp_train_uneven_windows, ddp_every_micro_batch_uneven_windows,
             fsdp2_train_uneven_windows, ddp_hand_written_window_with_no_data, ddp_empty_share_with_a_split_or_auto_size,
             ddp_a_rank_out_of_data_after_one_window_with_buffers,
             ddp_a_fresh_rank_with_an_empty_first_share_needs_set_padding,
             fsdp2_hand_written_unequal_counts_is_one_error_on_every_rank,
             fsdp2_a_parameter_in_no_fully_shard_is_refused_on_every_rank, compiled_ddp_exact_with_uneven_counts,
             unwrapped_model_is_refused_and_per_rank_is_an_explicit_choice,
             ddp_step_costs_one_small_collective_per_window, ddp_step_with_a_rank_without_data_costs_the_same,
             ddp_step_with_a_loss_one_rank_finds_not_finite_costs_one_collective_per_window,
             ddp_step_is_the_plain_loop_bit_for_bit_while_n_repeats, ddp_a_resumed_run_counting_first_is_the_uninterrupted_one,
             ddp_a_rank_without_num_items_weighs_as_the_others,
             ddp_train_over_a_window_sampler_costs_one_collective_per_window,
             ddp_a_bypassed_wrapper_is_refused_on_every_rank,
             ddp_a_loss_only_one_rank_finds_not_finite_stops_every_rank,
             ddp_counts_other_than_the_shares_are_summed_at_the_boundary,
             ddp_train_over_a_distributed_sampler_asks_once_per_epoch,
             clipped_train_over_a_window_sampler_costs_one_collective_per_window,
             ddp_a_micro_batch_of_no_item_weighs_nothing, fsdp2_a_micro_batch_of_no_item_weighs_nothing,
             ddp_a_layer_unfrozen_after_wrapping_is_refused_on_every_rank, torchrun_guide_runs_as_written]


if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
