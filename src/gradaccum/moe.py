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

The exact method, :class:`MoELoss` (``mode="exact"``), in the order a window runs. Its one home is
:class:`WindowRouting` (open, replay and part per micro-batch, check, finish), which the Accumulator
(:func:`run_moe_window`) and ExactTrainer (:class:`gradaccum.integrations.hf_moe.WindowBalance`) drive:

1. Pass 1, without a graph (``route``: the trunk alone where it can): each micro-batch's forward, only
   to count: ``C_k`` (E numbers, pooled over the layers), its rows ``T_k`` and its loss items ``n_k``;
   the random state saved before each. Under FSDP2 (every forward all-gathers the shards) every rank
   runs as many as the busiest.
2. One all-gather of every rank's ``(C, T, N, micro-batches)`` before the window opens: it opens
   knowing its global N (so R = N: each backward weighs ``n_k / N`` exactly, as the big batch does,
   float32 islands included) and its plan.
3. Pass 2: each micro-batch's forward again from its saved random state (router jitter, dropout: it
   routes as pass 1 did, which is checked on every rank before the last backward), backpropagating its
   token loss plus ``coef * N / n_k * balance_loss_part(S_k, C, T, T)`` as a mean over its ``n_k`` items
   (the core's weight ``n_k / N`` leaves ``coef * balance_loss_part``).

The cheaper modes run no pass 1 and no collective of their own, each measured against the big batch
in ``docs/guides/moe.md``: ``"micro_batch"`` (each micro-batch's own loss, weighted by its share of the
window's items, so the objective does not change with the accumulation steps or the world size) and
``"prefix"`` (expert fractions from this rank's micro-batches so far, Megatron's running average).

:func:`aux_term` says when a Hugging Face model's loss has that term; :func:`refuse_aux_term` refuses
the routes that would train it per micro-batch.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ._maths import balance_loss_part, router_statistics, target_count
from ._random import RandomState
from ._ranks import WindowPlan, WindowRequest
from ._window import Window
from .errors import ConfigurationError, NotExactError, replay_differs
from .sync import GradSync

__all__ = ["RouterBalance", "aux_term", "refuse_aux_term", "balance_hint", "router_logits_of", "MoEOutput", "MoELoss",
           "MODES", "WindowRouting", "counts_on_every_rank", "run_moe_window", "check_moe_loss", "hf_routing",
           "hf_token_mask"]

#: how the load-balancing term is computed under accumulation (see the module docstring)
MODES = ("exact", "micro_batch", "prefix")


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
    if not getattr(text, "output_router_logits", False):
        return None
    _refuse_an_unknown_term(text, coef)
    if not coef:
        return None
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    return RouterBalance(int(experts or 0), int(getattr(text, "num_experts_per_tok", 0) or 0), float(coef))


#: the model types whose load-balancing loss is transformers' ``load_balancing_loss_func`` as
#: :func:`gradaccum._maths.balance_loss_part` computes it (tested against each family's own loss)
BALANCED_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: where other models keep the weight of a router loss of their own (JetMoe, DBRX, ...)
_OTHER_WEIGHTS = ("aux_loss_coef", "moe_aux_loss_coef", "router_z_loss_coef")


def _refuse_an_unknown_term(text: Any, coef: float) -> None:
    """A config whose loss adds a router term gradaccum cannot compute over the window (another
    family's formula, or a weight under another name): refused, never trained without it in silence."""
    family = getattr(text, "model_type", None)
    others = {name: getattr(text, name) for name in _OTHER_WEIGHTS if getattr(text, name, 0)}
    ffn = getattr(text, "ffn_config", None)
    if getattr(ffn, "moe_loss_weight", 0) or (isinstance(ffn, dict) and ffn.get("moe_loss_weight")):
        others["ffn_config.moe_loss_weight"] = getattr(ffn, "moe_loss_weight", None) or ffn.get("moe_loss_weight")
    unknown = bool(others) or (bool(coef) and family is not None and family not in BALANCED_FAMILIES)
    if unknown:
        weights = ", ".join(f"{k}={v}" for k, v in ({"router_aux_loss_coef": coef} if coef else {}).items())
        weights = ", ".join(filter(None, [weights] + [f"{k}={v}" for k, v in others.items()]))
        raise NotExactError(
            f"the model's config ({family}) has output_router_logits=True and {weights}: its loss adds a router "
            f"term gradaccum does not compute over the window (supported: {', '.join(BALANCED_FAMILIES)}), so it "
            "would be dropped or computed per micro-batch. Set output_router_logits=False (or that weight to 0) to "
            "train without it")


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
    """The router logits of every forward of ``model`` inside the block, in layer order, for forwards
    that do not return them (TRL's fused LM head) or that are asked not to (so that the model computes
    no per-batch aux loss of its own): hooks on the router class the model's own output capture names
    (``_can_record_outputs["router_logits"]``, transformers 5)."""
    spec = next((m._can_record_outputs["router_logits"] for m in model.modules()
                 if "router_logits" in (getattr(m, "_can_record_outputs", None) or {})), None)
    if spec is None:
        raise ConfigurationError(f"{type(model).__name__} does not name its router (no "
                                 "_can_record_outputs['router_logits']); pass router_logits_of a model whose router is "
                                 "named so, or write MoELoss(forward=...) yourself")
    seen: List[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[spec.index]))
             for m in model.modules() if isinstance(m, spec.target_class)]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


