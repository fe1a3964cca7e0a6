"""WindowLoss's labels and the refusal of a loss without representations, under torchrun with 2 gloo
processes (the scenarios are in cached_labels_worker.py, one launch)."""
from __future__ import annotations

import pytest

from distributed.launch import ROOT, assert_scenario, scenario_verdicts

pytestmark = pytest.mark.distributed

WORKER = str(ROOT / "tests" / "distributed" / "cached_labels_worker.py")
SCENARIOS = ["cached_labels_ride_along_joined_across_ranks", "cached_loss_without_representations_refused_on_every_rank"]


@pytest.fixture(scope="module")
def verdicts():
    return scenario_verdicts(WORKER)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(verdicts, name):
    assert_scenario(verdicts, name)
