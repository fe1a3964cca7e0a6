"""Section 2: launch dist_bench.py under torchrun (2 gloo processes, ``--standalone``: torchrun picks
a free port itself, so concurrent runs never race for a fixed one)."""
from __future__ import annotations

import json
import sys
from typing import Optional

from common import ROOT, torchrun


def _launch(script: str) -> Optional[dict]:
    # Accelerate really runs DDP on the CPU under torchrun
    proc = torchrun(ROOT / "benchmarks" / script, env={"ACCELERATE_USE_CPU": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(lines[-1])


def distributed() -> Optional[dict]:
    """One reduction per window against one per micro-batch (dist_bench.py)."""
    return _launch("dist_bench.py")


def window_cost() -> Optional[dict]:
    """What a window costs besides DDP's buckets: gradaccum against the hand no_sync loop and
    Accelerate (dist_window_cost.py)."""
    return _launch("dist_window_cost.py")


def count_first() -> Optional[dict]:
    """Counting a window's items first across ranks against the running R and the hand loop that
    counts first (count_first.py)."""
    return _launch("count_first.py")
