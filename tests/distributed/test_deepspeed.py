"""DeepSpeed ZeRO-1/2/3 around the Accumulator and under ExactTrainer (#38), under torchrun with 2 gloo processes on the CPU
(``DS_ACCELERATOR=cpu``). Every scenario runs in one launch (deepspeed_worker.py): DeepSpeed imports
once, and builds its CPU communication op (``deepspeed_shm_comm``) once per machine, minutes on a
fresh 2-core machine, hence the generous timeout."""
from __future__ import annotations

import pytest

from distributed.launch import scenario_tests

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")

WORKER = "tests/distributed/deepspeed_worker.py"
SCENARIOS = ["zero1_exact", "zero2_exact", "zero3_exact", "zero2_cpu_offload_exact", "resume_exact", "refusals",
             "guide_example",
             "nonfinite_window_raises", "low_precision_is_named_once", "window_loss_refused", "exact_trainer_stages",
             "exact_trainer_empty_window", "exact_trainer_resume", "exact_trl_trainers",
             "exact_trainer_moe_refused", "exact_trainer_nonfinite_window_skipped"]

# what each scenario asserts, the test's docstring
DOC = """zeroN_exact: float32 within 1e-6 of the float64 big batch over uneven micro-batches and ranks, a
short last window, clipping that engages (the engine's, once; ``grad_norm`` the window's true norm) and
an empty window skipped, with DeepSpeed's own loop and the loop without W measurably off beside it;
resume_exact: acc.state in DeepSpeed's checkpoint, resumed bit-identically; refusals (and
window_loss_refused): with the fix; guide_example: docs/guides/deepspeed.md's code as written;
nonfinite_window_raises: no step taken or counted; low_precision_is_named_once: the LowPrecisionWarning
under DDP, FSDP2 (reduce_dtype) and a bf16 DeepSpeed engine (grad_accum_dtype), silent where the sum is float32;
exact_trainer_stages: ExactTrainer(deepspeed=...) on ZeRO-1/2/3 with a Trainer user's "auto" config without
"managed_gradient_accumulation" (a dict, a JSON file at ZeRO-1; ExactTrainer sets the key in its copy, said
once, the user's dict unchanged) within 1e-6 of the big batch, clipped, the logged grad_norm the window's true
norm, the stock Trainer off; exact_trainer_empty_window: skipped, no
engine step, the next window exact; exact_trainer_resume: checkpoint-1 of 3 resumed bit-identically;
exact_trl_trainers: TRL's SFT (ZeRO-2) and DPO (ZeRO-3) against TRL's loss over one big batch;
exact_trainer_moe_refused: an MoE router loss under DeepSpeed refused when the Trainer is built;
exact_trainer_nonfinite_window_skipped: a window whose loss is not finite is dropped by the engine and recorded
skipped with one warning, the other windows exact."""

verdicts, test_scenario = scenario_tests(WORKER, SCENARIOS, timeout=900, doc=DOC)
