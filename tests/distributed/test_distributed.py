"""DDP and FSDP2 under torchrun, 2 gloo processes on the CPU: exactness across ranks and the number
of gradient reductions per window. The scenarios live in worker.py and run in one launch."""
from __future__ import annotations

import pytest

from distributed.launch import scenario_tests, torchrun, two_agents

pytestmark = pytest.mark.distributed

WORKER = "tests/distributed/worker.py"
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
    "ddp_train_uneven_windows",
    "ddp_every_micro_batch_uneven_windows",
    "fsdp2_train_uneven_windows",
    "ddp_hand_written_window_with_no_data",
    "ddp_empty_share_with_a_split_or_auto_size",
    "ddp_a_rank_out_of_data_after_one_window_with_buffers",
    "ddp_a_fresh_rank_with_an_empty_first_share_needs_set_padding",
    "fsdp2_hand_written_unequal_counts_is_one_error_on_every_rank",
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
]


verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS)


def test_two_torchrun_agents_nnodes_2():
    """Across machines it is torchrun's --nnodes: two agents on 127.0.0.1, one process each."""
    codes, outs = two_agents([WORKER, "ddp_uneven_exact", "ddp_one_reduction_per_window"])
    assert codes == [0, 0], outs
    joined = "\n".join(outs)
    assert "PASS ddp_uneven_exact" in joined and "PASS ddp_one_reduction_per_window" in joined, joined[-3000:]


def test_cli_under_torchrun_rank0_writes_and_resume_extends(tmp_path):
    """`torchrun --nproc_per_node=2 -m gradaccum train` unchanged: DistributedSampler shares, one
    writer, and a run resumed for a second epoch equals a two-epoch run, to the bit (three launches:
    the resumed side's two and that run; each launch costs 3 processes' imports). No rank prints the profiler's C++ warning about memory allocated before it
    started (the memory meter's own noise)."""
    import json

    import torch

    args = ["-m", "gradaccum", "train", "--model", "mlp", "--device", "cpu", "--micro-batch-size", "16",
            "--accum-steps", "2", "--dtype", "float64"]
    for extra, out in ((["--epochs", "1"], "resumed"), (["--epochs", "2", "--resume"], "resumed"),
                       (["--epochs", "2"], "whole")):
        proc = torchrun([*args, *extra, "--out", str(tmp_path / out)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Memory block of unknown size" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["world_size"] == 2
    rows = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r.get("kind", "train") == "train"]  # eval rows: one per epoch end
    assert [r["epoch"] for r in rows if r.get("kind") == "eval"] == [0, 1]
    assert steps == list(range(1, summary["steps"] + 1)), "duplicate or missing metric lines"
    assert summary["steps"] == 2 * 23  # 1438 items over 2 ranks: 719 each, windows of 32
    a = torch.load(tmp_path / "whole" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run changed the training"  # a resume that lost anything
    whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in whole if r.get("kind", "train") == "train"]
    assert summary["last_loss"] == losses[-1], losses[-3:]
    names = sorted(p.name for p in (tmp_path / "whole").iterdir() if not p.name.startswith("events.out.tfevents"))
    assert names == ["last.pt", "loss.png", "metrics.csv", "metrics.jsonl", "summary.json"], names
    assert sum(p.name.startswith("events.out.tfevents") for p in (tmp_path / "whole").iterdir()) == 1  # rank 0's
