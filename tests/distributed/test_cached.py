"""WindowLoss under torchrun with 2 gloo processes (the scenarios are in cached_worker.py, one launch)."""
from __future__ import annotations

import pytest

from distributed.launch import scenario_tests

pytestmark = pytest.mark.distributed

WORKER = "tests/distributed/cached_worker.py"
SCENARIOS = [
    "cached_ddp_exact_with_uneven_ranks_and_a_rank_without_data",
    "cached_ddp_find_unused_parameters",
    "cached_ddp_loss_parameters_beside_the_wrapped_module",
    "cached_ddp_dropout_replayed_with_rank_seeds",
    "cached_fsdp2_exact",
    "cached_train_over_a_window_sampler",
    "cached_ddp_misuse_is_refused_on_every_rank_even_one_without_data",
    "cached_labels_ride_along_joined_across_ranks",
    "cached_loss_without_representations_refused_on_every_rank",
    "cached_layouts_that_differ_across_ranks_are_refused_on_every_rank",
]


verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS)
