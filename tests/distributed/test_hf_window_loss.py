"""ExactTrainer with CLIP, SigLIP and a WindowLoss of one's own under torchrun with 2 gloo processes
(the scenarios are in hf_window_loss_worker.py, one launch)."""
from __future__ import annotations

import pytest

from distributed.launch import ROOT, assert_scenario, scenario_verdicts

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

WORKER = str(ROOT / "tests" / "distributed" / "hf_window_loss_worker.py")
SCENARIOS = ["hf_ddp_clip_own_loss", "hf_ddp_siglip_own_loss", "hf_ddp_window_loss_of_one_s_own"]


@pytest.fixture(scope="module")
def verdicts():
    return scenario_verdicts(WORKER)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(verdicts, name):
    assert_scenario(verdicts, name)
