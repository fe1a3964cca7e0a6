"""gradaccum.PipelineWindow with data parallelism under torchrun, 4 gloo processes on the CPU (#49; see
test_pipeline_dp.py): 2 pipeline stages x 2 replicas on a device mesh ("dp", "pp"), each stage's module
in fully_shard over its replica group (DistributedDataParallel refused), the replicas' windows holding uneven
target tokens (57 and 43, then a short window of 22 and 10). Against one float64 big batch on the
unsplit model over both replicas' windows; the stock schedule measured beside it (pipeline_worker.py).
"""
from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: distributed.launch

from distributed.launch import WORKER_FOOTER, WORKER_HEADER, finish_worker, run_each  # noqa: E402
from distributed.pipeline_worker import WINDOWS, build, exact_route, model, token_sum  # noqa: E402

REPLICAS = (WINDOWS, [[1, 30, 0, 12], [8, 2]])   # each replica's target tokens per micro-batch, per window
MESH = None


def fsdp2_1f1b_uneven_items_across_replicas():
    """fully_shard over each stage's replica group: N summed over the replicas, W = 2, full norms."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import Schedule1F1B

    dp, pp = MESH["dp"], MESH["pp"]
    return exact_route(Schedule1F1B, "single", windows=REPLICAS, replica=dp.get_local_rank(), pp_group=pp.get_group(),
                       dp_group=dp.get_group(), wrap=lambda module: fully_shard(module, mesh=dp))


def ddp_stage_is_refused_with_the_fix():
    """DistributedDataParallel under a PipelineStage fails in DDP's reducer (torch 2.13): refused, naming fully_shard."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum import NotExactError, PipelineWindow

    dp, pp = MESH["dp"], MESH["pp"]
    full = model()
    stages, _ = build(full, "single", pp.get_group(), lambda m: DistributedDataParallel(m, process_group=dp.get_group()))
    try:
        PipelineWindow(stages, torch.optim.SGD(full.parameters(), lr=0.1), token_sum, n_microbatches=4, reduction="sum",
                       pp_group=pp.get_group(), dp_group=dp.get_group())
    except NotExactError as e:
        assert "fully_shard(module, mesh=mesh['dp'])" in str(e), e
        return "refused"
    raise AssertionError("DDP stage not refused")


def a_pp_group_left_to_the_world_beside_dp_group_is_refused():
    """A probe left pp_group to its default, the world, beside dp_group: every window's items and norm were
    summed over the replicas twice (its clipped step 0.29 off one big batch; N and K doubled in the result).
    Refused where the window is built, on every rank, naming mesh['pp']."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from gradaccum import ConfigurationError, PipelineWindow

    dp, pp = MESH["dp"], MESH["pp"]
    full = model()
    stages, _ = build(full, "single", pp.get_group(), lambda module: fully_shard(module, mesh=dp))
    try:
        PipelineWindow(stages, torch.optim.SGD(full.parameters(), lr=0.1), token_sum, n_microbatches=4,
                       reduction="sum", dp_group=dp.get_group(), max_grad_norm=0.05)
    except ConfigurationError as e:
        assert "pass pp_group=mesh['pp'].get_group()" in str(e), e
        return "refused"
    raise AssertionError("pp_group=None beside dp_group not refused")


SCENARIOS = [fsdp2_1f1b_uneven_items_across_replicas, ddp_stage_is_refused_with_the_fix,
             a_pp_group_left_to_the_world_beside_dp_group_is_refused]

if __name__ == "__main__":
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    MESH = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    if dist.get_rank() == 0:
        print(f"{WORKER_HEADER}{__file__}", flush=True)
    run_each(SCENARIOS, sys.argv[1:])
    if dist.get_rank() == 0:
        print(f"{WORKER_FOOTER}{__file__}", flush=True)
    finish_worker(0)
