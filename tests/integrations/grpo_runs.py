"""GRPO and RLOO runs without generation, and their independent float64 big-batch reference.

TRL's generation is replaced by fixed completions of 1-8 tokens, a function of the prompt and of the
completion's place in its group (:func:`completion`), so every run sees the same completions and
rewards; every micro-batch a trainer trains on is recorded with the optimizer step it belongs to.
:func:`reference` then takes one plain SGD step per recorded step, on the loss type's formula over
the step's whole batch (every micro-batch, every rank) as one scalar, written here from TRL's
documented definitions: it shares no code with gradaccum or with TRL's ``_compute_loss``.

Shared by test_grpo.py, the torchrun worker (grpo_worker.py) and benchmarks/grpo.py.
"""
from __future__ import annotations

import copy
import math
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hf_helpers import VOCAB, llama
from integrations.scenarios import float64_rmsnorm, max_diff
from integrations.trl_data import tokenizer

LR = 0.5
GENERATIONS = 4
MAX_COMPLETION = 8

#: the issue's three settings (per_device_train_batch_size 2, num_generations 4), plus several
#: optimisation passes per generation and a short last step
SETTINGS: Dict[str, Dict[str, int]] = {
    "GA = spg = 4": dict(gradient_accumulation_steps=4, steps_per_generation=4),
    "spg 4, GA 2": dict(gradient_accumulation_steps=2, steps_per_generation=4),
    "spg 2, GA 4": dict(gradient_accumulation_steps=4, steps_per_generation=2),
    "spg 2, GA 2, 2 iterations": dict(gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2),
}
PROMPTS = 4  # 16 completions: 8 micro-batches of 2 per epoch on one process
SHORT_LAST = dict(gradient_accumulation_steps=3, steps_per_generation=2)  # 8 micro-batches: steps of 3, 3, 2


def prompts(count: int) -> List[Dict[str, str]]:
    """``count`` prompts of 2-4 words."""
    g = torch.Generator().manual_seed(100)
    out = []
    for _ in range(count):
        n = int(torch.randint(2, 5, (1,), generator=g))
        out.append({"prompt": " ".join(f"t{i}" for i in torch.randint(1, VOCAB, (n,), generator=g).tolist())})
    return out


def completion(prompt_ids: Sequence[int], j: int) -> List[int]:
    """The ``j``-th completion of a prompt: 1-8 tokens, the longer ones without the end-of-sequence 0
    (truncated), the others ending in it."""
    g = torch.Generator().manual_seed(int(sum((i + 1) * t for i, t in enumerate(prompt_ids))) * 10 + j)
    n = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
    ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
    return ids if n == MAX_COMPLETION else ids[:-1] + [0]


def reward(completions: List[str], **kwargs: Any) -> List[float]:
    """A reward with spread inside every group: the completion's word ids summed, modulo 7."""
    return [float(sum(int(w[1:]) for w in c.split()) % 7) for c in completions]


class Fixed:
    """Mixed in first: generation replaced by :func:`completion`, and each training micro-batch
    recorded as ``(optimizer step, its tensors)``."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations=None):
        seen: Dict[Tuple[int, ...], int] = {}
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            j = seen[key] = seen.get(key, -1) + 1
            out.append(completion(ids, j))
        return out if num_generations is None else (out, None)  # RLOO's returns the ids alone

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            self.recorded.append((self.state.global_step, {k: v.detach().clone() for k, v in inputs.items()
                                                          if isinstance(v, torch.Tensor)}))
        return inputs


def fixed(cls: type) -> type:
    return type(f"Fixed{cls.__name__}", (Fixed, cls), {"recorded": None})


def base_model() -> nn.Module:
    """The tiny float64 Llama (hf_helpers.llama), RMSNorm in float64, saved to a folder TRL can build
    the KL term's reference model from."""
    model = float64_rmsnorm(llama())
    folder = tempfile.mkdtemp(prefix="gradaccum-grpo-")
    model.save_pretrained(folder)
    model.config._name_or_path = folder
    return model


def sgd(params: Any) -> torch.optim.Optimizer:
    """Plain SGD at :data:`LR` (the reference's step)."""
    return torch.optim.SGD(params, lr=LR)


def fit(cls: type, model: nn.Module, *, prompt_count: int = PROMPTS, rloo: bool = False, train: bool = True,
        optimizer: Callable[[Any], torch.optim.Optimizer] = sgd, **config: Any) -> Tuple[nn.Module, Any]:
    """``cls`` (a GRPO or RLOO trainer, made :func:`fixed`) trained one epoch (unless ``train=False``)
    on ``prompt_count`` prompts with a copy of ``model``: ``optimizer`` (plain SGD) at a constant rate,
    no clipping, TRL's defaults otherwise."""
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, RLOOConfig

    transformers.logging.set_verbosity_error()
    model = copy.deepcopy(model)
    settings = dict(output_dir=tempfile.mkdtemp(prefix="gradaccum-grpo-"), num_train_epochs=1, max_grad_norm=0.0,
                    report_to="none", logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True,
                    seed=0, data_seed=0, per_device_train_batch_size=2, num_generations=GENERATIONS,
                    max_completion_length=MAX_COMPLETION, temperature=1.0,
                    model_init_kwargs={"dtype": torch.float64})
    settings.update(config)
    args = (RLOOConfig if rloo else GRPOConfig)(**settings)
    opt = optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = fixed(cls)(model=model, reward_funcs=reward, args=args, processing_class=tokenizer(),
                         train_dataset=Dataset.from_list(prompts(prompt_count)), optimizers=(opt, sched))
    if trainer.ref_model is not None:
        float64_rmsnorm(trainer.ref_model)
    trainer.recorded = []
    trainer.remove_callback(transformers.PrinterCallback)
    if train:
        trainer.train()
    return model, trainer


