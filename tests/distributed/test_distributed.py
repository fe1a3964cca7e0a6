"""DDP and FSDP2 under torchrun, 2 gloo processes on the CPU: exactness across ranks and the number
of gradient reductions per window. The scenarios live in worker.py and run in one launch."""
from __future__ import annotations

import pytest

from distributed.launch import scenario_tests, two_agents

pytestmark = pytest.mark.distributed

WORKER = "tests/distributed/worker.py"
SCENARIOS = [
    "ddp_uneven_exact",
    "ddp_loss_is_the_global_item_mean",
    "ddp_one_reduction_per_window",
    "ddp_find_unused_parameters_exact",
    "ddp_a_branch_unused_in_a_later_windows_last_micro_batch_is_refused_before_its_step",
    "ddp_static_graph_is_a_clear_error",
    "ddp_reduce_every_micro_batch_exact",
    "ddp_exception_restores_sync",
    "fsdp2_exact_and_one_reduce_scatter",
    "ddp_auto_micro_batch_agrees_on_oom",
    "ddp_train_uneven_windows",
    "ddp_every_micro_batch_uneven_windows",
    "fsdp2_train_uneven_windows",
    "ddp_hand_written_window_with_no_data",
    "ddp_empty_share_with_a_split_or_auto_size",
    "ddp_a_rank_out_of_data_after_one_window_with_buffers",
    "ddp_a_fresh_rank_with_an_empty_first_share_needs_set_padding",
    "fsdp2_hand_written_unequal_counts_is_one_error_on_every_rank",
    "fsdp2_a_parameter_in_no_fully_shard_is_refused_on_every_rank",
    "compiled_ddp_exact_with_uneven_counts",
    "unwrapped_model_is_refused_and_per_rank_is_an_explicit_choice",
    "ddp_step_costs_one_small_collective_per_window",
    "ddp_step_is_the_plain_loop_bit_for_bit_while_n_repeats",
    "ddp_a_resumed_run_counting_first_is_the_uninterrupted_one",
    "ddp_a_rank_without_num_items_weighs_as_the_others",
    "ddp_step_with_a_rank_without_data_costs_the_same",
    "ddp_step_with_a_loss_one_rank_finds_not_finite_costs_one_collective_per_window",
    "ddp_train_over_a_window_sampler_costs_one_collective_per_window",
    "ddp_a_bypassed_wrapper_is_refused_on_every_rank",
    "ddp_a_loss_only_one_rank_finds_not_finite_stops_every_rank",
    "ddp_counts_other_than_the_shares_are_summed_at_the_boundary",
    "ddp_train_over_a_distributed_sampler_asks_once_per_epoch",
    "clipped_train_over_a_window_sampler_costs_one_collective_per_window",
    "ddp_a_micro_batch_of_no_item_weighs_nothing",
    "fsdp2_a_micro_batch_of_no_item_weighs_nothing",
    "ddp_a_layer_unfrozen_after_wrapping_is_refused_on_every_rank",
    "torchrun_guide_runs_as_written",
]


verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS)


def test_two_torchrun_agents_nnodes_2():
    """Across machines it is torchrun's --nnodes: two agents on 127.0.0.1, one process each."""
    codes, outs = two_agents([WORKER, "ddp_uneven_exact", "ddp_one_reduction_per_window"])
    assert codes == [0, 0], outs
    joined = "\n".join(outs)
    assert "PASS ddp_uneven_exact" in joined and "PASS ddp_one_reduction_per_window" in joined, joined[-3000:]

