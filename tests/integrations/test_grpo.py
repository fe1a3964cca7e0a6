"""TRL's GRPO and RLOO as one big batch per optimizer step (issue 39), on one process.

Generation is replaced by fixed completions of 1-8 tokens (grpo_runs.completion), so every run sees
the same completions and rewards; a tiny float64 Llama (RMSNorm in float64, TRL's fused LM head
swapped for trl_data.Float64LogProbs) is trained with plain SGD. Each run is compared with its own
independent reference (grpo_runs.reference): one float64 SGD step per optimizer step on the loss
type's formula over the step's recorded micro-batches as one batch. The exact trainers match at
rtol 1e-10; the stock trainers are measured beside them and asserted off (> 1e-6) where they are.
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")

from integrations import grpo_runs as G  # noqa: E402
from integrations import trl_data as T  # noqa: E402

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "sapo", "luspo", "cispo", "vespo")
#: one generation batch feeding two optimizer steps (old log-probabilities computed, ratios away from 1),
#: the KL term (bias-corrected, TRL's default) and the entropy bonus on
HARD = dict(G.SETTINGS["spg 4, GA 2"], beta=0.04, entropy_coef=0.05)


@pytest.fixture(autouse=True)
def float64_head():
    with T.float64_log_probs():
        yield


@pytest.fixture(scope="module")
def model():
    return G.base_model()


def _pair(model, loss_type, **config):
    from trl import GRPOTrainer

    from gradaccum.integrations.trl import ExactGRPOTrainer

    return G.run_pair(GRPOTrainer, ExactGRPOTrainer, model, loss_type, **config)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_is_one_big_batch_with_kl_and_entropy_bonus(model, loss_type):
    """Every loss type equals its formula over the step's whole batch, where stock TRL is off by more
    than 1e-6: bnpo, dapo, cispo and vespo normalise by a micro-batch's or the generation batch's
    tokens, and every loss type takes the entropy bonus as each micro-batch's token mean over K."""
    stock, exact, trainer = _pair(model, loss_type, **HARD)
    assert exact < 1e-10 and stock > 1e-6, (exact, stock)
    last = [mb for s, mb in trainer.recorded if s == trainer.state.global_step - 1]  # counted before they ran
    assert trainer.last_step_count.tokens == sum(int(mb["completion_mask"].sum()) for mb in last)
    assert trainer.last_step_count.rows == 4 == sum(mb["completion_mask"].shape[0] for mb in last)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == trainer.state.global_step == 4
    assert all({"kl", "entropy", "policy_loss", "entropy_coef"} <= set(h) for h in logs), sorted(logs[-1])
    assert "reward" in logs[0]  # TRL logs rewards where it generates
    logged = [h["loss"] for h in logs]  # the step's loss, every micro-batch on every rank, as one batch
    assert logged == pytest.approx(trainer.reference.step_losses, rel=1e-6, abs=1e-7), logged
    if loss_type == "dapo":  # evaluation is TRL's own: generated, scored, its loss and metrics
        from datasets import Dataset

        metrics = trainer.evaluate(Dataset.from_list(G.prompts(2)))
        assert {"eval_loss", "eval_entropy", "eval_reward"} <= set(metrics), metrics


#: where stock dapo (TRL's default) is one big batch on one process: a step that is one whole
#: generation batch (its normaliser is then the step's tokens)
STOCK_DAPO_EXACT = {"GA = spg = 4", "spg 2, GA 2, 2 iterations"}


@pytest.mark.parametrize("setting", [s for s in G.SETTINGS if s != "spg 4, GA 2"] + ["short last step"])
def test_dapo_is_one_big_batch_in_every_setting(model, setting):
    """TRL's default loss type, without KL or entropy bonus, over the issue's settings, several
    optimisation passes per generation, and a short last step (micro-batches 3, 3, 2)."""
    config = G.SHORT_LAST if setting == "short last step" else G.SETTINGS[setting]
    stock, exact, trainer = _pair(model, "dapo", **config)
    assert exact < 1e-10, exact
    if setting in STOCK_DAPO_EXACT:
        assert stock < 1e-10, stock
    else:
        assert stock > 1e-6, stock
    if setting == "short last step":
        assert trainer.state.global_step == 3 and trainer.last_step_count.rows == 4


