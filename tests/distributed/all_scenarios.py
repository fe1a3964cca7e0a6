"""Every torchrun scenario worker of the suite in one launch, 2 gloo processes:
``torchrun --standalone --nproc_per_node=2 tests/distributed/all_scenarios.py WORKER.py [WORKER.py ...]``.

Each rank imports the workers as modules and runs their scenarios in turn (tests/distributed/launch.py,
``run_workers``), rank 0 printing a header before each worker's lines: torch, transformers, Lightning,
sentence-transformers and DeepSpeed import once per rank, not once per worker. A worker script also
runs alone (``torchrun ... tests/distributed/cached_worker.py [SCENARIO ...]``).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: distributed.launch

from distributed.launch import run_workers  # noqa: E402

if __name__ == "__main__":
    run_workers(sys.argv[1:])
