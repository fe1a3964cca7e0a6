"""MoE load balancing over the window across 2 gloo processes under torchrun (moe_worker.py), each
equal to one float64 step per window on the model's own loss over both ranks' micro-batches (rtol
1e-10, bit-identical replicas) where the per-micro-batch aux term (the stock Trainer, the model's own
loss per micro-batch) is off by more than 1e-6:

- ExactTrainer under DDP for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, and under FSDP2 (Accelerate's,
  on the CPU) for Mixtral;
- Accumulator + MoELoss under DDP and under FSDP2 (each decoder layer and the root sharded) with
  uneven micro-batch counts per rank, and ``acc.train`` over uneven loaders (a rank with no data pads);
- ExactSFTTrainer (OLMoE, TRL's aux default).
"""
from __future__ import annotations

import pytest

from distributed.launch import scenario_tests

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

WORKER = "tests/integrations/moe_worker.py"
SCENARIOS = ([f"hf_ddp_{f}_clipped" for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")]
             + ["hf_fsdp2_mixtral_clipped"]
             + ["accumulator_ddp_qwen2_moe_clipped", "accumulator_fsdp2_mixtral_clipped"]
             + ["accumulator_train_uneven_ranks_olmoe", "trl_sft_ddp_olmoe_average_tokens"])


verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS)



def test_every_scenario_is_listed(verdicts):
    """Every scenario the worker ran is asserted here (one added there but not here would not be)."""
    lines, _ = verdicts
    assert sorted(lines) == sorted(SCENARIOS)
