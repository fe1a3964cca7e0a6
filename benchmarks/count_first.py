"""Where a window across ranks learns its N: counted first, or at its boundary (run under torchrun, 2 gloo
processes; #37 item 3, #48 item 4).

Windows of uneven micro-batches, uneven across ranks and from window to window (so that no earlier
count is this window's N: the boundary always rescales). Three ways to weigh them, each on its own DDP model:

- ``acc.step``: every backward weighs ``n_k W / R`` with R the last window's N (the same on every rank),
  and the boundary's one small all-reduce brings N: the reduced gradient is rescaled by ``R / N`` before
  the step, one more rounding of every gradient element (none where windows repeat their N);
- the same written by hand (R the previous window's N, the boundary's count all-reduced after the last
  backward, the rescale): the floor of that design;
- the hand loop that counts first itself (torchtitan's ``train_step``): N all-reduced before the first
  backward, then ``(mean_k * n_k * W / N).backward()``, no rescale; gradaccum does this in the first
  window only (and under DeepSpeed, where the gradient sits in the engine's partitions).

Reported: per window the collectives issued from Python and the host syncs, the median time relative
to the hand loop with the previous N in the same repeat (order rotated every repeat), and the relative L2
distance of the window's gradient (as the optimizer receives it) from the float64 big batch on the union
of the ranks' windows, for float32 and bf16 parameters (bf16: DDP sums the window in the parameters' dtype).

    torchrun --standalone --nproc_per_node=2 benchmarks/count_first.py   # prints one JSON line
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import warnings
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import Count
from gradaccum import Accumulator

QUICK = os.environ.get("BENCH_QUICK") == "1"
K = 4                              # micro-batches per window on rank 0 (rank 1: K - 1)
REPEATS = 3 if QUICK else 15       # rotated repeats; the median is reported
WINDOWS = 4 if QUICK else 16       # windows per timed sample
ACCURACY_WINDOWS = 4 if QUICK else 16
Batch = Tuple[torch.Tensor, torch.Tensor]


def net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(dtype)


def loss_fn(m: nn.Module, b: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(m(b[0]), b[1])


def window(rank: int, w: int, dtype: torch.dtype) -> List[Batch]:
    """Rank ``rank``'s micro-batches of window ``w``: K - rank of them, 3 to 17 items each."""
    out = []
    for k in range(K - rank):
        g = torch.Generator().manual_seed(10_000 * rank + 100 * w + k)
        n = 3 + (5 * w + 7 * k + 11 * rank) % 15
        out.append((torch.randn(n, 784, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)))
    return out