def test_adaptive_entropy_bonus_is_the_step_token_mean(model):
    """Adaptive entropy control (Skywork-OR1): off in the first step, then on at a coefficient that
    grows every step (the tiny model's entropy, about 3.9, is under the target 4.0); each step's bonus
    the step's token mean. Stock applies each micro-batch's token mean over K."""
    stock, exact, trainer = _pair(model, "grpo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=4.0,
                                  entropy_coef_delta=0.05, **G.SETTINGS["spg 2, GA 4"])
    assert exact < 1e-10 and stock > 1e-6, (exact, stock)
    assert [h["entropy_coef"] for h in trainer.state.log_history if "loss" in h] == pytest.approx([0.1, 0.15])


def test_rloo_is_the_mean_over_the_step_sequences(model):
    """RLOO's per-sequence terms averaged over the step's sequences (short last step included). Stock
    RLOO is exact here too (every micro-batch holds the same number of sequences): measured, not off."""
    from trl import RLOOTrainer

    from gradaccum.integrations.trl import ExactRLOOTrainer

    stock, exact, trainer = G.run_pair(RLOOTrainer, ExactRLOOTrainer, model, "rloo", rloo=True, **G.SHORT_LAST)
    assert exact < 1e-10 and stock < 1e-10, (exact, stock)
    assert trainer.state.global_step == 3


def test_a_wrong_step_count_is_caught(model, monkeypatch):
    """The count the weights divide by is what the tests see: one more token (or sequence) in a step
    moves the parameters by more than 1e-6 from the reference."""
    from gradaccum import rl

    counted = rl.step_items
    monkeypatch.setattr(rl, "step_items", lambda *a: counted(*a) + 1)
    from gradaccum.integrations.trl import ExactGRPOTrainer

    for loss_type in ("dapo", "grpo"):
        exact, _ = G.run(ExactGRPOTrainer, model, loss_type, **G.SETTINGS["spg 2, GA 4"])
        assert exact > 1e-6, (loss_type, exact)


def _trainer(model, **config):
    from gradaccum.integrations.trl import ExactGRPOTrainer

    return G.fit(ExactGRPOTrainer, model, train=False, **{**G.SETTINGS["spg 2, GA 4"], **config})


@pytest.mark.parametrize("config, match", [
    (dict(top_entropy_quantile=0.2), r"top_entropy_quantile=0\.2 .* couples .* top_entropy_quantile=1\.0"),
])
def test_what_no_weighting_makes_exact_is_refused(model, config, match):
    from gradaccum.errors import NotExactError

    with pytest.raises(NotExactError, match=match):
        _trainer(model, **config)


def test_an_unknown_loss_type_is_refused_by_name(model, monkeypatch):
    from gradaccum.errors import NotExactError
    from gradaccum import rl

    monkeypatch.delitem(rl.ITEMS, "cispo")  # as a loss type TRL adds later would be
    with pytest.raises(NotExactError, match=r"loss_type='cispo' is not one .* loss_type='dapo'"):
        _trainer(model, loss_type="cispo")


#: an MoE model's router loss (its config's router_aux_loss_coef 0.2, which TRL turns on), one step of 4
#: micro-batches of 2 sequences then one of 4 (GA 4, spg 2, 3 prompts)
MOE = dict(G.SETTINGS["spg 2, GA 4"], prompt_count=3)


@pytest.mark.parametrize("trainer, loss_type, family", [("grpo", "grpo", "qwen3_moe"), ("grpo", "dapo", "mixtral"),
                                                        ("rloo", "rloo", "qwen2_moe")])
def test_an_moe_router_loss_is_the_step_whole_batch(trainer, loss_type, family):
    """Issue 39: an MoE model's load-balancing loss is the step's whole batch's (expert counts and
    routed rows of every micro-batch, counted before the first backward), added at TRL's coefficient to
    the loss type's formula: the reference writes transformers' formula over the step's forwards as one
    batch. Stock TRL adds each micro-batch's own loss over K: off, for GRPO where its policy term is
    exact (``grpo``) and for RLOO, whose stock step is otherwise one big batch."""
    from trl import GRPOTrainer, RLOOTrainer

    from gradaccum.integrations.trl import ExactGRPOTrainer, ExactRLOOTrainer
    from integrations.moe_models import moe_model

    classes = (GRPOTrainer, ExactGRPOTrainer) if trainer == "grpo" else (RLOOTrainer, ExactRLOOTrainer)
    stock, exact, run = G.run_pair(*classes, moe_model(family), loss_type, rloo=trainer == "rloo", **MOE,
                                    **({"beta": 0.0} if trainer == "rloo" else {}))  # no KL: no reference model
    assert exact < 1e-10 and stock > 1e-6, (exact, stock)
    assert run.router_balance is not None and run.router_balance.coef == 0.2
    logs = [h for h in run.state.log_history if "loss" in h]
    assert len(logs) == run.state.global_step == 2
    assert [h["loss"] for h in logs] == pytest.approx(run.reference.step_losses, rel=1e-6, abs=1e-7)
    # the logged aux_loss is the step's load-balancing loss, every micro-batch's routing as one batch
    assert [h["aux_loss"] for h in logs] == pytest.approx(run.reference.step_balance, rel=1e-10)


