"""TRL's SFTTrainer and DPOTrainer with ExactTrainer first in the MRO, on one process, against one
float64 step per window through the trainer's own ``compute_loss`` over the window as one batch.

TRL's fused LM-head kernel accumulates in float32 (and projects in bf16 under TRL's default
``bf16=True``); both sides run trl_data.Float64LogProbs in its place so that the comparison sees the
weighting at rtol 1e-10. TRL's defaults ``bf16=True`` and ``gradient_checkpointing=True`` stay on:
a float64 model is left in float64 by the autocast. Windows: SFT 10 sequences in micro-batches of 2,
``gradient_accumulation_steps=2`` (windows of 4, 4 and 2 sequences); DPO 19 pairs, windows of 4 pairs and a
last one of 3 (micro-batches of 2 and 1 pairs).
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")

from integrations import scenarios as S  # noqa: E402
from integrations import trl_data as T  # noqa: E402
from gradaccum.integrations.hf_trainer import ExactTrainer  # noqa: E402
from hf_helpers import gpt2, llama  # noqa: E402

SFT_CASES = {"padded": {}, "padding_free": {"padding_free": True},
             "packed": {"packing": True, "max_length": 40, "per_device_train_batch_size": 1}}


@pytest.fixture(autouse=True)
def float64_head():
    with T.float64_log_probs():
        yield


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_is_one_big_batch_and_keeps_trl_metrics(case):
    """ExactSFTTrainer equals a big-batch SFT step per window (rtol 1e-10) with TRL's metrics logged
    every step. GPT-2 as built from a config (loss_type None): stock SFT counts its padded batches'
    unshifted labels (off by > 1e-4); padding-free and packed batches carry -100 at every sequence start,
    which makes that count right, so there stock SFT is exact too on one process (two processes with
    average_tokens_across_devices=False are where it is not: test_distributed.py)."""
    from trl import SFTTrainer

    from gradaccum.integrations.trl import ExactSFTTrainer

    config, model, examples = SFT_CASES[case], S.stock(gpt2()), T.sft_examples(10)
    window = 2 * config.get("per_device_train_batch_size", 2)
    ref = T.reference(SFTTrainer, model, examples, window, **config)
    exact, trainer = T.fit(ExactSFTTrainer, model, examples, **config)
    stock, _ = T.fit(SFTTrainer, model, examples, **config)
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing  # TRL's defaults, left on
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    if case == "padded":
        assert S.max_diff(stock, ref) > 1e-4
    else:
        assert S.max_diff(stock, ref) < 1e-12
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == trainer.state.global_step
    assert all({"entropy", "mean_token_accuracy", "num_tokens"} <= set(h) for h in logs)


def test_dpo_weighs_every_pair_the_same_across_the_window():
    """ExactDPOTrainer equals a big-batch DPO step per window (rtol 1e-10), its short last window
    included (3 pairs in micro-batches of 2 and 1: each pair 1/3); stock DPO divides each micro-batch's
    mean by the micro-batches (1/4, 1/4, 1/2). DPO's reward metrics are logged."""
    from trl import DPOTrainer

    from gradaccum.integrations.trl import ExactDPOTrainer

    model, pairs = llama(), T.dpo_examples(19)
    ref = T.reference(DPOTrainer, model, pairs, window=4)
    exact, trainer = T.fit(ExactDPOTrainer, model, pairs)
    stock, _ = T.fit(DPOTrainer, model, pairs)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert S.max_diff(stock, ref) > 1e-4
    assert trainer.state.global_step == 5 and trainer.last_window_items == 3
    assert all("rewards/margins" in h for h in trainer.state.log_history if "loss" in h)


def test_the_wrong_composition_and_batch_level_losses_are_refused():
    """SFTTrainer before ExactTrainer would run SFT's loss with ExactTrainer's all-rank count, 1/W off
    under average_tokens_across_devices=False: refused where the class is written, with the fix. DPO loss
    types that compare pairs across the micro-batch cannot be weighted: refused, naming them."""
    from trl import DPOTrainer, SFTTrainer

    with pytest.raises(TypeError, match=r"ExactTrainer must come first.*Write class X\(ExactTrainer, SFTTrainer\)"):
        type("X", (SFTTrainer, ExactTrainer), {})
    with pytest.raises(ValueError, match=r"loss_type \['aot'\] is not a mean of per-pair terms"):
        T.fit(type("ExactDPO", (ExactTrainer, DPOTrainer), {}), llama(), T.dpo_examples(4), train=False,
              loss_type=["aot"])
