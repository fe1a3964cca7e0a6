"""gradaccum.PipelineWindow with data parallelism (#49): 2 pipeline stages x 2 replicas, 4 gloo processes
on a ("dp", "pp") device mesh, in one torchrun launch of its own (the shared launch runs 2 processes).
The scenarios live in pipeline_dp_worker.py."""
from __future__ import annotations

import pytest

from distributed.launch import ROOT, assert_scenario, torchrun, verdict_lines
from distributed.pipeline_worker import assert_guide_quotes

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "pipeline_dp_worker.py"
SCENARIOS = ["fsdp2_1f1b_uneven_items_across_replicas", "ddp_stage_is_refused_with_the_fix",
             "a_pp_group_left_to_the_world_beside_dp_group_is_refused"]


@pytest.fixture(scope="module")
def verdicts():
    proc = torchrun([str(WORKER)], nproc=4, timeout=240)
    lines, _ = verdict_lines(proc.stdout).get(str(WORKER), ({}, False))
    return lines, proc


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(verdicts, name):
    """The scenario reported PASS from pipeline_dp_worker.py under torchrun (4 gloo processes)."""
    assert_scenario(verdicts, name)


def test_the_guide_quotes_what_the_replicas_measured(verdicts):
    """docs/guides/pipeline.md's 2 stages x 2 replicas row, as the scenario printed it."""
    lines, _ = verdicts
    name = "fsdp2_1f1b_uneven_items_across_replicas"
    assert name in lines and lines[name][0] == "PASS", lines.get(name)
    assert_guide_quotes(lines[name][1], name)
