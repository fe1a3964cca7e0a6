"""What a distributed window costs besides DDP's own gradient reduction (run under torchrun, 2 gloo
processes): the hand-written ``no_sync`` loop, ``acc.step``, ``acc.train`` over a WindowSampler and Accelerate's
``accumulate()``, side by side, the order rotated every repeat.

Per window it reports the collectives issued from Python (``torch.distributed`` functions wrapped
with a counter; DDP's bucket all-reduces run in C++ and are the same for every contender), the host
synchronisations (``Tensor.item/tolist/cpu``), the median time relative to the hand loop, and the
distance from one big batch (float64, largest parameter difference after one window), plus a paper
projection of the extra latency to W = 1024 ranks.

    torchrun --standalone --nproc_per_node=2 benchmarks/dist_window_cost.py   # prints one JSON line
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from common import Count
from gradaccum import Accumulator, WindowSampler

N, M = 4, 8                      # micro-batches per window, items per micro-batch (per rank)
QUICK = os.environ.get("BENCH_QUICK") == "1"
REPEATS = 3 if QUICK else 21     # rotated repeats; the median is reported
WINDOWS = 6 if QUICK else 24     # windows per timed sample (one epoch of the loaders)
LATENCY_US = 50.0                # stated per-collective latency of a small all-reduce on a cluster, per log2(W) hop


def net(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(dtype)


def loss_fn(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])




def data(rank: int, windows: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    n = windows * N * M
    return torch.randn(n, 784, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)


def hand_loop(model, opt, x, y):
    for w in range(len(x) // (N * M)):
        for k in range(N):
            sl = slice((w * N + k) * M, (w * N + k + 1) * M)
            ctx = model.no_sync() if k < N - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(model, (x[sl], y[sl])) / N).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def hand_loop_with_exchange(model, opt, x, y):
    """The floor of any design that learns the window's global item count: the hand loop plus one
    all-reduce of five numbers (loss sum, count, three flags), launched after the last forward so that
    it overlaps the last backward, and read on the host after it (acc.step's one collective and one sync)."""
    for w in range(len(x) // (N * M)):
        total, work = None, None
        for k in range(N):
            sl = slice((w * N + k) * M, (w * N + k + 1) * M)
            ctx = model.no_sync() if k < N - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model, (x[sl], y[sl]))
                part = loss.detach().to(torch.float64) * M
                total = part if total is None else total.add_(part)
                if k == N - 1:
                    numbers = torch.cat([total.reshape(1), total.new_tensor([N * M, 1.0, 0.0, 0.0])])
                    work = dist.all_reduce(numbers, async_op=True)
                (loss / N).backward()
        work.wait()
        numbers.tolist()
        opt.step()
        opt.zero_grad(set_to_none=True)


def hand_loader_loop(model, opt, loader):
    """The hand loop over a DataLoader with a DistributedSampler: acc.train's fair baseline."""
    for k, mb in enumerate(loader):
        last = (k + 1) % N == 0
        with (contextlib.nullcontext() if last else model.no_sync()):
            (loss_fn(model, mb) / N).backward()
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)


