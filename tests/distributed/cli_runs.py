"""Several ``gradaccum train`` commands, one after the other, on the ranks of one torchrun launch:
``torchrun --standalone --nproc_per_node=2 tests/distributed/cli_runs.py RUNS.json`` (a JSON list of
argument lists), each run as every rank's ``gradaccum.cli.main(argv)``.

A launch costs every process its imports (torch, its compiler, matplotlib: about 6 CPU-seconds a
process, 3 processes a launch): the runs whose point is what they train and write, not how a process
starts, stops or ends, share one (tests/distributed/test_global_batch.py). The group is joined here
first, so each command finds it joined and leaves it joined (``gradaccum.cli.sharding``'s
``setup_distributed`` and ``teardown_distributed``); the launch ends through ``finish_worker``. Rank 0
prints ``RAN <i> <every rank's exit code>`` after run ``i``; the launch exits with the largest code.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: distributed.launch

from distributed.launch import finish_worker  # noqa: E402


def run_all(runs_file: str) -> int:
    import torch.distributed as dist

    from gradaccum.cli import main

    dist.init_process_group("gloo")
    worst = 0
    for i, argv in enumerate(json.loads(Path(runs_file).read_text())):
        codes = [None] * dist.get_world_size()
        dist.all_gather_object(codes, main(list(argv)))
        if dist.get_rank() == 0:
            print(f"RAN {i} {codes}", flush=True)
        worst = max([worst, *(abs(c) for c in codes)])
    return worst


if __name__ == "__main__":
    finish_worker(run_all(sys.argv[1]))
