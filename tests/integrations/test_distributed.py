"""Lightning (strategy="ddp", and FSDP2 through ModelParallelStrategy), the HF Trainer (DDP, and FSDP2
through Accelerate) and TRL's SFT and DPO trainers under torchrun, 2 gloo processes on the CPU: the
integration equals one float64 step per window on the union of both ranks' micro-batches (rtol 1e-10;
FSDP2's shards are gathered first), the replicas are bit-identical, and the framework's own
accumulation is off by more than 1e-6. The scenarios live in hf_worker.py and run in one launch
(Lightning and transformers import once)."""
from __future__ import annotations

import pytest

from distributed.launch import ROOT, scenario_tests

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")
pytest.importorskip("pytorch_lightning")

WORKER = "tests/integrations/hf_worker.py"
SCENARIOS = [
    "lightning_ddp_gpt2_clipped",
    "lightning_ddp_llama_float64_norm_clipped",
    "lightning_fsdp2_gpt2_clipped",
    "lightning_ddp_zero_item_windows",
    "lightning_ddp_padded_labels_on_one_rank",
    "hf_ddp_gpt2_stock_loss_type",
    "hf_ddp_llama_plain_forward_clipped",
    "hf_fsdp2_llama_plain_forward_clipped",
    "hf_fsdp2_zero_item_windows",
    "trl_sft_ddp_average_tokens_gpt2",
    "trl_sft_ddp_local_tokens_llama",
    "trl_dpo_ddp",
]


verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS)


def test_every_scenario_is_listed():
    """A scenario added to the worker but not here would never be asserted."""
    import ast

    tree = ast.parse((ROOT / "tests" / "integrations" / "hf_worker.py").read_text())
    listed = next(node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                  and getattr(node.target, "id", None) == "SCENARIOS")
    assert [k.value for k in listed.keys] == SCENARIOS