def gradaccum_step(model, opt, x, y, acc):
    for w in range(len(x) // (N * M)):
        mbs = [(x[(w * N + k) * M:(w * N + k + 1) * M], y[(w * N + k) * M:(w * N + k + 1) * M]) for k in range(N)]
        acc.step(mbs, loss_fn)


def sharded(dtype=torch.float32) -> nn.Module:
    """The same MLP under FSDP2: each Linear sharded, then the root."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
    model = net(dtype)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def fsdp2_hand_loop(model, opt, x, y):
    """The hand loop FSDP2 users write: no gradient sync until the last micro-batch, ``loss / N``."""
    for w in range(len(x) // (N * M)):
        for k in range(N):
            sl = slice((w * N + k) * M, (w * N + k + 1) * M)
            model.set_requires_gradient_sync(k == N - 1)
            (loss_fn(model, (x[sl], y[sl])) / N).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def fsdp2_contenders(x, y, loader) -> dict:
    """FSDP2: the set_requires_gradient_sync(False) hand loop, acc.step, and acc.train over the
    WindowSampler ``loader`` (every rank knows every share: no agreement), each on its own model."""
    hand = sharded()
    hand_opt = torch.optim.SGD(hand.parameters(), lr=1e-3)
    mine = sharded()
    acc = Accumulator(mine, torch.optim.SGD(mine.parameters(), lr=1e-3))
    trained = sharded()
    acc_t = Accumulator(trained, torch.optim.SGD(trained.parameters(), lr=1e-3))
    return {"FSDP2 hand loop (set_requires_gradient_sync)": lambda: fsdp2_hand_loop(hand, hand_opt, x, y),
            "FSDP2 gradaccum acc.step": lambda: gradaccum_step(mine, None, x, y, acc),
            "FSDP2 gradaccum acc.train (WindowSampler)": lambda: gradaccum_train(acc_t, loader)}


def gradaccum_train(acc, loader):
    for _ in acc.train(loader, loss_fn):
        pass


def gradaccum_train_loader(acc, loader):
    """acc.train over the hand loop's own DataLoader (a DistributedSampler), N micro-batches a window."""
    for _ in acc.train(loader, loss_fn, accum_steps=N):
        pass


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data(rank, WINDOWS)
    # the WindowSampler's dataset: every rank holds the union, the sampler hands each its share
    xs, ys = zip(*(data(r, WINDOWS) for r in range(world)))
    ux, uy = torch.cat(xs), torch.cat(ys)
    contenders = {}

    model_h = DDP(net())
    opt_h = torch.optim.SGD(model_h.parameters(), lr=1e-3)
    contenders["hand no_sync loop"] = lambda: hand_loop(model_h, opt_h, x, y)
    model_s = DDP(net())
    acc_s = Accumulator(model_s, torch.optim.SGD(model_s.parameters(), lr=1e-3))
    contenders["gradaccum acc.step"] = lambda: gradaccum_step(model_s, None, x, y, acc_s)
    model_x = DDP(net())
    opt_x = torch.optim.SGD(model_x.parameters(), lr=1e-3)
    contenders["hand no_sync loop + one async all-reduce (the floor)"] = lambda: hand_loop_with_exchange(model_x, opt_x, x, y)
    model_t = DDP(net())
    acc_t = Accumulator(model_t, torch.optim.SGD(model_t.parameters(), lr=1e-3))
    sampler = WindowSampler(len(ux), global_batch_size=N * M * world, micro_batch_size=M, shuffle=False)
    loader = DataLoader(TensorDataset(ux, uy), batch_sampler=sampler)
    model_l = DDP(net())
    opt_l = torch.optim.SGD(model_l.parameters(), lr=1e-3)
    from torch.utils.data.distributed import DistributedSampler

    union = TensorDataset(ux, uy)
    hand_loader = DataLoader(union, batch_size=M, sampler=DistributedSampler(union, shuffle=False))
    contenders["hand no_sync loop over a DataLoader"] = lambda: hand_loader_loop(model_l, opt_l, hand_loader)
    contenders["gradaccum acc.train (WindowSampler)"] = lambda: gradaccum_train(acc_t, loader)
    model_d = DDP(net())
    acc_d = Accumulator(model_d, torch.optim.SGD(model_d.parameters(), lr=1e-3))
    contenders["gradaccum acc.train (the same DataLoader)"] = lambda: gradaccum_train_loader(acc_d, hand_loader)
    accelerator = None
    try:
        from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=N, cpu=True)
        model_a = accelerator.prepare(net())
        opt_a = accelerator.prepare(torch.optim.SGD(model_a.parameters(), lr=1e-3))

        def accelerate_loop():
            for w in range(WINDOWS):
                for k in range(N):
                    sl = slice((w * N + k) * M, (w * N + k + 1) * M)
                    with accelerator.accumulate(model_a):
                        accelerator.backward(loss_fn(model_a, (x[sl], y[sl])))
                        opt_a.step()
                        opt_a.zero_grad()
        contenders["Accelerate accumulate()"] = accelerate_loop
    except Exception as e:  # noqa: BLE001 - Accelerate is optional here
        print(f"# Accelerate skipped: {type(e).__name__}: {e}", file=sys.stderr)
    contenders.update(fsdp2_contenders(x, y, loader))

    for fn in contenders.values():  # warm-up (first windows: buckets, replica check, agreement)
        fn()
    times = {name: [] for name in contenders}
    counts = {}
    names = list(contenders)
    for r in range(REPEATS):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            with Count() as c:
                t0 = time.perf_counter()
                contenders[name]()
                times[name].append((time.perf_counter() - t0) / WINDOWS)
            counts[name] = (c.collectives / WINDOWS, c.syncs / WINDOWS)
    distance = distances(rank, world, accelerator if "Accelerate accumulate()" in contenders else None)
    if rank == 0:
        def baseline(name: str) -> str:
            if name.startswith("FSDP2"):
                return "FSDP2 hand loop (set_requires_gradient_sync)"
            return "hand no_sync loop over a DataLoader" if "train" in name or "DataLoader" in name else "hand no_sync loop"

        def ratios(name: str) -> list:
            """Paired: each repeat's time over its baseline's in the same repeat (the two ran
            minutes apart at most, so a slow spell of the machine hits both)."""
            return sorted(t / b for t, b in zip(times[name], times[baseline(name)]))

        rows = [{"contender": name, "collectives": counts[name][0], "host_syncs": counts[name][1],
                 "time_ratio": statistics.median(ratios(name)),
                 "ratio_q1": ratios(name)[len(ratios(name)) // 4], "ratio_q3": ratios(name)[(3 * len(ratios(name))) // 4],
                 "window_ms": 1e3 * statistics.median(times[name]),
                 "distance": distance.get(name),
                 "extra_latency_us_at_1024": counts[name][0] * LATENCY_US * math.log2(1024)} for name in names]
        print(json.dumps({"N": N, "micro_batch": M, "repeats": REPEATS, "windows": WINDOWS,
                          "latency_us_per_hop": LATENCY_US, "torch": torch.__version__, "rows": rows}))
    dist.destroy_process_group()


def distances(rank: int, world: int, accelerator=None) -> dict:
    """Largest parameter difference after one window from one float64 step on the union of windows."""
    xs, ys = zip(*(data(r, 1, torch.float64) for r in range(world)))
    ux, uy = torch.cat(xs), torch.cat(ys)
    ref = net(torch.float64)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn(ref, (ux, uy)).backward()
    opt.step()

    def gap(model: nn.Module) -> float:
        return max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))

    x, y = xs[rank], ys[rank]
    out = {}
    model = DDP(net(torch.float64))
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    hand_loop(model, o, x, y)
    out["hand no_sync loop"] = gap(model.module)
    model = DDP(net(torch.float64))
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    hand_loop_with_exchange(model, o, x, y)
    out["hand no_sync loop + one async all-reduce (the floor)"] = gap(model.module)
    model = DDP(net(torch.float64))
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    gradaccum_step(model, o, x, y, Accumulator(model, o))
    out["gradaccum acc.step"] = gap(model.module)
    model = DDP(net(torch.float64))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sampler = WindowSampler(len(ux), global_batch_size=N * M * world, micro_batch_size=M, shuffle=False)
    gradaccum_train(acc, DataLoader(TensorDataset(ux, uy), batch_sampler=sampler))
    out["gradaccum acc.train (WindowSampler)"] = gap(model.module)
    from torch.utils.data.distributed import DistributedSampler

    model = DDP(net(torch.float64))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    dataset = TensorDataset(ux, uy)
    gradaccum_train_loader(acc, DataLoader(dataset, batch_size=M, sampler=DistributedSampler(dataset, shuffle=False)))
    out["gradaccum acc.train (the same DataLoader)"] = gap(model.module)
    if accelerator is not None:
        model_a = accelerator.prepare(net(torch.float64))
        opt_a = accelerator.prepare(torch.optim.SGD(model_a.parameters(), lr=0.1))
        for k in range(N):
            with accelerator.accumulate(model_a):
                accelerator.backward(loss_fn(model_a, (x[k * M:(k + 1) * M], y[k * M:(k + 1) * M])))
                opt_a.step()
                opt_a.zero_grad()
        out["Accelerate accumulate()"] = gap(accelerator.unwrap_model(model_a))
    return out


if __name__ == "__main__":
    main()