# -- the independent reference: one float64 big-batch step per optimizer step ------------------------

def _default(cfg: Dict[str, Any], name: str) -> Any:
    """``cfg[name]``, else GRPOConfig's default for it."""
    from trl import GRPOConfig

    return cfg[name] if name in cfg else GRPOConfig.__dataclass_fields__[name].default


def _token_terms(model: nn.Module, mb: Dict[str, torch.Tensor], loss_type: str, cfg: Dict[str, Any], routed: list):
    """Per-token policy terms ``l``, the mask ``m``, the entropies ``H`` of one recorded micro-batch
    (GRPO), or per-sequence terms (RLOO: ``loss_type == "rloo"``); an MoE model's router logits and
    token mask appended to ``routed``."""
    prompt, completion_ids = mb["prompt_ids"], mb["completion_ids"]
    ids = torch.cat([prompt, completion_ids], dim=1)
    attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
    width = completion_ids.shape[1]
    out = model(input_ids=ids, attention_mask=attention)
    if getattr(out, "router_logits", None) is not None:
        routed.append((out.router_logits, attention.reshape(-1)))
    logits = out.logits[:, -width - 1:-1] / cfg.get("temperature", 1.0)
    log_p = logits.log_softmax(-1)
    logp = log_p.gather(-1, completion_ids[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    m = mb["completion_mask"].to(logp.dtype)
    adv = mb["advantages"][:, None]
    eps_low = _default(cfg, "epsilon")
    eps_high = _default(cfg, "epsilon_high") or eps_low
    if loss_type == "rloo":
        ratio = torch.exp((logp * m).sum(1, keepdim=True) - mb["old_logps"][:, None])
        term = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
        return term.squeeze(1), m, entropy
    old = mb.get("old_per_token_logps", logp.detach())
    log_ratio = logp - old
    if cfg.get("importance_sampling_level", "token") == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    if loss_type == "vespo":  # TRL's gamma weights of the sequence's ratio (a weight, no normalisation in it)
        from trl import GRPOTrainer

        phi = GRPOTrainer.get_gamma_weights(adv, logp - old, m, None, **{k[6:]: _default(cfg, k) for k in (
            "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})
        term = -phi * adv * logp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, _default(cfg, "sapo_temperature_pos"),
                          _default(cfg, "sapo_temperature_neg"))
        term = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif loss_type == "cispo":
        term = -ratio.clamp(max=eps_high).detach() * adv * logp
    else:
        term = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    beta = cfg.get("beta", 0.0)
    if beta:
        d = mb["ref_per_token_logps"] - logp
        kl = torch.exp(d) - d - 1
        term = term + beta * (kl * ratio if _default(cfg, "use_bias_correction_kl") else kl)
    return term.expand_as(m), m, entropy


def load_balancing_loss(routed: Sequence[Tuple[Sequence[torch.Tensor], torch.Tensor]], top_k: int) -> torch.Tensor:
    """transformers' load-balancing loss (``load_balancing_loss_func``, as documented) over every forward
    in ``routed`` as one batch: ``E * sum_e (C_e / T) (P_e / T)``, ``C_e`` the top-k choices of expert e
    and ``P_e`` its summed router probability over every layer's unmasked tokens, ``T`` those rows."""
    chosen = probs = rows = 0.0
    for layers, mask in routed:
        for logits in layers:
            p = logits.softmax(-1) * mask[:, None]
            top = torch.zeros_like(p).scatter(-1, logits.topk(top_k, dim=-1).indices, 1.0) * mask[:, None]
            chosen, probs, rows = chosen + top.detach().sum(0), probs + p.sum(0), rows + mask.sum()
    return chosen.shape[-1] * (chosen / rows * probs / rows).sum()


def big_batch_loss(model: nn.Module, step: Sequence[Dict[str, torch.Tensor]], loss_type: str,
                   cfg: Dict[str, Any], entropy_coef: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The loss type's formula over the step's whole batch (see gradaccum.integrations.trl_rl.ExactGRPOTrainer),
    with the entropy bonus at ``entropy_coef`` (default: ``cfg``'s), and the step's mean entropy; an MoE model's
    ``router_aux_loss_coef`` (cfg's, else its config's) times the step's load-balancing loss added."""
    routed: list = []
    parts = [_token_terms(model, mb, loss_type, cfg, routed) for mb in step]
    aux = cfg.get("router_aux_loss_coef")
    aux = getattr(model.config, "router_aux_loss_coef", 0.0) if aux is None else aux
    lbl = load_balancing_loss(routed, model.config.num_experts_per_tok) if routed and aux else None
    balance = 0.0 if lbl is None else aux * lbl
    model.step_balance.append(None if lbl is None else lbl.item())  # as TRL logs it: aux_loss
    rows = sum(m.shape[0] for _, m, _ in parts)
    tokens = sum(m.sum() for _, m, _ in parts).clamp(min=1.0)
    if loss_type == "rloo":
        return sum(t.sum() for t, _, _ in parts) / rows + balance, torch.tensor(0.0)
    if loss_type in ("grpo", "sapo"):
        total = sum(((t * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() for t, m, _ in parts) / rows
    elif loss_type == "luspo":
        total = sum((t * m).sum() for t, m, _ in parts) / rows
    elif loss_type == "dr_grpo":
        total = sum((t * m).sum() for t, m, _ in parts) / (rows * cfg.get("max_completion_length", MAX_COMPLETION))
    else:  # bnpo, dapo, cispo: a token mean over the step
        total = sum((t * m).sum() for t, m, _ in parts) / tokens
    entropy = sum((h * m).sum() for _, m, h in parts) / tokens  # the step's token mean
    coef = cfg.get("entropy_coef", 0.0) if entropy_coef is None else entropy_coef
    return total - coef * entropy + balance, entropy.detach()


def steps_of(recorded: Sequence[Sequence[Tuple[int, Dict[str, torch.Tensor]]]]) -> List[List[Dict[str, torch.Tensor]]]:
    """Every rank's recorded micro-batches grouped by optimizer step (rank 0's first). A skipped step's
    micro-batches (no completion token) are recorded under the next step's number, as the Trainer's step
    count did not move: they add no token to that step, so it is the step they were skipped from."""
    count = 1 + max(s for rank in recorded for s, _ in rank)
    return [[mb for rank in recorded for s, mb in rank if s == step] for step in range(count)]


def reference(model: nn.Module, steps: Sequence[Sequence[Dict[str, torch.Tensor]]], loss_type: str,
              **cfg: Any) -> nn.Module:
    """One plain SGD step (rate :data:`LR`) per step on :func:`big_batch_loss`, from a copy of ``model``;
    under ``use_adaptive_entropy`` the entropy coefficient follows TRL's documented controller (applied
    once the previous step's entropy is at or below ``entropy_target``, then moved by
    ``entropy_coef_delta`` within its bounds)."""
    model = copy.deepcopy(model).train()
    model.step_losses = []  # each step's loss, to compare with what the trainer logs
    model.step_balance = []  # each step's load-balancing loss (an MoE model's router loss; None without)
    coef, last = cfg.get("entropy_coef", 0.0), math.inf  # the adaptive controller: TRL's documented rule
    for step in steps:
        model.zero_grad(set_to_none=True)
        adaptive = cfg.get("use_adaptive_entropy", False)
        applied = coef if not adaptive or last <= _default(cfg, "entropy_target") else 0.0
        loss, entropy = big_batch_loss(model, step, loss_type, cfg, applied)
        if adaptive:  # the step's entropy moves the coefficient of the next step
            last, delta_ = entropy.item(), _default(cfg, "entropy_coef_delta")
            coef = (min(coef + delta_, _default(cfg, "entropy_coef_max")) if last <= _default(cfg, "entropy_target")
                    else max(coef - delta_, _default(cfg, "entropy_coef_min")))
        model.step_losses.append(loss.item())
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return model


def delta(model: nn.Module, ref: nn.Module) -> float:
    """The largest parameter difference: the issue's Δ."""
    return max_diff(model, ref)


def loss_config(loss_type: str, **extra: Any) -> Dict[str, Any]:
    """GRPOConfig keywords for ``loss_type`` (LUSPO needs sequence-level importance sampling)."""
    cfg: Dict[str, Any] = {"loss_type": loss_type}
    if loss_type == "luspo":
        cfg["importance_sampling_level"] = "sequence"
    cfg.update(extra)
    return cfg


def run(cls: type, model: nn.Module, loss_type: str, *, rloo: bool = False, **config: Any) -> Tuple[float, Any]:
    """(Δ, the trainer) of ``cls`` on one process against the reference of its own run's micro-batches
    (kept as ``trainer.reference``)."""
    cfg = dict(config) if rloo else loss_config(loss_type, **config)
    trained, trainer = fit(cls, model, rloo=rloo, **cfg)
    trainer.reference = reference(model, steps_of([trainer.recorded]), "rloo" if rloo else loss_type,
                                  **{k: v for k, v in cfg.items() if k != "loss_type"})
    return delta(trained, trainer.reference), trainer


def run_pair(stock_cls: type, exact_cls: type, model: nn.Module, loss_type: str, *, rloo: bool = False,
             **config: Any) -> Tuple[float, float, Any]:
    """(Δ stock, Δ exact, the exact trainer): :func:`run` for each."""
    stock, _ = run(stock_cls, model, loss_type, rloo=rloo, **config)
    exact, trainer = run(exact_cls, model, loss_type, rloo=rloo, **config)
    return stock, exact, trainer
