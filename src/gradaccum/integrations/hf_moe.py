"""The Trainer drivers' glue to :class:`gradaccum.moe.Routing` (which counts, agrees, replays and
checks): an MoE model's load-balancing term over the window, opened in ``get_batch_samples`` and applied
by :meth:`~gradaccum.integrations.hf_driver.TrainerDriver.balanced`. How: docs/guides/moe.md.
"""
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
from .hf_router import BALANCED_FAMILIES, RouterBalance, aux_term, hf_routing, hf_token_mask, router_logits_of

__all__ = ["TrainerBalance", "trl_aux_refusal", "trl_router_balance"]


def trl_router_balance(trainer: Any) -> Optional[RouterBalance]:
    """The load-balancing term a TRL RL trainer (GRPO, RLOO) turned on (``aux_loss_enabled``), or None:
    TRL asks every forward for the router logits and weighs them by its own ``router_aux_loss_coef``, so
    :func:`gradaccum.integrations.hf_router.aux_term` of the model's config with those two set.

    Raises:
        NotExactError: a family whose router loss gradaccum does not compute over the step (TRL would add
            it per micro-batch); the fix is TRL's ``router_aux_loss_coef=0.0``.
    """
    coef = trainer.router_aux_loss_coef if getattr(trainer, "aux_loss_enabled", False) else 0.0
    if not coef:
        return None
    config = trainer.accelerator.unwrap_model(trainer.model).config
    view = copy.copy(config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config)
    view.output_router_logits, view.router_aux_loss_coef = True, float(coef)
    try:
        return aux_term(view)
    except NotExactError as unknown:  # TRL asks for the router logits whatever the config says: its coef is the fix
        raise trl_aux_refusal(trainer, f"which the model ({getattr(config, 'model_type', None)}) adds by a formula "
                              f"gradaccum does not compute over the step (supported: {', '.join(BALANCED_FAMILIES)}), "
                              "and TRL would add it per micro-batch") from unknown


def trl_aux_refusal(trainer: Any, why: str, then: str = "") -> NotExactError:
    """The refusal of a TRL trainer's router loss (TRL's ``router_aux_loss_coef``, which rewrites the
    model's config) where gradaccum does not compute it over the window: ``why``, and TRL's argument as the fix."""
    return NotExactError(
        f"{type(trainer).__name__}: router_aux_loss_coef={getattr(trainer, 'router_aux_loss_coef', None)} turns on "
        f"the MoE router's load-balancing loss, {why}. Pass {type(trainer.args).__name__}(..., "
        f"router_aux_loss_coef=0.0) to train without it{then}")


class TrainerBalance:
    """One window's :class:`~gradaccum.moe.Routing`, opened and driven from the Trainer's hooks.

    Args:
        term: the model's :class:`~gradaccum.integrations.hf_router.RouterBalance` (E, top-k, coef).
        model: the unwrapped model (the counting pass runs no collective but FSDP2's).
        batches: the window's micro-batches, already on the device, as the model takes them.
        device: where counts are made.
        wrapped: the Trainer's wrapped model (``model_wrapped``: DDP, FSDP2 or the model), whose
            :func:`gradaccum.sync.sync_for` seam runs the window's collectives.
        who: the driver, named in the refusals.
    """

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
            trainer: Any = None) -> Tuple[Any, torch.Tensor]:
        """Micro-batch k's training forward (``forward()``, from its replayed random state, its router
        logits read by hooks) and ``coef`` times its part of the window's load-balancing loss. With a
        TRL ``trainer``, its own per-micro-batch aux term is off for the forward (the window's part
        replaces it)."""
        self.routing.replay(k)
        own_term_off = (swapped(trainer, "aux_loss_enabled", False) if hasattr(trainer, "aux_loss_enabled")
                        else contextlib.nullcontext())
        with own_term_off, router_logits_of(model) as router_logits:
            out = forward()
        part = self.routing.part(k, router_logits, hf_token_mask(inputs))
        self.total += part.detach()
        return out, self.routing.term.coef * part
