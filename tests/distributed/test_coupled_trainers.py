"""Trainers with a loss that couples the batch's rows under torchrun with 2 gloo processes (DDP):
ExactSentenceTransformerTrainer per loss family, ExactTrainer with CLIP, SigLIP and a WindowLoss of
one's own, and the Lightning recipe; each against one float64 batch of both ranks' rows (the
scenarios are in coupled_trainers_worker.py, one launch)."""
from __future__ import annotations

import pytest

from distributed.launch import scenario_tests

pytestmark = pytest.mark.distributed
pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")
pytest.importorskip("pytorch_lightning")

WORKER = "tests/distributed/coupled_trainers_worker.py"
SCENARIOS = ["st_ddp_" + name for name in ["MNRL", "MNSRL", "GIST", "MegaBatchMargin", "CoSENT", "AnglE",
                                           "BatchAllTriplet", "BatchHardTriplet", "BatchSemiHardTriplet",
                                           "OnlineContrastive", "Matryoshka_MNRL", "Matryoshka_CoSENT",
                                           "AdaptiveLayer_MNRL", "Matryoshka2d_CoSENT"]]
SCENARIOS += ["hf_ddp_clip_own_loss", "hf_ddp_siglip_own_loss", "hf_ddp_window_loss_of_one_s_own",
              "lightning_ddp_window_loss_recipe", "st_ddp_datasets_split_across_ranks_are_refused_on_every_rank"]


verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS)
