"""Several ``gradaccum train`` commands, one after the other, on the ranks of one torchrun launch:
``torchrun --standalone --nproc_per_node=2 tests/distributed/cli_runs.py RUNS.json`` (a JSON object:
a name for each run, its argument list), each run as every rank's ``gradaccum.cli.main(argv)`` (distributed.launch's ``run_cli_here``: what it prints is
kept, and said where the run fails; the C++ side's warnings reach the launch's stderr as they would).

A launch costs every process its imports (torch, its compiler, matplotlib: about 6 CPU-seconds a
process, 3 processes a launch): the runs whose point is what they train and write, not how a process
starts, stops or ends, share one (tests/distributed/test_global_batch.py). The group is joined here
first, so each command finds it joined and leaves it joined (``gradaccum.cli.sharding``'s
``setup_distributed`` and ``teardown_distributed``). Between runs the garbage of the last one is
collected (DDP's reducer and the tensors in its cycles), so that none of it is freed inside the next
run's measured window. Rank 0 prints ``RAN <name> [<every rank's exit code>]`` after each run. A rank
whose run fails says ``RAN <name> [rank <r>: <code>]`` and exits with that code at once (a rank that went
on would wait in a collective its peer never joins); torchrun then stops the other, and the runs after it
are not run.
"""
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: distributed.launch

from distributed.launch import finish_worker, run_cli_here  # noqa: E402


def run_all(runs_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name, argv in json.loads(Path(runs_file).read_text()).items():
        done = run_cli_here(argv)
        gc.collect()
        code = done.returncode
        if code:  # ends the launch now: a peer may be waiting in one of the run's collectives (torchrun stops it)
            print(f"RAN {name} [rank {rank}: {code}]", flush=True)
            sys.stderr.write(done.stderr[-3000:])
            sys.stderr.flush()
            os._exit(code)
        codes = [None] * dist.get_world_size()
        dist.all_gather_object(codes, code)
        if rank == 0:
            print(f"RAN {name} {codes}", flush=True)


if __name__ == "__main__":
    run_all(sys.argv[1])
    finish_worker(0)