class MoEOutput(NamedTuple):
    """What an :class:`MoELoss`'s ``forward(model, micro_batch)`` returns for one micro-batch.

    Attributes:
        loss: the **mean** token (or other) loss over the micro-batch's ``num_items`` items, without
            the load-balancing term.
        num_items: how many items ``loss`` is a mean over (an int, or a count tensor).
        router_logits: one ``(tokens, experts)`` tensor per MoE layer, the router's logits before its
            softmax, as the model computed them in this forward (differentiable).
        token_mask: ``(tokens,)`` 0/1, the tokens the balance is over (the flattened
            ``attention_mask``); None: every token.
    """

    loss: torch.Tensor
    num_items: Any
    router_logits: Sequence[torch.Tensor]
    token_mask: Optional[torch.Tensor] = None


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


def hf_routing(model: nn.Module, inputs: Mapping[str, Any], num_items: Any = None) -> MoEOutput:
    """A Hugging Face MoE model's routing of a micro-batch's model inputs (the counting pass): its router
    logits (``output_router_logits=True``) and :func:`hf_token_mask`; ``num_items`` as the caller counts
    them. ``model`` is the trunk (``base_model``) where the LM head is not needed."""
    return MoEOutput(None, num_items, model(**inputs, output_router_logits=True).router_logits,  # type: ignore[arg-type]
                     hf_token_mask(inputs))


