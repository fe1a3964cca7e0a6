"""A Hugging Face mixture-of-experts model, read from its config and outputs (transformers is not imported):
the load-balancing term its config adds to its loss (:func:`aux_term`), its router logits and the tokens they
balance, and the causal LM's loss that :meth:`gradaccum.MoELoss.for_hf_model` trains."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .._maths import target_count
from ..errors import ConfigurationError, NotExactError
from ..losses import causal_lm_loss

__all__ = ["RouterBalance", "BALANCED_FAMILIES", "aux_term", "refuse_aux_term", "balance_hint", "router_logits_of",
           "hf_token_mask", "hf_routing", "causal_lm_parts"]

#: the model types whose load-balancing loss is transformers' ``load_balancing_loss_func`` as
#: :func:`gradaccum._maths.balance_loss_part` computes it (tested against each family's own loss)
BALANCED_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: where other models keep the weight of a router loss of their own (JetMoe, DBRX, ...)
_OTHER_WEIGHTS = ("aux_loss_coef", "moe_aux_loss_coef", "router_z_loss_coef")
#: ``(loss, num_items, router_logits, token_mask)``, the fields of a :class:`gradaccum.MoEOutput`
Routed = Tuple[Optional[torch.Tensor], Any, List[torch.Tensor], Optional[torch.Tensor]]


@dataclass(frozen=True)
class RouterBalance:
    """A model's load-balancing term: ``coef * LBL`` over ``num_experts`` experts, ``top_k`` per token."""

    num_experts: int
    top_k: int
    coef: float


def text_config(config: Any) -> Any:
    """A multimodal config's text config (the one its MoE layers read), else ``config``."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def aux_term(config: Any) -> Optional[RouterBalance]:
    """The load-balancing term a Hugging Face config adds to the model's loss, or None: the model returns its
    router logits (``output_router_logits``) and weighs them by a nonzero ``router_aux_loss_coef``.

    >>> class Config: output_router_logits, router_aux_loss_coef, num_local_experts, num_experts_per_tok = True, 0.02, 8, 2
    >>> aux_term(Config())
    RouterBalance(num_experts=8, top_k=2, coef=0.02)
    >>> Config.router_aux_loss_coef = 0.0; aux_term(Config()) is None
    True
    """
    text = text_config(config)
    coef = getattr(text, "router_aux_loss_coef", 0.0) or 0.0
    if not getattr(text, "output_router_logits", False):
        return None
    # a router term gradaccum cannot compute over the window: refused, never trained without it in silence
    family = getattr(text, "model_type", None)
    others = {name: getattr(text, name) for name in _OTHER_WEIGHTS if getattr(text, name, 0)}
    ffn = getattr(text, "ffn_config", None)  # DBRX's: an object, or a dict
    ffn_weight = ffn.get("moe_loss_weight") if isinstance(ffn, dict) else getattr(ffn, "moe_loss_weight", 0)
    if ffn_weight:
        others["ffn_config.moe_loss_weight"] = ffn_weight
    if others or (coef and family is not None and family not in BALANCED_FAMILIES):
        weights = ", ".join(f"{k}={v}" for k, v in {**({"router_aux_loss_coef": coef} if coef else {}), **others}.items())
        raise NotExactError(
            f"the model's config ({family}) has output_router_logits=True and {weights}: its loss adds a router "
            f"term gradaccum does not compute over the window (supported: {', '.join(BALANCED_FAMILIES)}), so it "
            "would be dropped or computed per micro-batch. Set output_router_logits=False (or that weight to 0) to "
            "train without it")
    if not coef:
        return None
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    return RouterBalance(int(experts or 0), int(getattr(text, "num_experts_per_tok", 0) or 0), float(coef))


def refuse_aux_term(config: Any, where: str, fix: str) -> None:
    """Raise :class:`~gradaccum.NotExactError` when ``config`` adds a load-balancing term that ``where``
    would compute per micro-batch (or drop), naming the config's values and ``fix``."""
    term = aux_term(config)
    if term is not None:
        raise NotExactError(
            f"{where}: the model's config has output_router_logits=True and router_aux_loss_coef={term.coef}, so its "
            f"loss adds a load-balancing term (E={term.num_experts} experts, top-{term.top_k}) whose expert fractions "
            f"are statistics of the whole batch; {where} would compute it per micro-batch, so the step would not be "
            f"the big batch's. {fix}")


def balance_hint(model: nn.Module) -> Optional[str]:
    """The checker's hint for a model whose loss adds a load-balancing term (None without one)."""
    try:
        term = next((t for t in (aux_term(getattr(m, "config", None)) for m in model.modules()) if t is not None), None)
    except NotExactError as unknown:
        return f"{unknown}; per micro-batch that term is another objective"
    if term is None:
        return None
    return (f"the model's loss adds an MoE router load-balancing term (router_aux_loss_coef={term.coef}, "
            f"{term.num_experts} experts, top-{term.top_k}) whose expert fractions are statistics of the whole "
            "batch, so per micro-batch it is another objective: train with gradaccum.MoELoss.for_hf_model(model) "
            "(Accumulator) or ExactTrainer / ExactSFTTrainer, which compute it over the window, or set "
            "router_aux_loss_coef=0.0")


