"""The Trainer drivers' glue to :class:`gradaccum.moe.Routing`: an MoE model's load-balancing term over the
window (docs/guides/moe.md)."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._patching import swapped
from ..errors import NotExactError
from ..moe import MoEOutput, Routing
from ..sync import sync_for
from .hf_router import (BALANCED_FAMILIES, RouterBalance, aux_term, hf_routing, hf_token_mask, router_logits_of,
                        text_config)

__all__ = ["TrainerBalance", "trl_aux_refusal", "trl_router_balance"]


def trl_router_balance(trainer: Any) -> Optional[RouterBalance]:
    """The load-balancing term a TRL trainer turned on (``aux_loss_enabled``, its ``router_aux_loss_coef``), or
    None; a family gradaccum does not compute over the step is refused."""
    coef = trainer.router_aux_loss_coef if getattr(trainer, "aux_loss_enabled", False) else 0.0
    if not coef:
        return None
    config = trainer.accelerator.unwrap_model(trainer.model).config
    view = copy.copy(text_config(config))
    view.output_router_logits, view.router_aux_loss_coef = True, float(coef)
    try:
        return aux_term(view)
    except NotExactError as unknown:  # TRL asks for the router logits whatever the config says: its coef is the fix
        raise trl_aux_refusal(trainer, f"which the model ({getattr(config, 'model_type', None)}) adds by a formula "
                              f"gradaccum does not compute over the step (supported: {', '.join(BALANCED_FAMILIES)}), "
                              "and TRL would add it per micro-batch") from unknown


def trl_aux_refusal(trainer: Any, why: str, then: str = "") -> NotExactError:
    """The refusal of a TRL trainer's router loss: ``why``, and TRL's ``router_aux_loss_coef=0.0`` as the fix."""
    return NotExactError(
        f"{type(trainer).__name__}: router_aux_loss_coef={getattr(trainer, 'router_aux_loss_coef', None)} turns on "
        f"the MoE router's load-balancing loss, {why}. Pass {type(trainer.args).__name__}(..., "
        f"router_aux_loss_coef=0.0) to train without it{then}")


class TrainerBalance:
    """One window's :class:`~gradaccum.moe.Routing` over ``batches`` (on the device), driven from the Trainer's
    hooks; ``model`` unwrapped, ``wrapped`` the Trainer's ``model_wrapped``, whose seam runs the collectives."""

    def __init__(self, term: RouterBalance, model: nn.Module, batches: List[Dict[str, Any]], device: torch.device,
                 wrapped: nn.Module, who: str = "ExactTrainer") -> None:
        # only the seam's collectives are used (the Trainer switches the gradient sync itself), so it is
        # asked for no skipped reduction (which DDP(static_graph=True) would refuse)
        sync = sync_for(wrapped, reduce_every_micro_batch=True)
        was_training = model.training
        model.train()  # routes as the training forward will (jitter and dropout on)
        try:
            trunk = getattr(model, "base_model", model)
            self.routing = Routing.open(
                term, batches, route=lambda inputs: MoEOutput(None, None, *hf_routing(trunk, inputs)),
                forward=lambda inputs: MoEOutput(None, None, *hf_routing(model, inputs)), sync=sync, device=device,
                who=who)
        finally:
            model.train(was_training)
        #: this rank's parts of the window's load-balancing loss (without ``coef``), summed: what a log shows
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    def run(self, k: int, model: nn.Module, inputs: Dict[str, Any], forward: Callable[[], Any],
            trainer: Any) -> Tuple[Any, torch.Tensor]:
        """Micro-batch k's replayed forward and ``coef`` times its part of the window's load-balancing loss (a TRL
        ``trainer``'s own aux term off meanwhile)."""
        self.routing.replay(k)
        own_term_off = (swapped(trainer, "aux_loss_enabled", False) if hasattr(trainer, "aux_loss_enabled")
                        else contextlib.nullcontext())
        with own_term_off, router_logits_of(model) as router_logits:
            out = forward()
        part = self.routing.part(k, router_logits, hf_token_mask(inputs))
        self.total += part.detach()
        return out, self.routing.term.coef * part
