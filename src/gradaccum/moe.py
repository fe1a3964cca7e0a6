"""Mixture-of-experts load balancing under accumulation: the router's auxiliary loss over the window.

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE train on the token loss plus ``coef`` times a load-balancing
loss over the batch's routed tokens (transformers' ``load_balancing_loss_func``: every layer's router
pooled, top-k, padding masked by the ``attention_mask``)::

    LBL = E * sum_i f_i P_i,    f_i = C_i / T,    P_i = S_i / T

with ``C_i`` the tokens routed to expert i (top-k choices, every layer, not differentiated), ``S_i``
the summed router probability of expert i and ``T`` the routed rows (tokens times layers). Both are
statistics of the whole batch, so per micro-batch the loss is another objective. Because ``C`` is not
differentiated, the gradient splits over micro-batches once the window's counts are known
(:func:`gradaccum._maths.balance_loss_part`)::

    grad LBL = E / T^2 * sum_i C_i * sum_k grad S_{k,i}

This module says when a model's loss has that term (:func:`aux_term`) and refuses the routes that
would train it per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import NotExactError

__all__ = ["RouterBalance", "aux_term", "refuse_aux_term"]


@dataclass(frozen=True)
class RouterBalance:
    """A model's load-balancing term: ``coef * LBL`` over ``num_experts`` experts, ``top_k`` per token."""

    num_experts: int
    top_k: int
    coef: float


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def aux_term(config: Any) -> Optional[RouterBalance]:
    """The load-balancing term a Hugging Face config adds to the model's loss, or None: the model
    returns its router logits (``output_router_logits``) and weighs them by a nonzero
    ``router_aux_loss_coef``. A multimodal config is read through its text config.

    >>> class Config: output_router_logits, router_aux_loss_coef, num_local_experts, num_experts_per_tok = True, 0.02, 8, 2
    >>> aux_term(Config())
    RouterBalance(num_experts=8, top_k=2, coef=0.02)
    >>> Config.router_aux_loss_coef = 0.0; aux_term(Config()) is None
    True
    """
    if config is None:
        return None
    text = _text_config(config)
    coef = getattr(text, "router_aux_loss_coef", 0.0) or 0.0
    if not getattr(text, "output_router_logits", False) or not coef:
        return None
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    return RouterBalance(int(experts or 0), int(getattr(text, "num_experts_per_tok", 0) or 0), float(coef))


def refuse_aux_term(config: Any, where: str, fix: str) -> None:
    """Raise :class:`~gradaccum.NotExactError` when ``config`` adds a load-balancing term that ``where``
    would compute per micro-batch (or drop), naming the config's values and ``fix``."""
    term = aux_term(config)
    if term is None:
        return
    raise NotExactError(
        f"{where}: the model's config has output_router_logits=True and router_aux_loss_coef={term.coef}, so its "
        f"loss adds a load-balancing term (E={term.num_experts} experts, top-{term.top_k}) whose expert fractions "
        f"are statistics of the whole batch; {where} would compute it per micro-batch, so the step would not be "
        f"the big batch's. {fix}")
