"""Never silent: a mixture-of-experts model whose loss adds the router's load-balancing term is
refused by the stacks that would compute it per micro-batch (or drop it), with the fix that works:
ExactDPOTrainer, a Trainer subclass with a compute_loss of its own, Lightning's ExactAccumulation.
(ExactTrainer and ExactSFTTrainer compute it over the window: test_moe_trainer.py.)"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from integrations import moe_models as M  # noqa: E402
from integrations import scenarios as S  # noqa: E402
from gradaccum import NotExactError  # noqa: E402


def test_dpo_refuses_the_aux_term_and_its_fix_gets_past_the_refusal():
    """ExactDPOTrainer refuses TRL's per-micro-batch aux loss (ExactSFTTrainer computes it over the
    window: test_moe_trainer.py); the message names router_aux_loss_coef=0.0 in DPOConfig, and that
    fix builds the trainer. output_router_logits=False alone is overridden by TRL."""
    pytest.importorskip("trl")
    from integrations import trl_data as T
    from gradaccum.integrations.trl import ExactDPOTrainer

    examples = T.dpo_examples(4)
    with pytest.raises(NotExactError, match=r"router_aux_loss_coef=0.2 .*DPOConfig\(\.\.\., router_aux_loss_coef=0\.0\)"):
        T.fit(ExactDPOTrainer, M.moe_model("mixtral"), examples, train=False)
    with pytest.raises(NotExactError, match="router_aux_loss_coef=0.0"):
        T.fit(ExactDPOTrainer, M.moe_model("mixtral", output_router_logits=False), examples, train=False)
    _, trainer = T.fit(ExactDPOTrainer, M.moe_model("mixtral"), examples, train=False, router_aux_loss_coef=0.0)
    assert not trainer.aux_loss_enabled


def test_lightning_refuses_the_aux_term_with_the_fix():
    """ExactAccumulation refuses an MoE model with the aux term on, before the first step; with
    output_router_logits=False it trains."""
    pytest.importorskip("pytorch_lightning")
    micro = S.rank_micro_batches(0, [2, 1])
    with pytest.raises(NotExactError, match=r"output_router_logits = False .*router_aux_loss_coef = 0\.0"):
        S.lightning_fit(M.moe_model("olmoe"), micro, exact=True, accum=2)
    lit, trainer, _ = S.lightning_fit(M.moe_model("olmoe", output_router_logits=False), micro, exact=True, accum=2)
    assert trainer.global_step == 1


def test_a_declared_rows_trainer_refuses_the_models_aux_term():
    """A Trainer subclass whose own compute_loss (declared exact_items='rows') may call the model's
    loss, which holds the aux term per micro-batch: refused, naming router_aux_loss_coef."""
    from transformers import Trainer

    from gradaccum.integrations.hf_trainer import ExactTrainer

    class Rows(ExactTrainer, Trainer):
        exact_items = "rows"

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss

    with pytest.raises(NotExactError, match=r"Rows: .*router_aux_loss_coef=0.2.*router_aux_loss_coef = 0\.0"):
        S.hf_fit(M.moe_model("qwen3_moe"), [S.rank_micro_batches(0, [1])], exact=True, trainer_cls=Rows, accum=1)


def test_a_router_loss_exact_trainer_cannot_compute_is_refused_not_dropped():
    """A family whose router loss is weighed under another name (JetMoe's aux_loss_coef, DBRX's
    ffn_config.moe_loss_weight) or computed by another formula: ExactTrainer trained it on the token loss
    alone, in silence (the logged loss was the model's minus coef * aux). Now it is refused with the fix,
    and the fix trains."""
    import torch
    from transformers import DbrxConfig, JetMoeConfig, JetMoeForCausalLM

    from gradaccum.checking import check_equivalence
    from gradaccum.integrations.hf_router import aux_term

    def jetmoe(**extra):
        torch.manual_seed(0)
        return JetMoeForCausalLM(JetMoeConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            kv_channels=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **extra)).double()

    with pytest.raises(NotExactError, match=r"\(jetmoe\) has output_router_logits=True and aux_loss_coef=0.5"):
        S.hf_fit(jetmoe(output_router_logits=True, aux_loss_coef=0.5), [S.rank_micro_batches(0, [1])], exact=True,
                 accum=1)
    with pytest.raises(NotExactError, match=r"ffn_config.moe_loss_weight"):
        aux_term(DbrxConfig(output_router_logits=True))
    S.hf_fit(jetmoe(output_router_logits=False, aux_loss_coef=0.5), [S.rank_micro_batches(0, [1])], exact=True,
             accum=1)
    assert aux_term(M.moe_model("mixtral").config) is not None  # the tested families still compute it


def test_exact_sft_refuses_a_router_loss_it_cannot_compute_naming_trl_s_argument():
    """ExactSFTTrainer with a family whose router loss gradaccum does not compute over the window
    (GraniteMoE): refused, and the fix named is TRL's router_aux_loss_coef=0.0, since TRL rewrites the
    config's output_router_logits from it (the config's own fix would be overridden); that fix trains."""
    pytest.importorskip("trl")
    import torch
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    from gradaccum.integrations.trl import ExactSFTTrainer
    from hf_helpers import VOCAB
    from integrations import trl_data as T

    torch.manual_seed(0)
    model = GraniteMoeForCausalLM(GraniteMoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.01, bos_token_id=0, eos_token_id=0, pad_token_id=0)).double()
    examples = T.sft_examples(4)
    with pytest.raises(NotExactError, match=r"granitemoe.*SFTConfig\(\.\.\., router_aux_loss_coef=0\.0\)"):
        T.fit(ExactSFTTrainer, model, examples, train=False)
    _, trainer = T.fit(ExactSFTTrainer, model, examples, train=False, router_aux_loss_coef=0.0)
    assert trainer.router_balance is None and not trainer.aux_loss_enabled
