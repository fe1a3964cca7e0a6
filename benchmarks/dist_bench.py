"""Distributed benchmark (run by run.py under torchrun, 2 gloo processes): step time of a window with
one gradient reduction against reducing after every micro-batch, and the all-reduces per window."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1024, 1536), nn.ReLU(), nn.Linear(1536, 1536), nn.ReLU(), nn.Linear(1536, 10))
    params = sum(p.numel() for p in net.parameters())
    stats = {"calls": 0, "bytes": 0}

    def counting_allreduce_hook(state, bucket):
        stats["calls"] += 1
        stats["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(None, bucket)

    model = DDP(net)
    model.register_comm_hook(None, counting_allreduce_hook)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    x, y = torch.randn(8, 1024), torch.randint(0, 10, (8,))
    rows = []
    # the all-reduce of the whole gradient alone: the floor of one reduction
    flat = torch.zeros(params)
    ar = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        ar.append(time.perf_counter() - t0)
    for n in ((1, 4) if os.environ.get("BENCH_QUICK") == "1" else (1, 2, 4, 8)):
        window = [(x, y)] * n
        times = {}
        for mode in ("once", "every"):
            acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                              reduce_every_micro_batch=(mode == "every"))
            acc.step(window, loss_fn)  # warm-up
            samples = []
            for _ in range(5):
                stats.update(calls=0, bytes=0)
                dist.barrier()
                t0 = time.perf_counter()
                acc.step(window, loss_fn)
                samples.append(time.perf_counter() - t0)
            times[mode] = (statistics.median(samples), stats["calls"], stats["bytes"])
        rows.append({"N": n, "once_s": times["once"][0], "every_s": times["every"][0],
                     "once_allreduces": times["once"][1], "every_allreduces": times["every"][1],
                     "once_bytes": times["once"][2], "every_bytes": times["every"][2],
                     "speedup": times["every"][0] / times["once"][0]})
    if dist.get_rank() == 0:
        json.dump({"params": params, "allreduce_s": statistics.median(ar), "rows": rows}, sys.stdout)
        print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