class MoELoss:
    """A loss for ``acc.step`` / ``acc.train`` (in place of a ``loss_fn``): a token loss plus ``coef``
    times a mixture-of-experts load-balancing loss over the **whole window**, every micro-batch on
    every rank, as one big batch computes it (transformers' ``load_balancing_loss_func``: layers
    pooled, top-k, padding masked)::

        L = sum_k n_k L_k / N + coef * E * sum_i f_i P_i,   f_i = C_i / T,  P_i = S_i / T  (window-wide)

    Args:
        forward: ``forward(model, micro_batch) -> MoEOutput``: the micro-batch's mean loss, its item
            count, its router logits per layer and its token mask. In ``mode="exact"`` each
            micro-batch also runs ``route`` once before, under ``torch.inference_mode()``, only to count.
        num_experts: E; top_k: the experts chosen per token; coef: the load-balancing weight
            (transformers' ``router_aux_loss_coef``).
        mode: ``"exact"`` (default: one more forward per micro-batch without a graph, one all-gather
            of E + 4 numbers per rank per window), or ``"micro_batch"`` / ``"prefix"`` (cheaper, not the
            big batch: see :mod:`gradaccum.moe`).
        route: optional ``route(model, micro_batch) -> MoEOutput`` for the counting pass: the same
            routing and item count as ``forward`` gives, from a cheaper forward (the trunk without the
            head, ``loss=None``). Default: ``forward``.

    For a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE causal LM use :meth:`for_hf_model`.
    An MoELoss runs through ``acc.step`` and ``acc.train`` (not ``acc.window``, nor as a plain
    ``loss_fn``: refused); its item counts come from ``forward`` (``num_items=`` is not read). Exact
    mode does not support ``micro_batch_size="auto"`` yet (refused); DDP and FSDP2 are tested.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> from gradaccum import Accumulator
        >>> router, head = nn.Linear(4, 3), nn.Linear(4, 1)
        >>> model = nn.ModuleDict({"router": router, "head": head})
        >>> def forward(model, batch):
        ...     x, y = batch
        ...     return MoEOutput(nn.functional.mse_loss(model["head"](x).squeeze(-1), y), len(x), [model["router"](x)])
        >>> moe = MoELoss(forward, num_experts=3, top_k=1, coef=0.1)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> acc.step((torch.randn(10, 4), torch.randn(10)), moe, micro_batch_size=4).num_items
        10
    """

    def __init__(self, forward: Callable[[nn.Module, Any], MoEOutput], *, num_experts: int, top_k: int, coef: float,
                 mode: str = "exact", route: Optional[Callable[[nn.Module, Any], MoEOutput]] = None) -> None:
        if not callable(forward):
            raise TypeError(f"MoELoss(forward={forward!r}) must be callable as forward(model, micro_batch) -> MoEOutput")
        if mode not in MODES:
            raise ConfigurationError(f"MoELoss(mode={mode!r}): supported are {MODES} ('exact' is the big batch)")
        if not (isinstance(top_k, int) and isinstance(num_experts, int) and 0 < top_k <= num_experts):
            raise ConfigurationError(f"MoELoss(num_experts={num_experts!r}, top_k={top_k!r}): need ints with "
                                     "0 < top_k <= num_experts")
        if isinstance(coef, bool) or not isinstance(coef, numbers.Real) or not math.isfinite(coef) or coef < 0:
            raise ConfigurationError(f"MoELoss(coef={coef!r}): coef is the load-balancing weight (transformers' "
                                     "router_aux_loss_coef), a finite number >= 0, e.g. coef=0.02")
        self.forward, self.num_experts, self.top_k, self.coef, self.mode = forward, num_experts, top_k, float(coef), mode
        self.route = route if route is not None else forward

    @property
    def term(self) -> RouterBalance:
        """E, top-k and coef, as :class:`WindowRouting` takes them."""
        return RouterBalance(self.num_experts, self.top_k, self.coef)

    def __repr__(self) -> str:
        return (f"MoELoss(forward={self.forward!r}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"coef={self.coef}, mode={self.mode!r})")

    def __call__(self, model: nn.Module, micro_batch: Any) -> Any:
        """An MoELoss is a loss over the window: a caller that runs it one micro-batch at a time, not
        through ``acc.step`` / ``acc.train``, would train another objective; refused."""
        raise NotExactError("MoELoss was called as a loss_fn on one micro-batch; its load-balancing term is over the "
                            "whole window, so pass it to acc.step(...) or acc.train(...), which run the window")

    @classmethod
    def for_hf_model(cls, model: nn.Module, *, mode: str = "exact", ignore_index: int = -100) -> "MoELoss":
        """The model's own loss for a Hugging Face MoE causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE,
        OLMoE): next-token cross-entropy over ``labels[:, 1:] != ignore_index`` plus
        ``router_aux_loss_coef`` times its load-balancing loss over the window, E, top-k and the
        coefficient read from its config. Micro-batches are dicts with ``input_ids``, ``labels`` and
        (for padding) ``attention_mask``. The counting pass runs the model's trunk (``base_model``)
        without its LM head.

        Raises:
            ConfigurationError: the model has no Hugging Face config, or its config has no load-balancing
                term (``output_router_logits`` off or ``router_aux_loss_coef`` 0): train it with a plain
                ``loss_fn``; later, a micro-batch that is not a dict with ``labels``.
            NotExactError: the config adds a router loss of another family (JetMoe, DBRX, ...).
        """
        from .losses import causal_lm_loss

        inner = _unwrapped(model)
        name = type(inner).__name__
        config = getattr(inner, "config", None)
        if config is None:
            raise ConfigurationError(
                f"MoELoss.for_hf_model({name}): the model has no Hugging Face config (model.config), so there is no "
                f"router to read E, top-k and coef from; for_hf_model takes a {', '.join(BALANCED_FAMILIES)} causal "
                "LM; for a model of your own write MoELoss(forward, num_experts=..., top_k=..., coef=...)")
        term = aux_term(config)
        if term is None:
            raise ConfigurationError(
                f"MoELoss.for_hf_model({name}): its config has no load-balancing term (output_router_logits="
                f"{getattr(_text_config(config), 'output_router_logits', None)}, router_aux_loss_coef="
                f"{getattr(_text_config(config), 'router_aux_loss_coef', None)}); use a plain loss_fn such as "
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

        def forward(model: nn.Module, batch: Any) -> MoEOutput:
            inputs, labels = split(batch)
            # the router logits by hooks: with output_router_logits=False the model computes no
            # per-batch aux loss of its own (unused here)
            with router_logits_of(model) as router_logits:
                out = model(**inputs, output_router_logits=False)
            mean, count = causal_lm_loss(out.logits, labels, ignore_index=ignore_index)
            return MoEOutput(mean, count, list(router_logits), hf_token_mask(batch))

        def route(model: nn.Module, batch: Any) -> MoEOutput:
            inputs, labels = split(batch)
            count = target_count(labels[..., 1:], ignore_index=ignore_index)
            return hf_routing(getattr(model, "base_model", model), inputs, count)

        return cls(forward, num_experts=term.num_experts, top_k=term.top_k, coef=term.coef, mode=mode, route=route)

    def checked(self, out: Any) -> MoEOutput:
        """``forward``'s output after the checks every mode makes (an :class:`MoEOutput`, router logits
        of ``num_experts`` experts), or a :class:`~gradaccum.ConfigurationError` that says the fix."""
        _check_routing(_checked(out), self.term, "MoELoss")
        return out  # type: ignore[no-any-return]

    # -- the cheaper modes: a loss_fn returning (mean, count) ------------------------------------

    def per_micro_batch(self) -> Callable[[nn.Module, Any], Any]:
        """A fresh ``(mean, count)`` ``loss_fn`` for one window of ``mode="micro_batch"`` or
        ``"prefix"``: the token loss plus ``coef`` times the micro-batch's balance term, weighted by its
        share ``n_k / N`` of the window's items like its token loss; ``"prefix"`` takes the expert
        fractions from this rank's micro-batches of the window so far (this one included)."""
        seen: List[torch.Tensor] = []  # counts and rows of this rank's micro-batches so far

        def loss_fn(model: nn.Module, batch: Any) -> Any:
            out = _checked(self.forward(model, batch))
            counts, probs, rows = _statistics(out, self.term, "MoELoss")
            fractions_of, over = (counts, rows)
            if self.mode == "prefix":
                seen[:] = [counts, rows] if not seen else [seen[0] + counts, seen[1] + rows]
                fractions_of, over = seen[0], seen[1]
            return out.loss + self.coef * balance_loss_part(probs, fractions_of, over, rows), out.num_items

        return loss_fn


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel (whose forward runs collectives); any other as it is."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _checked(out: Any) -> MoEOutput:
    if not isinstance(out, MoEOutput):
        raise ConfigurationError(f"MoELoss: forward(model, micro_batch) returned {type(out).__name__}; return "
                                 "gradaccum.moe.MoEOutput(loss, num_items, router_logits, token_mask)")
    return out


def _statistics(out: MoEOutput, term: RouterBalance, who: str) -> Any:
    """``router_statistics`` of a forward's output, after :func:`_check_routing`."""
    _check_routing(out, term, who)
    return router_statistics(list(out.router_logits), term.top_k, out.token_mask)


def _check_routing(out: MoEOutput, term: RouterBalance, who: str) -> None:
    """The checks every mode makes alike: router logits there are, and each layer's have
    ``term.num_experts`` experts."""
    logits = list(out.router_logits) if out.router_logits is not None else []
    if not logits:
        raise ConfigurationError(
            f"{who}: the forward returned no router logits (router_logits={out.router_logits!r}), so there is no "
            "load balancing to compute: return one (tokens, experts) tensor per MoE layer in MoEOutput.router_logits "
            "(a Hugging Face model returns them with output_router_logits=True, or read them with "
            "gradaccum.moe.router_logits_of(model))")
    experts = {int(t.shape[-1]) for t in logits}
    if experts != {term.num_experts}:
        raise ConfigurationError(f"{who}(num_experts={term.num_experts}): the router logits have "
                                 f"{', '.join(map(str, sorted(experts)))} experts (their last dimension); pass "
                                 f"num_experts={min(experts)} (the router's), or return that router's logits")


def check_moe_loss(moe: MoELoss, num_items: Any, micro_batch_size: Any) -> None:
    """What ``acc.step`` / ``acc.train`` do not take with an :class:`MoELoss`, refused before anything runs."""
    if num_items is not None:
        raise ConfigurationError(f"num_items={num_items!r} was given with an MoELoss: its item counts come from its "
                                 "forward (MoEOutput.num_items), so num_items would not be read; drop num_items")
    if micro_batch_size == "auto" and moe.mode == "exact":
        raise ConfigurationError("micro_batch_size='auto' is not supported with MoELoss(mode='exact'): pass an int "
                                 "micro_batch_size")


def require_router_grad(router_logits: Sequence[torch.Tensor], where: str) -> None:
    """In a forward that builds a graph, every layer's router logits must be in it: a detached copy,
    or a reentrant activation checkpoint (which runs the forward without a graph first), would drop
    the load-balancing gradient silently."""
    if torch.is_grad_enabled() and not all(t.requires_grad for t in router_logits):
        raise NotExactError(f"{where}: the router logits of a training forward do not require grad, so the "
                            "load-balancing term would add no gradient: do not detach them, and use non-reentrant "
                            "activation checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False})")


def counts_on_every_rank(sync: GradSync) -> bool:
    """Whether every forward is a collective (FSDP2 all-gathers the shards in each), so that the
    counting pass runs the whole model on every rank, as many times as the busiest rank; else it runs
    the unwrapped module (the trunk where it can), which runs no collective."""
    return sync.sharded_grads


class WindowRouting:
    """One window's load balancing, step by step: the one implementation that every driver calls
    (the Accumulator's :func:`run_moe_window`, ExactTrainer's
    :class:`~gradaccum.integrations.hf_moe.WindowBalance`), in the order a window runs:

    1. :meth:`open`: pass 1 without a graph, each micro-batch's expert counts ``C_k`` and rows ``T_k``
       (and its loss items ``n_k`` where the driver counts them there), its random state saved before
       it; then one all-gather of every rank's ``(C, T, N, itemless, micro-batches)``, before any
       backward: the window's ``C`` and ``T``.
    2. :meth:`replay` then :meth:`part` per micro-batch: its forward from its saved random state, and its
       part ``balance_loss_part(S_k, C, T, T)`` of the window's load-balancing loss (the parts of every
       micro-batch on every rank sum to ``LBL``; the driver weighs it by ``coef`` and its own weight).
    3. :meth:`check` before the window's last backward, on every rank: the training forwards routed as
       they were counted (:func:`gradaccum.errors.replay_differs` where one did not).
    4. :meth:`finish` after the window: the random state as pass 1 left it (the window drew once).

    Attributes (after :meth:`open`): ``counts`` (``C``, E float64), ``rows`` (``T``), ``items`` (``N``,
    every rank's; ``local_items`` this rank's), ``itemless`` (a micro-batch somewhere routes tokens but
    holds no loss item), ``sizes`` (each rank's micro-batches).
    """

    def __init__(self, term: RouterBalance, sync: GradSync, device: torch.device, who: str) -> None:
        self.term, self.sync, self.device, self.who = term, sync, device, who
        self.states: List[RandomState] = []
        self.first: List[torch.Tensor] = []
        self.differs = torch.zeros((), dtype=torch.bool, device=device)
        self.counts = torch.zeros(term.num_experts, dtype=torch.float64, device=device)
        self.rows = self.items = self.local_items = 0.0
        self.itemless = False
        self.sizes: List[int] = []

    @classmethod
    def open(cls, term: RouterBalance, micro_batches: Sequence[Any], *, route: Callable[[Any], MoEOutput],
             forward: Callable[[Any], MoEOutput], sync: GradSync, device: torch.device, who: str,
             padding: Sequence[Any] = (), autocast: Optional[Callable[[], Any]] = None) -> "WindowRouting":
        """Count the window and agree the counts across the ranks.

        Args:
            term: E, top-k and coef.
            micro_batches: this rank's micro-batches.
            route: ``route(micro_batch) -> MoEOutput`` without collectives (the unwrapped trunk);
                forward: the whole model's, run instead where every forward is a collective
                (:func:`counts_on_every_rank`). ``num_items`` None: the driver counts items itself.
            sync: the distributed seam (its ``all_gather`` and ``any_rank``).
            who: who runs the window, for the refusals (``"MoELoss"``, ``"ExactTrainer"``).
            padding: batches to run first, counting nothing (FSDP2: a rank with fewer micro-batches
                runs as many forwards as the busiest).
            autocast: the context the training forwards run under (the same routing needs the same dtype).
        """
        routing = cls(term, sync, device, who)
        sharded = counts_on_every_rank(sync)
        run = forward if sharded else route
        totals = torch.zeros(term.num_experts + 3, dtype=torch.float64, device=device)
        # under FSDP2 no_grad (inference tensors must not reach its unsharded parameters)
        with torch.no_grad() if sharded else torch.inference_mode(), (autocast or contextlib.nullcontext)():
            for batch in padding:  # first: whatever they draw, the micro-batches' replays start after it
                run(batch)
            for batch in micro_batches:
                routing.states.append(RandomState(device))
                out = _checked(run(batch))
                c, _, rows = _statistics(out, term, who)
                routing.first.append(c)
                n = torch.as_tensor(0 if out.num_items is None else out.num_items, device=device).to(torch.float64)
                bad = ((n == 0) & (rows > 0)).to(torch.float64) if out.num_items is not None else torch.zeros_like(n)
                totals += torch.cat([c.to(torch.float64), torch.stack([rows.to(torch.float64), n, bad])])
        routing.states.append(RandomState(device))
        # every rank's (C, T, N, itemless, micro-batches): one all-gather per window, before any backward
        every = sync.all_gather(torch.cat([totals, totals.new_tensor([len(micro_batches)])]))
        summed = every[:, :-1].sum(dim=0)
        routing.counts = summed[:-3]
        read = torch.cat([summed[-3:], totals[-2:-1]]).tolist()  # one host synchronisation
        routing.rows, routing.items, itemless, routing.local_items = read
        routing.itemless = bool(itemless)
        routing.sizes = [int(m) for m in every[:, -1].tolist()]
        return routing

    def replay(self, k: int) -> None:
        """Micro-batch k's random state, as it was when it was counted."""
        self.states[k].restore()

    def part(self, k: int, router_logits: Sequence[torch.Tensor], token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """``balance_loss_part(S_k, C, T, T)``: micro-batch k's part of the window's load-balancing loss
        (without ``coef``), from its training forward's (differentiable) router logits; its counts are
        kept for :meth:`check`."""
        require_router_grad(router_logits, self.who)
        c, s, _ = _statistics(MoEOutput(None, None, router_logits, token_mask), self.term, self.who)
        self.differs = self.differs | (c.detach() != self.first[k]).any()
        return balance_loss_part(s, self.counts, self.rows, self.rows)

    def check(self) -> None:
        """Before the window's last backward, on every rank alike: every training forward routed as it
        was counted, else :class:`~gradaccum.ReplayError`."""
        if self.sync.any_rank(bool(self.differs), self.device):
            raise replay_differs(self.who, "routed its tokens to other experts")

    def finish(self) -> None:
        """After the window: the random state as the counting pass left it (drawn once per window)."""
        self.states[-1].restore()


def run_moe_window(ctx: Any, micro_batches: List[Any], moe: MoELoss, counts: Any, *, micro_batch_size: Any = None,
                   catch_oom: bool = False, plan: Any = None) -> Any:
    """One window of an :class:`MoELoss` in mode ``"exact"`` (the dispatch of
    :func:`gradaccum._run.run_window`, which runs the cheaper modes as a ``(mean, count)`` ``loss_fn``):
    the Accumulator's driver of :class:`WindowRouting`, in the module docstring's order."""
    assert not catch_oom, "micro_batch_size='auto' with MoELoss(mode='exact') is refused by check_moe_loss"
    ranks = ctx.ranks
    if micro_batches:
        ranks.remember(micro_batches[-1])  # to pad a later window where this rank has none
    # pass 1 runs before the window opens: on the unwrapped module under DDP (whose forward runs
    # collectives a rank without data lacks); under FSDP2 every forward all-gathers the shards, so
    # every rank runs as many as the busiest, padding with its last micro-batch (zero weight)
    padding = 0
    if counts_on_every_rank(ctx.sync):
        padding = int(ctx.sync.all_gather(torch.tensor([len(micro_batches)], device=ctx.device)).max()) - len(micro_batches)
        if ctx.sync.any_rank(padding > 0 and ctx.state.padding_batch is None, ctx.device):
            raise ConfigurationError("MoELoss: a rank has fewer micro-batches than another and none to pad its counting "
                                     "forwards with (FSDP2 runs every forward on every rank): give it one with "
                                     "acc.set_padding(micro_batch)")
    routing = WindowRouting.open(
        moe.term, micro_batches, route=lambda mb: moe.route(_unwrapped(ctx.model), mb),
        forward=lambda mb: moe.forward(ctx.model, mb), sync=ctx.sync, device=ctx.device, who="MoELoss",
        padding=[ctx.state.padding_batch] * padding, autocast=ctx.precision.autocast)
    items = routing.items
    if routing.itemless and items > 0:
        raise NotExactError(
            "MoELoss: a micro-batch holds tokens the router balances but no loss item (every label ignored), "
            "so its share of the load-balancing gradient has no item weight to ride on; leave such micro-batches "
            "out of the window (on this rank or another), or use MoELoss(mode='micro_batch')")
    # the window opens knowing its global N (R = N: each backward weighs n_k / N as the big batch does)
    plan = WindowPlan(len(micro_batches), max(routing.sizes), min(routing.sizes), items)
    request = WindowRequest(len(micro_batches), routing.local_items, can_pad=ranks.can_pad(bool(micro_batches)),
                            plan=plan)
    with Window(ctx, request, micro_batch_size=micro_batch_size) as window:
        last = len(micro_batches) + window.padding - 1
        for k in range(last + 1):
            own = k < len(micro_batches)
            if own:
                routing.replay(k)
            with window.micro_batch():
                out = _checked(moe.forward(ctx.model, micro_batches[k] if own else ctx.state.padding_batch))
                loss = out.loss
                if own:
                    part = routing.part(k, out.router_logits, out.token_mask)
                    n = out.num_items  # the core's weight n_k / N leaves coef * part
                    if isinstance(n, torch.Tensor):  # left on the device: no host sync per micro-batch
                        loss = loss + torch.where(n > 0, moe.coef * items / n.clamp(min=1).to(part.dtype), 0.0) * part
                    elif n > 0:
                        loss = loss + moe.coef * items / n * part
                if k == last:
                    routing.check()
                if own:
                    window.backward(loss, out.num_items)
                else:
                    window.backward_padding(loss)
        routing.finish()
        return window.step()
