"""The Lightning recipe for a loss that couples the window's items, under torchrun with DDP on 2 gloo
processes (the scenario is in lightning_window_worker.py)."""
from __future__ import annotations

import pytest

from distributed.launch import ROOT, assert_scenario, scenario_verdicts

pytestmark = pytest.mark.distributed
pytest.importorskip("pytorch_lightning")

WORKER = str(ROOT / "tests" / "distributed" / "lightning_window_worker.py")


@pytest.fixture(scope="module")
def verdicts():
    return scenario_verdicts(WORKER)


def test_lightning_ddp_window_loss_recipe(verdicts):
    assert_scenario(verdicts, "lightning_ddp_window_loss_recipe")