def test_router_counts_from_the_micro_batch_are_caught(monkeypatch):
    """The load-balancing part of each micro-batch with its own expert counts and rows (what TRL does)
    instead of the step's: the run leaves the reference by more than 1e-6."""
    from gradaccum._maths import router_statistics
    from gradaccum.integrations.trl import ExactGRPOTrainer
    from gradaccum.moe import Routing
    from integrations.moe_models import moe_model

    part = Routing.part

    def from_the_micro_batch(self, k, router_logits, token_mask):
        counts, _, rows = router_statistics(router_logits, self.term.top_k, token_mask)
        self.counts, self.rows = counts.detach(), rows.detach()
        return part(self, k, router_logits, token_mask)

    monkeypatch.setattr(Routing, "part", from_the_micro_batch)
    exact, _ = G.run(ExactGRPOTrainer, moe_model("qwen3_moe"), "grpo", **MOE)
    assert exact > 1e-6, exact


def test_a_router_loss_gradaccum_cannot_compute_is_refused_with_the_fix():
    from gradaccum.errors import NotExactError
    from integrations.moe_models import moe_model

    model = moe_model("qwen3_moe")
    model.config.model_type = "jetmoe"  # a family whose router loss is not transformers' load_balancing_loss_func
    with pytest.raises(NotExactError, match=r"router_aux_loss_coef=0\.2 .*model \(jetmoe\) .*supported: mixtral.*"
                                            r"GRPOConfig\(\.\.\., router_aux_loss_coef=0\.0\)"):
        _trainer(model)


def test_a_step_without_completion_tokens_is_skipped(model, monkeypatch):
    """Issue 39: a step whose completions hold no token (all truncated, masked by
    ``mask_truncated_completions``) is skipped as every gradaccum driver skips an empty window: AdamW's
    weight decay does not act (stock TRL's step moves every weight), the scheduler does not step, the
    state counts it; the next step is one big batch (SGD against the reference)."""
    import torch
    from transformers import TrainerCallback

    from gradaccum.integrations.trl import ExactGRPOTrainer
    from trl import GRPOTrainer

    calls = [0]
    completion = G.completion

    def first_step_truncated(prompt_ids, j):  # the first generation batch (the first step's 4 rows): 8 tokens, no EOS
        calls[0] += 1
        ids = completion(prompt_ids, j)
        return (ids[:-1] + [5]) * G.MAX_COMPLETION if calls[0] <= 4 else ids

    monkeypatch.setattr(G, "completion", lambda ids, j: first_step_truncated(ids, j)[:G.MAX_COMPLETION])
    setting = dict(G.SETTINGS["spg 2, GA 2, 2 iterations"], num_iterations=1, prompt_count=2,
                   mask_truncated_completions=True, loss_type="dapo")

    class Weights(TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.after = trainer, []

        def on_step_end(self, args, state, control, **kwargs):
            self.after.append([p.detach().clone() for p in self.trainer.model.parameters()])

    adamw = lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)  # noqa: E731
    before = [p.detach().clone() for p in model.parameters()]
    runs = {}
    for cls in (GRPOTrainer, ExactGRPOTrainer):
        calls[0] = 0
        _, trainer = G.fit(cls, model, train=False, optimizer=adamw, **setting)
        trainer.add_callback(weights := Weights(trainer))
        if cls is ExactGRPOTrainer:
            with pytest.warns(UserWarning, match=r"counted 0 items.* no token on any rank"):
                trainer.train()
        else:
            trainer.train()
        runs[cls] = trainer, weights.after
    (stock, stock_after), (exact, exact_after) = runs[GRPOTrainer], runs[ExactGRPOTrainer]
    assert [mb["completion_mask"].sum().item() for _, mb in exact.recorded][:2] == [0, 0]
    assert all(torch.equal(a, b) for a, b in zip(exact_after[0], before)), "the empty step moved the weights"
    assert not any(torch.equal(a, b) for a, b in zip(stock_after[0], before) if b.abs().max() > 0)  # decay acts
    state = exact.accumulator_state
    assert (state.steps, state.skipped, exact.state.global_step) == (1, 1, 1)
    assert {int(exact.optimizer.state[p]["step"]) for p in exact.model.parameters()} == {1}
    assert exact.lr_scheduler.last_epoch == 1 and stock.lr_scheduler.last_epoch == 2
    assert len([h for h in exact.state.log_history if "loss" in h]) == 1
    calls[0] = 0  # with SGD, against the reference (whose empty step is a zero gradient)
    with pytest.warns(UserWarning, match=r"counted 0 items"):
        delta, sgd = G.run(ExactGRPOTrainer, model, **setting)
    assert delta < 1e-10 and sgd.accumulator_state.skipped == 1, delta


