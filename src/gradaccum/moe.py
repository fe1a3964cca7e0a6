"""Mixture-of-experts load balancing under accumulation: the router's auxiliary loss over the window.

:class:`MoELoss` is the loss one passes to ``acc.step`` / ``acc.train``. Its ``mode="exact"`` is :class:`Routing`,
the MoE guide's count, agree and train steps (docs/guides/moe.md, "The exact method"), driven by the Accumulator
(:func:`run_moe_window`) and ExactTrainer (:class:`gradaccum.integrations.hf_moe.TrainerBalance`); the maths is
:func:`gradaccum._maths.router_statistics` and :func:`gradaccum._maths.balance_loss_part`.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._maths import balance_loss_part, router_statistics
from ._random import Replay
from ._ranks import Plan, Request
from ._window import Window
from .errors import ConfigurationError, NotExactError
from .sync import GradSync

__all__ = ["MoEOutput", "MoELoss", "MODES", "Routing", "run_moe_window", "check_moe_loss"]

#: how the load-balancing term is computed under accumulation (see :class:`MoELoss`'s ``mode``)
MODES = ("exact", "micro_batch", "prefix")


class MoEOutput(NamedTuple):
    """What an :class:`MoELoss`'s ``forward(model, micro_batch)`` returns for one micro-batch.

    Attributes:
        loss: the **mean** token (or other) loss over the micro-batch's ``num_items`` items, without the balance term.
        num_items: how many items ``loss`` is a mean over (an int, or a count tensor).
        router_logits: one ``(tokens, experts)`` tensor per MoE layer, the router's logits before its
            softmax, as the model computed them in this forward (differentiable).
        token_mask: ``(tokens,)`` 0/1, the tokens the balance is over (the flattened ``attention_mask``); None: all.
    """

    loss: torch.Tensor
    num_items: Any
    router_logits: Sequence[torch.Tensor]
    token_mask: Optional[torch.Tensor] = None


class MoELoss:
    """A loss for ``acc.step`` / ``acc.train`` (in place of a ``loss_fn``): a token loss plus ``coef`` times a
    mixture-of-experts load-balancing loss over the **whole window**, every micro-batch on every rank, as one
    big batch computes it (transformers' ``load_balancing_loss_func``: layers pooled, top-k, padding masked)::

        L = sum_k n_k L_k / N + coef * E * sum_i f_i P_i,   f_i = C_i / T,  P_i = S_i / T  (window-wide)

    with ``C_i`` the tokens routed to expert i (top-k choices, every layer), ``S_i`` the summed router
    probability of expert i and ``T`` the routed rows (tokens times layers).

    Args:
        forward: ``forward(model, micro_batch) -> MoEOutput``: the micro-batch's mean loss, item count, router
            logits per layer and token mask. In ``mode="exact"`` each micro-batch also runs ``route`` once
            before, under ``torch.inference_mode()``, only to count.
        num_experts: E; top_k: the experts chosen per token; coef: the load-balancing weight
            (transformers' ``router_aux_loss_coef``).
        mode: ``"exact"`` (default: one more forward per micro-batch without a graph, one all-gather of E + 4
            numbers per rank per window), or a cheaper one, not the big batch, with no counting pass nor
            collective of its own (each measured against the big batch in the guide): ``"micro_batch"`` (each
            micro-batch's own loss, weighted by its share of the window's items, so the objective does not change
            with the accumulation steps or the world size) or ``"prefix"`` (expert fractions from this rank's
            micro-batches so far, Megatron's running average).
        route: optional ``route(model, micro_batch) -> MoEOutput`` for the counting pass: ``forward``'s routing
            and item count from a cheaper forward (the trunk without the head, ``loss=None``). Default: ``forward``.

    For a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE causal LM use :meth:`for_hf_model`. ``acc.window``
    and a call as a plain ``loss_fn`` are refused; item counts come from ``forward`` (``num_items=`` is not read).
    Exact mode does not support ``micro_batch_size="auto"`` yet (refused); DDP and FSDP2 are tested.

    Example:
        >>> _ = torch.manual_seed(0)
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
            raise TypeError(f"MoELoss(forward={forward!r}) must be callable as forward(model, micro_batch) -> "
                            "MoEOutput")
        if mode not in MODES:
            raise ConfigurationError(f"MoELoss(mode={mode!r}): supported are {MODES} ('exact' is the big batch)")
        if not (isinstance(top_k, int) and isinstance(num_experts, int) and 0 < top_k <= num_experts):
            raise ConfigurationError(f"MoELoss(num_experts={num_experts!r}, top_k={top_k!r}): need ints with "
                                     "0 < top_k <= num_experts")
        if isinstance(coef, bool) or not isinstance(coef, numbers.Real) or not math.isfinite(coef) or coef < 0:
            raise ConfigurationError(f"MoELoss(coef={coef!r}): coef is the load-balancing weight (transformers' "
                                     "router_aux_loss_coef), a finite number >= 0, e.g. coef=0.02")
        self.forward, self.num_experts, self.top_k, self.mode = forward, num_experts, top_k, mode
        self.coef, self.route = float(coef), route if route is not None else forward

    def __repr__(self) -> str:
        return (f"MoELoss(forward={self.forward!r}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"coef={self.coef}, mode={self.mode!r})")

    def __call__(self, model: nn.Module, micro_batch: Any) -> Any:
        raise NotExactError("MoELoss was called as a loss_fn on one micro-batch; its load-balancing term is over the "
                            "whole window, so pass it to acc.step(...) or acc.train(...), which run the window")

    @classmethod
    def for_hf_model(cls, model: nn.Module, *, mode: str = "exact", ignore_index: int = -100) -> "MoELoss":
        """The model's own loss for a Hugging Face MoE causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE):
        next-token cross-entropy over ``labels[:, 1:] != ignore_index`` plus ``router_aux_loss_coef`` times its
        load-balancing loss over the window, E, top-k and the coefficient read from its config. Micro-batches are
        dicts with ``input_ids``, ``labels`` and (for padding) ``attention_mask``. The counting pass runs the
        model's trunk (``base_model``) without its LM head.

        Raises:
            ConfigurationError: the model has no Hugging Face config, or its config has no load-balancing
                term (``output_router_logits`` off or ``router_aux_loss_coef`` 0): train it with a plain
                ``loss_fn``; later, a micro-batch that is not a dict with ``labels``.
            NotExactError: the config adds a router loss of another family (JetMoe, DBRX, ...).
        """
        from .integrations.hf_router import causal_lm_parts

        term, forward, route = causal_lm_parts(_unwrapped(model), ignore_index)
        return cls(lambda m, batch: MoEOutput(*forward(m, batch)), num_experts=term.num_experts, top_k=term.top_k,
                   coef=term.coef, mode=mode, route=lambda m, batch: MoEOutput(*route(m, batch)))

    def checked(self, out: Any) -> MoEOutput:
        """``forward``'s output after the checks every mode makes (an :class:`MoEOutput`, router logits
        of ``num_experts`` experts), or a :class:`~gradaccum.ConfigurationError` that says the fix."""
        return _check_routing(_checked(out), self, "MoELoss")

    def per_micro_batch(self) -> Callable[[nn.Module, Any], Any]:
        """A fresh ``(mean, count)`` ``loss_fn`` for one window of ``mode="micro_batch"`` or ``"prefix"``: the token
        loss plus ``coef`` times the micro-batch's balance term, weighted by its share ``n_k / N`` of the window's
        items like its token loss (``"prefix"``: the expert fractions of this rank's micro-batches so far, this one
        included)."""
        seen: List[Any] = [0, 0]  # counts and rows of this rank's micro-batches so far

        def loss_fn(model: nn.Module, batch: Any) -> Any:
            out = _checked(self.forward(model, batch))
            counts, probs, rows = _statistics(out, self, "MoELoss")
            if self.mode == "prefix":
                seen[:] = [seen[0] + counts, seen[1] + rows]
            fractions_of, over = seen if self.mode == "prefix" else (counts, rows)
            return out.loss + self.coef * balance_loss_part(probs, fractions_of, over, rows), out.num_items

        return loss_fn


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel (whose forward runs collectives); any other as it is."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _checked(out: Any) -> MoEOutput:
    if not isinstance(out, MoEOutput):
        raise ConfigurationError(f"MoELoss: forward(model, micro_batch) returned {type(out).__name__}; return "
                                 "gradaccum.moe.MoEOutput(loss, num_items, router_logits, token_mask)")
    return out


def _statistics(out: MoEOutput, term: Any, who: str) -> Any:
    _check_routing(out, term, who)
    return router_statistics(list(out.router_logits), term.top_k, out.token_mask)


def _check_routing(out: MoEOutput, term: Any, who: str) -> MoEOutput:
    logits = list(out.router_logits) if out.router_logits is not None else []
    if not logits:
        raise ConfigurationError(
            f"{who}: the forward returned no router logits (router_logits={out.router_logits!r}), so there is no "
            "load balancing to compute: return one (tokens, experts) tensor per MoE layer in MoEOutput.router_logits "
            "(a Hugging Face model returns them with output_router_logits=True, or read them with "
            "gradaccum.integrations.hf_router.router_logits_of(model))")
    experts = {int(t.shape[-1]) for t in logits}
    if experts != {term.num_experts}:
        raise ConfigurationError(f"{who}(num_experts={term.num_experts}): the router logits have "
                                 f"{', '.join(map(str, sorted(experts)))} experts (their last dimension); pass "
                                 f"num_experts={min(experts)} (the router's), or return that router's logits")
    return out


def check_moe_loss(moe: MoELoss, num_items: Any, micro_batch_size: Any) -> None:
    """What ``acc.step`` / ``acc.train`` do not take with an :class:`MoELoss`, refused before anything runs."""
    if num_items is not None:
        raise ConfigurationError(f"num_items={num_items!r} was given with an MoELoss: its item counts come from its "
                                 "forward (MoEOutput.num_items), so num_items would not be read; drop num_items")
    if micro_batch_size == "auto" and moe.mode == "exact":
        raise ConfigurationError("micro_batch_size='auto' is not supported with MoELoss(mode='exact'): pass an int "
                                 "micro_batch_size")


class Routing(Replay):
    """One window's load balancing, in the order every driver calls it (docs/architecture.md). The replay
    is compared exactly, in every window: the counts are integers, and a near-tie in the router's top-k can
    flip in any window. Attributes (set by :meth:`open`): ``term`` (E, top-k and coef: the :class:`MoELoss`,
    or a config's ``RouterBalance``), ``counts`` (``C``, E float64), ``rows`` (``T``), ``items`` (``N``,
    every rank's; ``local_items`` this rank's), ``sizes`` (each rank's micro-batches)."""

    @classmethod
    def open(cls, term: Any, micro_batches: Sequence[Any], *, route: Callable[[Any], MoEOutput],
             forward: Callable[[Any], MoEOutput], sync: GradSync, device: torch.device, who: str,
             padding: Sequence[Any] = (), autocast: Callable[[], Any] = contextlib.nullcontext) -> "Routing":
        """Count this rank's micro-batches with ``route`` (no collectives: the unwrapped trunk), or with
        ``forward`` where every forward is a collective (FSDP2), after the ``padding`` batches (counting
        nothing), under the training forwards' ``autocast``; then agree the counts across the ranks.
        ``num_items`` None: the driver counts items itself. ``who`` names the driver in the refusals."""
        routing = cls(device, sync, who, "routed its tokens to other experts")
        routing.term, routing.first = term, []  # first: each micro-batch's counts C_k in the counting pass
        sharded = sync.sharded_grads
        run = forward if sharded else route
        totals = torch.zeros(term.num_experts + 3, dtype=torch.float64, device=device)
        # under FSDP2 no_grad (inference tensors must not reach its unsharded parameters)
        with torch.no_grad() if sharded else torch.inference_mode(), autocast():
            for batch in padding:  # first: whatever they draw, the micro-batches' replays start after it
                run(batch)
            for batch in micro_batches:
                routing.save()
                out = _checked(run(batch))
                c, _, rows = _statistics(out, term, who)
                routing.first.append(c)
                n = torch.as_tensor(0 if out.num_items is None else out.num_items, device=device).to(torch.float64)
                bad = ((n == 0) & (rows > 0)).to(torch.float64) if out.num_items is not None else torch.zeros_like(n)
                totals += torch.cat([c.to(torch.float64), torch.stack([rows.to(torch.float64), n, bad])])
        routing.saved_all()
        # every rank's (C, T, N, itemless, micro-batches): one all-gather per window before any backward, one host read
        every = sync.all_gather(torch.cat([totals, totals.new_tensor([len(micro_batches)])]))
        summed = every[:, :-1].sum(dim=0)
        routing.counts = summed[:-3]
        routing.rows, routing.items, itemless, routing.local_items = torch.cat([summed[-3:], totals[-2:-1]]).tolist()
        routing.sizes = [int(m) for m in every[:, -1].tolist()]
        if itemless and routing.items > 0:  # only where route counts the items: MoELoss's
            raise NotExactError(
                f"{who}: a micro-batch holds tokens the router balances but no loss item (every label ignored), "
                "so its share of the load-balancing gradient has no item weight to ride on; leave such micro-batches "
                "out of the window (on this rank or another), or use MoELoss(mode='micro_batch')")
        return routing

    def part(self, k: int, router_logits: Sequence[torch.Tensor], token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """``balance_loss_part(S_k, C, T, T)``: micro-batch k's part of the window's load-balancing loss (without
        ``coef``), from its training forward's (differentiable) router logits; its counts compared for :meth:`check`."""
        if torch.is_grad_enabled() and not all(t.requires_grad for t in router_logits):  # a detached copy, or a
            raise NotExactError(  # reentrant checkpoint, would drop the load-balancing gradient silently
                f"{self.who}: the router logits of a training forward do not require grad, so the load-balancing "
                "term would add no gradient: do not detach them, and use non-reentrant activation checkpointing "
                "(gradient_checkpointing_kwargs={'use_reentrant': False})")
        c, s, _ = _statistics(MoEOutput(None, None, router_logits, token_mask), self.term, self.who)
        self.compare([c], [self.first[k]])
        return balance_loss_part(s, self.counts, self.rows, self.rows)

    def mean_loss(self, k: int, out: MoEOutput) -> torch.Tensor:
        """Micro-batch k's token loss plus ``coef * N / n_k`` times its :meth:`part`: a mean over its
        ``n_k`` items, which the core's weight ``n_k / N`` turns into ``L_k n_k / N + coef * part``
        (a micro-batch of no item adds no part; a count tensor stays on the device: no host sync)."""
        part, n, coef = self.part(k, out.router_logits, out.token_mask), out.num_items, self.term.coef
        if isinstance(n, torch.Tensor):
            return out.loss + torch.where(n > 0, coef * self.items / n.clamp(min=1).to(part.dtype), 0.0) * part
        return out.loss + coef * self.items / n * part if n > 0 else out.loss


def run_moe_window(ctx: Any, micro_batches: List[Any], moe: MoELoss, *, micro_batch_size: Any = None) -> Any:
    """One window of an :class:`MoELoss` in mode ``"exact"``: the Accumulator's driver of :class:`Routing`
    (:func:`gradaccum._run.run_window` runs the cheaper modes as a ``(mean, count)`` ``loss_fn``)."""
    ranks, own = ctx.ranks, len(micro_batches)
    if micro_batches:
        ranks.remember(micro_batches[-1])  # to pad a later window where this rank has none
    routing = Routing.open(
        moe, micro_batches, route=lambda mb: moe.route(_unwrapped(ctx.model), mb),
        forward=lambda mb: moe.forward(ctx.model, mb), sync=ctx.sync, device=ctx.device, who="MoELoss",
        padding=_counting_padding(ctx, own), autocast=ctx.precision.autocast)
    # the window opens knowing its global N (R = N: each backward weighs n_k / N as the big batch does)
    plan = Plan(own, max(routing.sizes), min(routing.sizes), routing.items)
    request = Request(own, routing.local_items, can_pad=ranks.can_pad(bool(micro_batches)), plan=plan)
    with Window(ctx, request, micro_batch_size=micro_batch_size) as window:
        last = own + window.padding - 1
        for k in range(last + 1):
            if k < own:
                routing.replay(k)
            with window.micro_batch():
                out = _checked(moe.forward(ctx.model, micro_batches[k] if k < own else ctx.state.padding_batch))
                loss = routing.mean_loss(k, out) if k < own else out.loss
                if k == last:
                    routing.check()
                if k < own:
                    window.backward(loss, out.num_items)
                else:
                    window.backward_padding(loss)
        routing.finish()
        return window.step()


def _counting_padding(ctx: Any, own: int) -> List[Any]:
    """The counting forwards this rank runs first, for nothing: under FSDP2 every forward all-gathers the
    shards, so every rank runs as many as the busiest, padding with its padding batch (zero weight)."""
    if not ctx.sync.sharded_grads:
        return []
    padding = int(ctx.sync.all_gather(torch.tensor([own], device=ctx.device)).max()) - own
    if ctx.sync.any_rank(padding > 0 and ctx.state.padding_batch is None, ctx.device):
        raise ConfigurationError("MoELoss: a rank has fewer micro-batches than another and none to pad its counting "
                                 "forwards with (FSDP2 runs every forward on every rank): give it one with "
                                 "acc.set_padding(micro_batch)")
    return [ctx.state.padding_batch] * padding
