"""gradaccum.PipelineWindow (#49) under torchrun, 2 gloo processes: every torch.distributed.pipelining
schedule (GPipe, 1F1B, interleaved 1F1B and looped BFS with 2 virtual stages per rank, the two zero-bubble
ones) against one float64 big batch on the unsplit model, uneven tokens per micro-batch, clipping
engaged, a short last window; the stock schedule measured beside it; empty and non-finite windows,
resume, refusals. The scenarios live in pipeline_worker.py and run in the suite's one shared launch."""
from __future__ import annotations

import ast

import pytest

from distributed.launch import ROOT, scenario_tests
from distributed.pipeline_worker import GUIDE_ROWS, assert_guide_quotes

pytestmark = pytest.mark.distributed

WORKER = "tests/distributed/pipeline_worker.py"
SCENARIOS = [
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "declared_mean_with_an_empty_micro_batch",
    "shape_inference_call_is_recognised_after_eval",
    "empty_and_nonfinite_windows_skip_on_every_stage",
    "resume_is_bit_identical",
    "refusals_name_the_fix",
    "guide_example_runs_as_written",
]

verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS, timeout=240)


def test_every_scenario_is_listed():
    """A scenario added to the worker but not here would never be asserted."""
    tree = ast.parse((ROOT / WORKER).read_text())
    listed = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "SCENARIOS" for t in node.targets))
    assert [elt.id for elt in listed.elts] == SCENARIOS


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n in GUIDE_ROWS])
def test_the_guide_quotes_what_the_scenario_measured(verdicts, name):
    """docs/guides/pipeline.md's table row: stock, scale_grads=False with the mean loss, gradaccum, as printed."""
    lines, _ = verdicts
    assert name in lines and lines[name][0] == "PASS", lines.get(name)
    assert_guide_quotes(lines[name][1], name)
