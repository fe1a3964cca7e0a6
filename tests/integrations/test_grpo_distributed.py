"""ExactGRPOTrainer and ExactRLOOTrainer under DDP, 2 gloo processes in one torchrun launch
(grpo_worker.py): each equals the independent float64 big-batch reference over both ranks' micro-batches
(rtol 1e-10, bit-identical replicas), with uneven token counts per rank, a GRPO loss type for each divisor
TRL writes (grpo, dr_grpo, bnpo, dapo; the others share one of them, and each one's own term is asserted in one
process, test_grpo.py) with the KL term and the entropy bonus on; stock TRL is off by more than 1e-6 for every
one of them (the entropy bonus, and for bnpo and dapo their normalisers) and exact for RLOO (every micro-batch
holds as many sequences) except where an MoE model's router loss is on (the moe scenarios: its
load-balancing loss over both ranks' micro-batches, where TRL adds each micro-batch's over K). The
empty-steps scenario skips a step with no completion token on either rank and steps on one whose tokens
are all on one rank.
"""
from __future__ import annotations

import pytest

from distributed.launch import scenario_tests

pytestmark = pytest.mark.distributed
pytest.importorskip("trl")

WORKER = "tests/integrations/grpo_worker.py"
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")  # one per divisor TRL writes (grpo_worker.py says why)
SCENARIOS = ([f"grpo_ddp_{lt}_kl_entropy" for lt in LOSS_TYPES]
             + ["grpo_ddp_dapo_short_last_step", "rloo_ddp_short_last_step",
                "grpo_ddp_dapo_empty_steps", "grpo_ddp_moe_grpo_entropy", "rloo_ddp_moe_short_last_step"])


verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS)


def test_every_scenario_is_listed(verdicts):
    """Every scenario the worker ran is asserted here (one added there but not here would not be)."""
    lines, _ = verdicts
    assert sorted(lines) == sorted(SCENARIOS)