class Recorder(torch.optim.SGD):
    """An SGD that records the gradient it is handed (after the boundary's scale) instead of stepping,
    so that every window starts from the same parameters."""

    def __init__(self, params) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, lr=0.0)
        self.grads: List[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        self.grads = [p.grad.detach().to(torch.float64).clone() for g in self.param_groups for p in g["params"]]


def gradaccum_step(acc: Accumulator, mbs: List[Batch]) -> None:
    acc.step(mbs, loss_fn)


def hand_counted_first(model: DDP, opt: torch.optim.Optimizer, mbs: List[Batch]) -> None:
    n = torch.tensor([float(sum(len(x) for x, _ in mbs))], dtype=torch.float64)
    dist.all_reduce(n)
    scale = dist.get_world_size() / n.item()
    for k, (x, y) in enumerate(mbs):
        with model.no_sync() if k < len(mbs) - 1 else contextlib.nullcontext():
            (loss_fn(model, (x, y)) * (len(x) * scale)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hand_previous_reference(model: DDP, opt: torch.optim.Optimizer, mbs: List[Batch], previous: List[float]) -> None:
    """What ``acc.step`` across ranks does, by hand: R the previous window's N (learned from the
    boundary's all-reduce, here summed after the last backward), the gradient rescaled by ``R / N``
    before the step (the first window counts first)."""
    mine = float(sum(len(x) for x, _ in mbs))
    if not previous:
        first = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(first)
        previous.append(first.item())
    r = previous[-1]
    for k, (x, y) in enumerate(mbs):
        with model.no_sync() if k < len(mbs) - 1 else contextlib.nullcontext():
            (loss_fn(model, (x, y)) * (len(x) * dist.get_world_size() / r)).backward()
    n = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(n)
    scale = r / n.item()
    if scale != 1.0:
        torch._foreach_mul_([p.grad for p in model.parameters()], scale)
    previous.append(n.item())
    opt.step()
    opt.zero_grad(set_to_none=True)




NAMES = ("acc.step (R the last window's N, rescaled)", "hand loop counting first",
         "hand loop, R the previous window's N, rescaled (the floor)")
BASELINE = NAMES[2]


def timing(rank: int) -> Dict[str, dict]:
    runs = {}
    for name in NAMES:
        model = DDP(net(torch.float32))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if name == NAMES[1]:
            runs[name] = lambda mbs, model=model, opt=opt: hand_counted_first(model, opt, mbs)
        elif name == NAMES[2]:
            runs[name] = lambda mbs, model=model, opt=opt, seen=[]: hand_previous_reference(model, opt, mbs, seen)
        else:
            runs[name] = lambda mbs, acc=Accumulator(model, opt): gradaccum_step(acc, mbs)
    windows = [window(rank, w, torch.float32) for w in range(WINDOWS)]
    for run in runs.values():  # warm-up: the buckets, the replica check, R fixed once
        for mbs in windows[:2]:
            run(mbs)
    times: Dict[str, List[float]] = {name: [] for name in NAMES}
    counts: Dict[str, Tuple[float, float]] = {}
    for r in range(REPEATS):
        for name in NAMES[r % len(NAMES):] + NAMES[:r % len(NAMES)]:
            dist.barrier()
            with Count() as c:
                t0 = time.perf_counter()
                for mbs in windows:
                    runs[name](mbs)
                times[name].append((time.perf_counter() - t0) / WINDOWS)
            counts[name] = (c.collectives / WINDOWS, c.syncs / WINDOWS)
    out = {}
    for name in NAMES:
        ratios = sorted(t / b for t, b in zip(times[name], times[BASELINE]))
        out[name] = {"collectives": counts[name][0], "host_syncs": counts[name][1],
                     "window_ms": 1e3 * statistics.median(times[name]), "time_ratio": statistics.median(ratios),
                     "ratio_q1": ratios[len(ratios) // 4], "ratio_q3": ratios[(3 * len(ratios)) // 4]}
    return out


def accuracy(rank: int, world: int, dtype: torch.dtype) -> Dict[str, float]:
    """Mean over windows of ||g - g64|| / ||g64||, g the gradient the optimizer receives."""
    runs = {}
    for name in NAMES:
        model = DDP(net(dtype))
        opt = Recorder(model.parameters())
        if name == NAMES[1]:
            runs[name] = (opt, lambda mbs, model=model, opt=opt: hand_counted_first(model, opt, mbs))
        elif name == NAMES[2]:
            runs[name] = (opt, lambda mbs, model=model, opt=opt, seen=[]: hand_previous_reference(model, opt, mbs, seen))
        else:
            runs[name] = (opt, lambda mbs, acc=Accumulator(model, opt): gradaccum_step(acc, mbs))
    ref = net(torch.float64)
    errors: Dict[str, List[float]] = {name: [] for name in NAMES}
    for w in range(ACCURACY_WINDOWS):
        union = [mb for r in range(world) for mb in window(r, w, torch.float64)]
        ref.zero_grad(set_to_none=True)
        loss_fn(ref, (torch.cat([x for x, _ in union]), torch.cat([y for _, y in union]))).backward()
        exact = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        mine = window(rank, w, dtype)
        for name, (opt, run) in runs.items():
            run(mine)
            got = torch.cat([g.reshape(-1) for g in opt.grads])
            errors[name].append(((got - exact).norm() / exact.norm()).item())
    return {name: statistics.fmean(e) for name, e in errors.items()}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 under DDP: the LowPrecisionWarning, said and measured here
        rel = {"float32": accuracy(rank, world, torch.float32), "bfloat16": accuracy(rank, world, torch.bfloat16)}
    cost = timing(rank)
    if rank == 0:
        rows = [dict(contender=name, **cost[name], rel_l2_float32=rel["float32"][name],
                     rel_l2_bfloat16=rel["bfloat16"][name]) for name in NAMES]
        print(json.dumps({"micro_batches": [K, K - 1], "repeats": REPEATS, "windows": WINDOWS,
                          "accuracy_windows": ACCURACY_WINDOWS, "baseline": BASELINE, "torch": torch.__version__,
                          "rows": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
