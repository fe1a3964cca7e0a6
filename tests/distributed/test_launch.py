"""The launcher names a worker's death (issue #40 item 11): a suite run failed once in four with the
log lost, and a test's ``proc.stderr[-3000:]`` showed torchrun's agent traceback, not the rank that
died or why. A worker that aborts after its work (as gloo's 'terminate called' does, SIGABRT) is named
at the end of stderr with its exit and its own error line; and a worker that ends through
``finish_worker`` exits with its code, its output flushed, whatever the group still holds."""
from __future__ import annotations

import textwrap

import pytest

from distributed.launch import ROOT, failure_summary, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed.launch import finish_worker

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(2, 1))  # still alive at the end: it holds the group
model(torch.ones(3, 2)).sum().backward()
print(f"rank {{dist.get_rank()}} done", end="")  # no newline: finish_worker flushes it
if {abort} and dist.get_rank() == 1:
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()  # what gloo's abort at interpreter exit looks like from outside
finish_worker(0)
"""


def launch(tmp_path, abort: bool):
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(ROOT / "tests"), abort=abort)))
    return torchrun([str(script)], cwd=tmp_path, timeout=180)


def test_a_worker_that_dies_after_its_work_is_named_at_the_end_of_stderr(tmp_path):
    proc = launch(tmp_path, abort=True)
    assert proc.returncode != 0
    tail = proc.stderr[-1500:]
    assert "== torchrun exited" in tail and "terminate called without an active exception" in tail, tail
    assert "rank" in tail and ("-6" in tail or "SIGABRT" in tail), tail


def test_finish_worker_exits_with_the_output_flushed_while_ddp_holds_the_group(tmp_path):
    proc = launch(tmp_path, abort=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout, proc.stdout


def test_failure_summary_reads_torchrun_s_table():
    agent = textwrap.dedent("""\
        PASS one: ok
        terminate called without an active exception
        Traceback (most recent call last):
          File "/x/torch/distributed/elastic/multiprocessing/api.py", line 1, in run
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
        ============================================================
        w.py FAILED
        ------------------------------------------------------------
        Failures:
          <NO_OTHER_FAILURES>
        ------------------------------------------------------------
        Root Cause (first observed failure):
        [0]:
          time      : 2026-11-26_16:10:00
          host      : box
          rank      : 1 (local_rank: 1)
          exitcode  : -6 (pid: 42)
          error_file: <N/A>
          traceback : Signal 6 (SIGABRT) received by PID 42
        ============================================================""")
    summary = failure_summary(1, agent)
    assert "rank      : 1 (local_rank: 1)" in summary and "exitcode  : -6 (pid: 42)" in summary
    assert "Signal 6 (SIGABRT)" in summary and "terminate called without an active exception" in summary
    assert "ChildFailedError" not in summary
