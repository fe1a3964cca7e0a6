"""ExactTrainer with a mixture-of-experts model whose loss adds the router's load-balancing term
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE from configs, coef 0.2), on one process, against one float64 step
per window on the model's own loss over the window as one batch (moe_scenarios.reference), with no
extra argument. Micro-batches of 2, 3, 1, 2, 3, 1, 2 padded sequences, accumulation 3 (a short last
window); transformers' float32 islands swapped for float64 on both sides (moe_models)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from integrations import moe_models as M  # noqa: E402
from integrations import moe_scenarios as MS  # noqa: E402
from integrations import scenarios as S  # noqa: E402
from gradaccum import ReplayError  # noqa: E402

MICRO = S.rank_micro_batches(0, S.SIZES[0])
WINDOWS = S.windows_of([MICRO], S.ACCUM)


@pytest.fixture(autouse=True)
def float64_islands():
    with M.float64_balance_loss():
        yield


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("family", M.FAMILIES)
def test_exact_trainer_is_the_big_batch_with_the_aux_term(family, clip):
    """Params equal the reference at rtol 1e-10; the stock Trainer (the aux term per micro-batch) is off
    by more than 1e-6; the logged loss is the window's own loss (token + coef * balance)."""
    model = M.moe_model(family)
    ref = MS.reference(model, WINDOWS, clip)
    exact, trainer = S.hf_fit(model, [MICRO], exact=True, clip=clip)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    stock, _ = S.hf_fit(model, [MICRO], exact=False, clip=clip)
    assert S.max_diff(stock, ref) > 1e-6
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    from hf_helpers import pad
    with torch.no_grad():
        first = model(**pad(WINDOWS[0])).loss.item()
    assert logged[0] == pytest.approx(first, rel=1e-6)  # the Trainer sums its log in float32


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_exact_sft_trainer_is_the_big_batch_with_trls_aux_default(family):
    """ExactSFTTrainer with TRL's default router_aux_loss_coef (the config's, 0.2) equals one big-batch
    SFT step per window through SFT's own compute_loss (token loss + coef * aux over the window) at
    rtol 1e-10; stock SFT (aux per micro-batch, divided by the steps) is off by more than 1e-6. TRL's
    fused LM head runs a float64 stand-in on both sides (trl_data)."""
    pytest.importorskip("trl")
    from trl import SFTTrainer

    from integrations import trl_data as T
    from gradaccum.integrations.trl import ExactSFTTrainer

    examples = T.sft_examples(10)
    with T.float64_log_probs():
        model = M.moe_model(family)
        ref = T.reference(SFTTrainer, model, examples, 4)
        exact, trainer = T.fit(ExactSFTTrainer, model, examples)
        stock, _ = T.fit(SFTTrainer, model, examples)
    assert trainer.router_balance is not None and trainer.router_balance.coef == M.COEF
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert S.max_diff(stock, ref) > 1e-6


def test_router_jitter_and_dropout_are_replayed_and_other_randomness_is_caught():
    """Mixtral with router jitter and attention dropout: each training forward replays the random state
    its counting forward drew from, so every window routes as it was counted and trains (a replay that
    is dropped raises). A router whose noise comes from a generator of its own routes otherwise in the
    training forward: caught before the window's last backward."""
    model = M.moe_model("mixtral", router_jitter_noise=0.3, attention_dropout=0.2)
    _, trainer = S.hf_fit(model, [MICRO], exact=True)
    assert trainer.state.global_step == len(WINDOWS)

    gen = torch.Generator().manual_seed(0)
    noisy = M.moe_model("mixtral")
    for router in [m for m in noisy.modules() if type(m).__name__ == "MixtralTopKRouter"]:
        plain = router.forward
        router.forward = lambda h, plain=plain: plain(h + 3 * torch.randn(h.shape, generator=gen, dtype=h.dtype))
    with pytest.raises(ReplayError, match="routed its tokens to other experts"):
        S.hf_fit(noisy, [MICRO], exact=True)


# transformers 5.19 (make test-oldest) runs the counting pass's forward through torch's reentrant checkpoint, which
# warns that no input requires grad before the refusal below; later versions do not checkpoint it
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")
def test_reentrant_checkpointing_is_refused_and_non_reentrant_is_exact():
    """Reentrant activation checkpointing runs the forward without a graph, so the router logits the
    balance term needs carry no gradient: refused, naming use_reentrant (it would drop the term's
    gradient silently). Non-reentrant checkpointing is the big batch (rtol 1e-10)."""
    from gradaccum import NotExactError

    model = M.moe_model("mixtral")
    with pytest.raises(NotExactError, match="use_reentrant"):
        S.hf_fit(model, [MICRO], exact=True, gradient_checkpointing=True,
                 gradient_checkpointing_kwargs={"use_reentrant": True})
    exact, _ = S.hf_fit(model, [MICRO], exact=True, gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = MS.reference(model, WINDOWS)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)


def test_both_drivers_run_the_one_counting_pass(monkeypatch):
    """#37 items 1 and 5: the Accumulator's MoELoss and ExactTrainer run one implementation of the
    counting pass, gradaccum.moe.Routing. Both are the big batch (rtol 1e-10); with its part taken
    from each micro-batch's own counts instead of the window's, both land off it (> 1e-6); with its replay
    skipped, both refuse a jittered router's window (ReplayError) instead of training it."""
    import copy

    from gradaccum import Accumulator, MoELoss
    from gradaccum._maths import balance_loss_part, router_statistics
    from gradaccum.moe import Routing

    def accumulator(model):
        net = copy.deepcopy(model)
        acc = Accumulator(net, MS.sgd(net.parameters())[0])
        list(acc.train(MICRO, MoELoss.for_hf_model(net), accum_steps=S.ACCUM))
        return net

    def trainer(model):
        return S.hf_fit(model, [MICRO], exact=True)[0]

    model = M.moe_model("olmoe")
    refs = {accumulator: MS.reference(model, WINDOWS, optimizer=MS.sgd), trainer: MS.reference(model, WINDOWS)}
    for driver, ref in refs.items():
        assert S.params_close(driver(model), ref) is None, driver.__name__

    def own_counts(self, k, router_logits, token_mask):  # the break: C and T of the micro-batch alone
        c, s, rows = router_statistics(router_logits, self.term.top_k, token_mask)
        return balance_loss_part(s, c, rows, rows)

    with monkeypatch.context() as patch:
        patch.setattr(Routing, "part", own_counts)
        for driver, ref in refs.items():
            assert S.max_diff(driver(model), ref) > 1e-6, driver.__name__

    from transformers.models.olmoe import modeling_olmoe

    plain = modeling_olmoe.OlmoeTopKRouter.forward
    with monkeypatch.context() as noisy:  # a router that draws from the global generator (replayed)
        noisy.setattr(modeling_olmoe.OlmoeTopKRouter, "forward",
                      lambda self, h: plain(self, h + 3 * torch.randn(h.shape, dtype=h.dtype)))
        for driver in refs:
            driver(model)  # replayed: trains
        noisy.setattr(Routing, "replay", lambda self, k: None)
        for driver in refs:
            with pytest.raises(ReplayError, match="routed its tokens to other experts"):
                driver(model)
