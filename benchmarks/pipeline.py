"""Pipeline section (#49): a torch.distributed.pipelining schedule stepped by gradaccum.PipelineWindow against
the stock schedule on the same stages (2 gloo processes, float32 MLP in 2 stages, 4 micro-batches of padded
tokens), per schedule: the time per window (median of interleaved repeats; the ratio gradaccum / stock) and
the collectives gradaccum adds per window (counted). ``python benchmarks/pipeline.py`` under torchrun is the
worker; :func:`pipeline` launches it."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Optional

from common import QUICK, ROOT, torchrun

D, H, V, SEQ, ROWS, K = 64, 256, 512, 64, 4, 4


def pipeline() -> Optional[dict]:
    """{schedule: {stock_s, gradaccum_s, ratio}, "collectives_per_window": n} from one torchrun launch."""
    proc = torchrun(ROOT / "benchmarks" / "pipeline.py")
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(lines[-1])


def _worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import gradaccum.pipeline as gp
    from gradaccum import PipelineWindow

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reps = 3 if QUICK else 15
    calls = []
    counted = gp.all_reduce_
    gp.all_reduce_ = lambda t, *a, **k: (calls.append(1), counted(t, *a, **k))[1]

    def loss_sum(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")

    def loss_mean(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(K * ROWS, SEQ, D, generator=g)
    y = torch.randint(0, V, (K * ROWS, SEQ), generator=g)
    y[torch.rand(K * ROWS, SEQ, generator=g) < 0.4] = -100
    out = {}
    for cls in (ScheduleGPipe, Schedule1F1B):
        routes = {}
        for route in ("stock", "gradaccum"):
            torch.manual_seed(0)
            full = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, V))
            module = full[:2] if rank == 0 else full[2:]
            stage = PipelineStage(module, rank, 2, torch.device("cpu"))
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)
            pipe = PipelineWindow(stage, opt, loss_sum, n_microbatches=K, reduction="sum", max_grad_norm=1.0) \
                if route == "gradaccum" else None
            schedule = cls(stage, n_microbatches=K, loss_fn=pipe.loss if pipe else loss_mean, scale_grads=pipe is None)
            routes[route] = (stage, schedule, opt, pipe)

        def window(route):
            stage, schedule, opt, pipe = routes[route]
            args, target = ((x,) if stage.is_first else ()), (y if stage.is_last else None)
            dist.barrier()
            t0 = time.perf_counter()
            if pipe is not None:
                pipe.step(schedule, *args, target=target)
            else:
                schedule.step(*args, target=target, return_outputs=False)
                torch.nn.utils.clip_grad_norm_(stage.submod.parameters(), 1.0)  # the stock loop clips too (locally)
                opt.step()
                opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        window("stock"), window("gradaccum")  # warm-up: shape inference
        calls.clear()
        times = {"stock": [], "gradaccum": []}
        for _ in range(reps):
            for route in ("stock", "gradaccum"):
                times[route].append(window(route))
        stock, exact = statistics.median(times["stock"]), statistics.median(times["gradaccum"])
        out[cls.__name__] = {"stock_s": stock, "gradaccum_s": exact, "ratio": exact / stock}
        out["collectives_per_window"] = len(calls) / reps
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and "RANK" in os.environ:
    _worker()
elif __name__ == "__main__":
    print(json.dumps(pipeline(), indent=1))