@contextlib.contextmanager
def router_logits_of(model: nn.Module) -> Iterator[List[torch.Tensor]]:
    """The router logits of every forward of ``model`` inside the block, in layer order, for forwards that do
    not return them (TRL's fused LM head) or are asked not to (so that the model computes no per-batch aux loss
    of its own): hooks on the router class named by ``_can_record_outputs["router_logits"]`` (transformers 5)."""
    spec = next((m._can_record_outputs["router_logits"] for m in model.modules()
                 if "router_logits" in (getattr(m, "_can_record_outputs", None) or {})), None)
    if spec is None:
        raise ConfigurationError(f"{type(model).__name__} does not name its router (no "
                                 "_can_record_outputs['router_logits']); pass router_logits_of a model whose router is "
                                 "named so, or write MoELoss(forward=...) yourself")
    seen: List[torch.Tensor] = []
    with contextlib.ExitStack() as hooks:  # each hook removed on leaving
        for m in model.modules():
            if isinstance(m, spec.target_class):
                hooks.enter_context(m.register_forward_hook(lambda _m, _i, out: seen.append(out[spec.index])))
        yield seen


def hf_token_mask(inputs: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """The tokens a Hugging Face MoE model's ``load_balancing_loss_func`` balances: its 2-D
    ``attention_mask`` (batch, sequence), flattened (None: no mask, every token). Another shape is refused:
    the model's own function reads the mask as (batch, sequence), so no count of it would be the model's."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.dim() != 2:
        raise ConfigurationError(f"the MoE load balancing over the window reads attention_mask as (batch, sequence), "
                                 f"as the model's load_balancing_loss_func does; this micro-batch's has shape "
                                 f"{tuple(mask.shape)}: pass the 2-D padding mask (1 for a token, 0 for padding)")
    return mask.reshape(-1)


def hf_routing(model: nn.Module, inputs: Mapping[str, Any]) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
    """A Hugging Face MoE model's routing of a micro-batch's inputs (the counting pass): its router logits
    (``output_router_logits=True``) and :func:`hf_token_mask`; ``model`` is the trunk
    (``base_model``) where the LM head is not needed."""
    return list(model(**inputs, output_router_logits=True).router_logits), hf_token_mask(inputs)


def causal_lm_parts(model: nn.Module, ignore_index: int) -> Tuple[RouterBalance, Callable[[nn.Module, Any], Routed],
                                                                   Callable[[nn.Module, Any], Routed]]:
    """What :meth:`gradaccum.MoELoss.for_hf_model` is made of, for the unwrapped causal LM ``model``: its config's
    term, ``forward`` and ``route`` (the counting pass: the trunk, no LM head); the refusals its docstring lists."""
    name, config = type(model).__name__, getattr(model, "config", None)
    if config is None:
        raise ConfigurationError(
            f"MoELoss.for_hf_model({name}): the model has no Hugging Face config (model.config), so there is no "
            f"router to read E, top-k and coef from; for_hf_model takes a {', '.join(BALANCED_FAMILIES)} causal "
            "LM; for a model of your own write MoELoss(forward, num_experts=..., top_k=..., coef=...)")
    term = aux_term(config)
    if term is None:
        text = text_config(config)
        raise ConfigurationError(
            f"MoELoss.for_hf_model({name}): its config has no load-balancing term (output_router_logits="
            f"{getattr(text, 'output_router_logits', None)}, router_aux_loss_coef="
            f"{getattr(text, 'router_aux_loss_coef', None)}); use a plain loss_fn such as "
            "gradaccum.causal_lm_loss, or set output_router_logits=True and router_aux_loss_coef > 0")

    def split(batch: Any) -> Tuple[Dict[str, Any], torch.Tensor]:
        if not isinstance(batch, Mapping):
            raise ConfigurationError(
                f"MoELoss.for_hf_model: a micro-batch is a {type(batch).__name__}; it takes dicts of the model's "
                "inputs with labels, e.g. {'input_ids': ..., 'attention_mask': ..., 'labels': ...} (a "
                "tokenizer's output with labels added)")
        if "labels" not in batch:
            raise ConfigurationError(
                f"MoELoss.for_hf_model: a micro-batch has no 'labels' (its keys: {sorted(batch)}); add the "
                "targets as batch['labels'] (input_ids, with -100 where no loss is taken; the model shifts them)")
        return {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}, batch["labels"]

    def forward(model: nn.Module, batch: Any) -> Routed:
        inputs, labels = split(batch)
        # the router logits by hooks: with output_router_logits=False the model computes no per-batch aux loss
        with router_logits_of(model) as router_logits:
            out = model(**inputs, output_router_logits=False)
        mean, count = causal_lm_loss(out.logits, labels, ignore_index=ignore_index)
        return mean, count, list(router_logits), hf_token_mask(batch)

    def route(model: nn.Module, batch: Any) -> Routed:
        inputs, labels = split(batch)
        return (None, target_count(labels[..., 1:], ignore_index=ignore_index),
                *hf_routing(getattr(model, "base_model", model), inputs))

    return term, forward, route
