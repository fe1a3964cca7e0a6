"""ExactSentenceTransformerTrainer under torchrun with 2 gloo processes: each loss family's window spans
both ranks and equals one float64 batch of all their rows (the scenarios are in st_worker.py, one
launch)."""
from __future__ import annotations

import pytest

from distributed.launch import ROOT, assert_scenario, scenario_verdicts

pytestmark = pytest.mark.distributed
pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")

WORKER = str(ROOT / "tests" / "distributed" / "st_worker.py")
LOSSES = ["MNRL", "MNSRL", "GIST", "MegaBatchMargin", "CoSENT", "AnglE", "BatchAllTriplet", "BatchHardTriplet",
          "BatchSemiHardTriplet", "OnlineContrastive", "Matryoshka_MNRL", "Matryoshka_CoSENT"]


@pytest.fixture(scope="module")
def verdicts():
    return scenario_verdicts(WORKER)


@pytest.mark.parametrize("name", LOSSES)
def test_scenario(verdicts, name):
    assert_scenario(verdicts, "st_ddp_" + name)
