"""DDP and FSDP2 under torchrun, 2 gloo processes on the CPU: exactness across ranks and the number
of gradient reductions per window. The scenarios live in worker.py and run in one launch."""
from __future__ import annotations

import pytest

from distributed.launch import ROOT, torchrun, two_agents

pytestmark = pytest.mark.distributed

WORKER = str(ROOT / "tests" / "distributed" / "worker.py")
SCENARIOS = [
    "ddp_uneven_exact",
    "ddp_loss_is_the_global_item_mean",
    "ddp_one_reduction_per_window",
    "ddp_find_unused_parameters_exact",
    "ddp_static_graph_is_a_clear_error",
    "ddp_reduce_every_micro_batch_exact",
    "ddp_exception_restores_sync",
    "fsdp2_exact_and_one_reduce_scatter",
    "ddp_auto_micro_batch_agrees_on_oom",
]


@pytest.fixture(scope="module")
def verdicts():
    proc = torchrun([WORKER])
    lines = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL"):
            lines[rest.split(":")[0]] = (status, line)
    return lines, proc


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(verdicts, name):
    lines, proc = verdicts
    assert name in lines, f"scenario {name} did not report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    status, line = lines[name]
    assert status == "PASS", f"{line}\n{proc.stderr[-4000:]}"


def test_two_torchrun_agents_nnodes_2():
    """Across machines it is torchrun's --nnodes: two agents on 127.0.0.1, one process each."""
    codes, outs = two_agents([WORKER, "ddp_uneven_exact", "ddp_one_reduction_per_window"])
    assert codes == [0, 0], outs
    joined = "\n".join(outs)
    assert "PASS ddp_uneven_exact" in joined and "PASS ddp_one_reduction_per_window" in joined, joined[-3000:]