def test_exact_trainer_first_refuses_grpo_and_rloo_naming_the_drop_in():
    """Issue 39 item 3: ExactTrainer cannot count a batch GRPO generates inside training_step; the
    refusal names the drop-in instead of leading to exact_items = 'rows' (which fails in train())."""
    from trl import GRPOTrainer, RLOOTrainer

    from gradaccum.integrations.hf_trainer import ExactTrainer

    for cls, drop_in in ((GRPOTrainer, "ExactGRPOTrainer"), (RLOOTrainer, "ExactRLOOTrainer")):
        for declared in ({}, {"exact_items": "rows"}):
            with pytest.raises(TypeError, match=rf"generates its micro-batches .* gradaccum\.integrations\.trl "
                                                rf"import {drop_in}"):
                type("X", (ExactTrainer, cls), dict(declared))


#: one generation batch (one prompt's 4 completions) per step, so every step ends at a generation boundary;
#: 4 prompts in dataset order: 4 steps of 2 micro-batches, the second (prompt 1) without completion tokens
RESUME = dict(G.SETTINGS["spg 2, GA 2, 2 iterations"], num_iterations=1, prompt_count=4, shuffle_dataset=False,
              mask_truncated_completions=True, loss_type="dapo")


def _truncate_prompt(monkeypatch, index):
    """Prompt ``index``'s completions all truncated (8 tokens, no end of sequence): masked out, its step empty."""
    target = [int(w[1:]) for w in G.prompts(RESUME["prompt_count"])[index]["prompt"].split()]
    completion = G.completion

    def truncated(ids, j):
        out = completion(ids, j)
        return ((out[:-1] + [5]) * G.MAX_COMPLETION)[:G.MAX_COMPLETION] if list(ids) == target else out

    monkeypatch.setattr(G, "completion", truncated)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_a_resume_across_a_skipped_step_ends_where_the_uninterrupted_run_ends(model, monkeypatch, tmp_path, kind):
    """Issue 39: a run saved after a skipped step (steps 1, skipped, 2: checkpoint-2 holds 3 steps' data)
    and resumed from that checkpoint trains the micro-batches the uninterrupted run trained after it, no
    other, and ends bit-identical, with the same steps and skipped steps. RLOO averages over sequences, so
    its step of masked completions is taken (checkpoint-2 holds 2 steps' data). The checkpoint is at a
    generation boundary (each step one generation batch): TRL keeps its generation buffer out of
    checkpoints, so a resume inside a generation generates it again (from the restored policy)."""
    import contextlib

    import torch

    from gradaccum.integrations.trl import ExactGRPOTrainer, ExactRLOOTrainer

    _truncate_prompt(monkeypatch, 1)
    rloo = kind == "rloo"
    cls, skipped = (ExactRLOOTrainer, 0) if rloo else (ExactGRPOTrainer, 1)
    config = dict(RESUME, save_strategy="steps", save_steps=2, output_dir=str(tmp_path), rloo=rloo)
    if rloo:  # no loss types; no KL term (no reference model)
        del config["loss_type"]
        config["beta"] = 0.0
    with pytest.warns(UserWarning, match=r"counted 0 items") if skipped else contextlib.nullcontext():
        whole, uninterrupted = G.fit(cls, model, **config)
    assert [int(mb["completion_mask"].sum()) for _, mb in uninterrupted.recorded][2:4] == [0, 0]
    state = uninterrupted.accumulator_state
    assert (state.steps, state.skipped, uninterrupted.state.global_step) == (4 - skipped, skipped, 4 - skipped)

    resumed_model, resumed = G.fit(cls, model, train=False, **config)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    after = uninterrupted.recorded[2 * (2 + skipped):]  # the micro-batches of the steps after the checkpoint's
    assert len(resumed.recorded) == len(after) == 2 * (2 - skipped)
    for (_, mine), (_, theirs) in zip(resumed.recorded, after):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), "other data"
    state = resumed.accumulator_state
    assert (state.steps, state.skipped, resumed.state.global_step) == (4 - skipped, skipped, 4 - skipped)
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.parameters(), whole.parameters()))


