"""ExactGRPOTrainer and ExactRLOOTrainer under DDP, 2 gloo processes on the CPU (see test_grpo_distributed.py).

One dataset of 8 prompts shared out by TRL's sampler: each rank generates (fixed completions,
grpo_runs.completion) for its share of every generation batch, so the ranks hold different token
counts in every micro-batch. Every rank's recorded micro-batches are gathered, the independent float64
reference (grpo_runs.reference) takes one step per optimizer step over both ranks' micro-batches as one
batch, and rank 0 prints ``PASS <name>: <numbers>`` or ``FAIL <name>: <why>``. The replicas are
compared bit for bit. The ``moe`` scenarios train a tiny Qwen3-MoE (integrations.moe_models) whose
router loss TRL turns on: its load-balancing loss is the step's over both ranks' micro-batches.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # grpo_runs, hf_helpers, integrations.*

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from integrations import grpo_runs as G  # noqa: E402
from integrations.trl_data import float64_log_probs  # noqa: E402
from integrations.scenarios import params_close  # noqa: E402
from distributed.launch import run_modules  # noqa: E402
from hf_worker import identical_replicas  # noqa: E402

torch.set_num_threads(1)
WORLD = int(os.environ["WORLD_SIZE"])
PROMPTS = 2 * G.PROMPTS  # 32 completions: 8 micro-batches of 2 per rank per epoch
HARD = dict(G.SETTINGS["spg 4, GA 2"], beta=0.04, entropy_coef=0.05)
MOE = dict(G.SETTINGS["spg 4, GA 2"], entropy_coef=0.05)  # no KL term (its reference model would load from a folder)
# one loss type per divisor TRL writes (gradaccum.rl.trl_divisor): grpo's rows (sapo and luspo share them),
# dr_grpo's row slots, bnpo's local tokens, dapo's global tokens (cispo and vespo share them). Two ranks change
# only what the step's count sums over; each loss type's own term is asserted in one process (test_grpo.py)
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


def _everyone(recorded: Any) -> list:
    every: list = [None] * WORLD
    dist.all_gather_object(every, recorded)
    return every


def _moe() -> Any:
    from integrations.moe_models import moe_model

    return moe_model("qwen3_moe")


def grpo(loss_type: str, name: str, config: Dict[str, Any], stock_off: bool = True,
         model: Callable[[], Any] = G.base_model) -> str:
    from trl import GRPOTrainer

    from gradaccum.integrations.trl import ExactGRPOTrainer

    cfg = G.loss_config(loss_type, **config)
    return _compare(GRPOTrainer, ExactGRPOTrainer, loss_type, name, cfg, stock_off, rloo=False, model=model)


def rloo(name: str, config: Dict[str, Any], stock_off: bool = False,
         model: Callable[[], Any] = G.base_model) -> str:
    from trl import RLOOTrainer

    from gradaccum.integrations.trl import ExactRLOOTrainer

    return _compare(RLOOTrainer, ExactRLOOTrainer, "rloo", name, dict(config), stock_off, rloo=True, model=model)


def empty_steps(name: str) -> str:
    """dapo with ``mask_truncated_completions``, a step (GA 2, spg 2: one generation batch per rank) of
    only truncated completions on both ranks (skipped: no token anywhere), then one truncated on rank 0
    alone (stepped: rank 1's tokens are the step's), then two whole steps; SGD against the reference
    (whose empty step is a zero gradient), and the state counting one skipped step."""
    completion, calls = G.completion, [0]

    def truncated_first(prompt_ids: Any, j: int) -> list:
        calls[0] += 1  # 4 rows per generation batch: calls 1-4 the first step's, 5-8 the second's
        ids = completion(prompt_ids, j)
        if calls[0] <= 4 or (dist.get_rank() == 0 and calls[0] <= 8):
            ids = ((ids[:-1] + [5]) * G.MAX_COMPLETION)[:G.MAX_COMPLETION]  # 8 tokens, no end: truncated
        return ids

    def state(trainer: Any) -> str:
        got = (trainer.accumulator_state.steps, trainer.accumulator_state.skipped, trainer.state.global_step)
        return "" if got == (3, 1, 3) else f"(steps, skipped, global_step) {got}, want (3, 1, 3)"

    G.completion = truncated_first
    try:
        return _compare(*_grpo_classes(), "dapo", name, dict(gradient_accumulation_steps=2, steps_per_generation=2,
                        mask_truncated_completions=True, loss_type="dapo"), False, rloo=False, model=G.base_model,
                        check=state, before_each=lambda: calls.__setitem__(0, 0))
    finally:
        G.completion = completion


def _grpo_classes() -> tuple:
    from trl import GRPOTrainer

    from gradaccum.integrations.trl import ExactGRPOTrainer

    return GRPOTrainer, ExactGRPOTrainer


def _compare(stock_cls: type, exact_cls: type, loss_type: str, name: str, cfg: Dict[str, Any],
             stock_off: bool, rloo: bool, model: Callable[[], Any], check: Callable[[Any], str] = lambda _: "",
             before_each: Callable[[], None] = lambda: None) -> str:
    if model is G.base_model:  # rank 0's folder: the KL term's reference model is built from it
        model = _everyone(model() if dist.get_rank() == 0 else None)[0]
    else:  # built alike on every rank (unpickled, a model loses transformers' capture of its router logits)
        model = model()
    ref_cfg = {k: v for k, v in cfg.items() if k != "loss_type"}
    runs = []
    for cls in (stock_cls, exact_cls):
        before_each()
        trained, trainer = G.fit(cls, model, prompt_count=PROMPTS, rloo=rloo, **cfg)
        steps = G.steps_of(_everyone(trainer.recorded))
        runs.append((trained, trainer, G.reference(model, steps, loss_type, **ref_cfg)))
    (exact, trainer, ref) = runs[-1]
    count = trainer.last_step_count
    tokens = [[sum(int(mb["completion_mask"].sum()) for s, mb in trainer.recorded if s == step)
               for step in range(trainer.state.global_step)]]
    per_rank = [list(t) for t in zip(*(r[0] for r in _everyone(tokens)))]  # per step: each rank's tokens
    problems = [check(trainer)] if check(trainer) else []
    if count.tokens != sum(per_rank[-1]) or all(len(set(t)) == 1 for t in per_rank):
        problems.append(f"last step's tokens {count.tokens}, per step and rank {per_rank} (want their sum, uneven)")
    if not identical_replicas(exact):
        problems.append("replicas differ")
    mismatch = params_close(exact, ref)
    if mismatch:
        problems.append(f"exact != reference: {mismatch}")
    d_exact, d_stock = G.delta(exact, ref), G.delta(runs[0][0], runs[0][2])  # each against its own run's reference
    if stock_off and d_stock <= 1e-6:
        problems.append(f"stock TRL is not measurably off (delta {d_stock:.2e})")
    numbers = f"delta exact {d_exact:.2e}, stock {d_stock:.2e}; tokens per step and rank {per_rank}"
    return f"FAIL {name}: {'; '.join(problems)} ({numbers})" if problems else f"PASS {name}: {numbers}"


SCENARIOS: Dict[str, Callable[[], str]] = {
    **{f"grpo_ddp_{lt}_kl_entropy": (lambda lt=lt: grpo(lt, f"grpo_ddp_{lt}_kl_entropy", HARD))
       for lt in LOSS_TYPES},
    "grpo_ddp_dapo_short_last_step": lambda: grpo("dapo", "grpo_ddp_dapo_short_last_step", G.SHORT_LAST),
    "rloo_ddp_short_last_step": lambda: rloo("rloo_ddp_short_last_step", G.SHORT_LAST),
    "grpo_ddp_dapo_empty_steps": lambda: empty_steps("grpo_ddp_dapo_empty_steps"),
    # an MoE router loss over both ranks' micro-batches (stock TRL: each micro-batch's over K; RLOO's stock
    # step is otherwise one big batch)
    "grpo_ddp_moe_grpo_entropy": lambda: grpo("grpo", "grpo_ddp_moe_grpo_entropy", MOE, model=_moe),
    "rloo_ddp_moe_short_last_step": lambda: rloo("rloo_ddp_moe_short_last_step", dict(G.SHORT_LAST, beta=0.0),
                                                 stock_off=True, model=_moe),
}


def scenario_context():
    """TRL's fused LM head with its float64 stand-in, on both sides of every comparison."""
    return float64_log_probs()


if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
