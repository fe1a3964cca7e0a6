"""The router's load-balancing term over the window, for :class:`~gradaccum.integrations.hf_trainer.ExactTrainer`.

The Trainer hands ExactTrainer the window's micro-batches in ``get_batch_samples`` before their first
forward; :class:`WindowBalance` counts their expert choices there (a forward without a graph, the
random state saved before each; the model's trunk without its LM head), sums the counts over the ranks in one all-reduce, and then gives each
micro-batch's training forward its part of the window's load-balancing loss, with its random state
replayed so that it routes as it did when counted. The maths is :mod:`gradaccum.moe`'s and
:func:`gradaccum._maths.balance_loss_part`'s.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..errors import replay_differs
from .._maths import balance_loss_part, router_statistics
from .._random import RandomState
from ..moe import RouterBalance, require_router_grad, router_logits_of

__all__ = ["WindowBalance"]


def _mask(inputs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The tokens the model's own ``load_balancing_loss_func`` balances: its 2-D ``attention_mask``."""
    mask = inputs.get("attention_mask")
    return mask.reshape(-1) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None




class WindowBalance:
    """One window's expert counts ``C`` and rows ``T`` (every rank's), and what replays its forwards.

    Args:
        term: the model's :class:`~gradaccum.moe.RouterBalance` (E, top-k, coef).
        model: the unwrapped model (no DDP: counting runs no collective).
        batches: the window's micro-batches, already on the device, as the model takes them.
        device: where counts are made.
        reduce: sums a tensor over the ranks in place (identity on one process).
    """

    def __init__(self, term: RouterBalance, model: nn.Module, batches: List[Dict[str, Any]], device: torch.device,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.term = term
        self.states: List[RandomState] = []
        self.first: List[torch.Tensor] = []
        totals = torch.zeros(term.num_experts + 1, dtype=torch.float64, device=device)
        was_training = model.training
        model.train()  # routes as the training forward will (jitter and dropout on)
        # the router logits without the LM head; under FSDP2 the root (its lazy init wants the root
        # first) and no_grad (inference tensors would end up in its unsharded parameters)
        sharded = type(model).__name__.startswith("FSDP")
        trunk = model if sharded else getattr(model, "base_model", model)
        with torch.no_grad() if sharded else torch.inference_mode():
            for inputs in batches:
                self.states.append(RandomState(device))
                out = trunk(**inputs, output_router_logits=True)
                counts, _, rows = router_statistics(out.router_logits, term.top_k, _mask(inputs))
                self.first.append(counts)
                totals += torch.cat([counts.to(torch.float64), rows.to(torch.float64).reshape(1)])
        model.train(was_training)
        self.end = RandomState(device)
        totals = reduce(totals)  # every rank's counts: once per window, before any backward
        self.counts, self.rows = totals[:-1], totals[-1]
        self.differs = torch.zeros((), dtype=torch.bool, device=device)

    def replay(self, k: int) -> None:
        """Micro-batch k's random state, as it was when it was counted."""
        self.states[k].restore()

    def run(self, k: int, model: nn.Module, inputs: Dict[str, Any], forward: Callable[[], Any],
            trainer: Any = None) -> Tuple[Any, torch.Tensor]:
        """Micro-batch k's training forward (``forward()``, from its replayed random state, its router
        logits read by hooks) and :meth:`part`. With a TRL ``trainer``, its own per-micro-batch aux
        term is off for the forward (the window's part replaces it)."""
        self.replay(k)
        kept = getattr(trainer, "aux_loss_enabled", None)
        if kept is not None:
            trainer.aux_loss_enabled = False
        try:
            with router_logits_of(model) as router_logits:
                out = forward()
        finally:
            if kept is not None:
                trainer.aux_loss_enabled = kept
        return out, self.part(k, router_logits, inputs)

    def part(self, k: int, router_logits: List[torch.Tensor], inputs: Dict[str, Any]) -> torch.Tensor:
        """``coef * balance_loss_part(S_k, C, T, T)``: micro-batch k's share of the window's weighted
        load-balancing loss (the shares of every micro-batch on every rank sum to it)."""
        require_router_grad(router_logits, "ExactTrainer")
        counts, probs, _ = router_statistics(router_logits, self.term.top_k, _mask(inputs))
        self.differs = self.differs | (counts.detach() != self.first[k]).any()
        rows = self.rows.to(probs.dtype)
        return self.term.coef * balance_loss_part(probs, self.counts.to(probs.dtype), rows, rows)

    def check(self, any_rank: Callable[[bool], bool]) -> None:
        """Before the window's last backward, on every rank: the training forwards routed as counted."""
        if any_rank(bool(self.differs)):
            raise replay_differs("ExactTrainer", "routed its tokens to other experts")

    def finish(self) -> None:
        """After the window: the random state as the counting pass left it (drawn once per window)."""
        self.end.restore()