#: TRL's adaptive controller under a target the tiny model's entropy (about 3.9) is under (the coefficient
#: grows) and over (it shrinks and the bonus stays off): the coefficient logged after each step taken
CONTROLLERS = {"under the target": (dict(entropy_coef=0.05, entropy_target=4.0), [0.1, 0.15, 0.2]),
               "over the target": (dict(entropy_coef=0.15, entropy_target=3.0), [0.1, 0.05, 0.0])}


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_skipped_step_leaves_the_adaptive_entropy_controller_alone(model, monkeypatch, controller):
    """Issue 39: TRL's adaptive entropy controller reads a step without tokens as entropy 0 (at or under any
    target), which would move the coefficient up and turn the bonus on for the next step; a skipped step
    keeps the last step's decision, and its log of the coefficient goes with it. Steps: taken, skipped,
    taken, taken. The reference records the skipped step's micro-batches under the next step (the step
    count did not move), where they hold no token: one step, one move of the controller."""
    from gradaccum.integrations.trl import ExactGRPOTrainer

    _truncate_prompt(monkeypatch, 1)
    config, logged = CONTROLLERS[controller]
    with pytest.warns(UserWarning, match=r"counted 0 items"):
        delta, trainer = G.run(ExactGRPOTrainer, model, **RESUME, use_adaptive_entropy=True, entropy_coef_delta=0.05,
                               **config)
    assert delta < 1e-10 and trainer.accumulator_state.skipped == 1, delta
    assert [h["entropy_coef"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(logged)
    assert trainer.entropy_coef == pytest.approx(logged[-1]) and 3.0 < trainer._last_world_entropy <= 4.0


def test_a_resume_inside_a_generation_trains_each_step_on_its_generation_batch(model, tmp_path):
    """Issue 39: a checkpoint inside a generation (spg 4, GA 2: after the first of the two steps one
    generation batch feeds) cannot resume bit-identical, as TRL keeps its generation buffer out of the
    checkpoint (the resume generates that batch again, its old log-probabilities from the restored
    policy). The resume still trains each step on the prompts the uninterrupted run trained it on: the
    second half of the first generation batch, then the second one. Stock TRL restarts its micro-batch
    counter at 0 and trains the first generation batch's prompts in a step that should train the second's."""
    from trl import GRPOTrainer

    from gradaccum.integrations.trl import ExactGRPOTrainer

    setting = dict(G.SETTINGS["spg 4, GA 2"], save_strategy="steps", save_steps=1)
    prompts_of = {}
    for cls in (GRPOTrainer, ExactGRPOTrainer):
        _, whole = G.fit(cls, model, output_dir=str(tmp_path / cls.__name__), **setting)
        order = {}  # each prompt's generation batch (two prompts of four completions each) in the uninterrupted run
        for _, mb in whole.recorded:
            for row in mb["prompt_ids"].tolist():
                order.setdefault(tuple(row), len(order) // 2)
        assert len(order) == 4 and sorted(set(order.values())) == [0, 1] and whole.state.global_step == 4
        _, resumed = G.fit(cls, model, train=False, output_dir=str(tmp_path / cls.__name__), **setting)
        resumed.train(resume_from_checkpoint=str(tmp_path / cls.__name__ / "checkpoint-1"))
        assert len(resumed.recorded) == 6 and resumed.state.global_step == 4
        prompts_of[cls] = [(step, {order[tuple(row)] for row in mb["prompt_ids"].tolist()})
                           for step, mb in resumed.recorded]
    assert prompts_of[ExactGRPOTrainer] == [(1, {0}), (1, {0}), (2, {1}), (2, {1}), (3, {1}), (3, {1})]
    assert prompts_of[GRPOTrainer][2] == (2, {0}), prompts_of[GRPOTrainer]  # stock: the first batch again


def test_nonfinite_is_the_drivers_argument_checked_before_the_trainer_is_built():
    """GRPO and RLOO take ``nonfinite=`` as every Trainer driver does (the verdict itself is the one
    test_hf_trainer.py and test_sentence_transformers.py run); a value other than 'skip' and 'raise' is
    refused naming the argument and the fix before TRL builds anything."""
    from gradaccum import ConfigurationError
    from gradaccum.integrations.trl import ExactGRPOTrainer, ExactRLOOTrainer

    for cls in (ExactGRPOTrainer, ExactRLOOTrainer):
        with pytest.raises(ConfigurationError, match=rf"{cls.__name__}\(nonfinite='skipped'\): nonfinite must be"):
            cls(model=None, nonfinite="skipped")
