"""A :class:`~gradaccum.WindowLoss` inside a Hugging Face ``Trainer``'s window: the cached two passes
(:class:`gradaccum._cached.CachedPasses`) driven from the Trainer's ``compute_loss`` (docs/guides/contrastive.md)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._cached import CachedPasses, WindowLoss
from ..errors import ConfigurationError
from ..losses import contrastive_window_loss
from ..sync import sync_for
from .hf_driver import refuse_untested

__all__ = ["TrainerWindows", "window_loss_of"]


class TrainerWindows:
    """A Trainer driver's windows (docs/architecture.md, "The cached two passes"): the micro-batches
    ``get_batch_samples`` hands over and their CachedPasses; ``prepare`` is the trainer's ``_prepare_inputs``,
    ``make(module, micro_batches) -> (window_loss, params, loss_model)`` the window's loss (``module``: the
    unwrapped model). A set-up under which the cached window is not tested is refused with the fix."""

    def __init__(self, trainer: Any, prepare: Callable[[Any], Any],
                 make: Callable[[nn.Module, List[Any]], Tuple[WindowLoss, Sequence[nn.Parameter], Any]]) -> None:
        refuse_untested(trainer, "training with a WindowLoss")
        if getattr(trainer, "window_loss", None) is not None:  # ExactTrainer: the loss may read the model's parameters
            if trainer.args.ddp_find_unused_parameters:
                raise ConfigurationError(
                    "ExactTrainer with a WindowLoss: ddp_find_unused_parameters=True makes DDP reduce a parameter the "
                    "forward did not use before the backward, and refuse the gradient the window's loss gives it (a "
                    "temperature read in the loss) there; leave ddp_find_unused_parameters unset or False")
            # the loss's parameters ride in the reducing backward
            handler = getattr(trainer.accelerator, "ddp_handler", None)
            if handler is not None:
                handler.find_unused_parameters = False
        if trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
            raise ConfigurationError("gradient_accumulation_kwargs={'sync_each_batch': True} reduces every "
                                     "micro-batch's surrogate: drop sync_each_batch")
        self.trainer, self.prepare, self.make = trainer, prepare, make
        self.pending: List[Any] = []
        self.passes: Optional[CachedPasses] = None
        trainer.can_return_loss = True  # an eval_loss for a batch without labels (CLIP without return_loss)

    def begin(self, batch_samples: List[Any]) -> None:
        self.pending, self.passes = list(batch_samples), None

    def surrogate(self, model: nn.Module) -> torch.Tensor:
        """Micro-batch k's surrogate; pass 1 and the loss's gradient in the window's first call."""
        trainer, passes = self.trainer, self.passes
        if passes is None or passes.ran == passes.parts:
            batches = [self.prepare(b) for b in self.pending]
            module = trainer.accelerator.unwrap_model(model)
            window_loss, params, loss_model = self.make(module, batches)
            sync, device = sync_for(trainer.model_wrapped), trainer.args.device
            passes = self.passes = CachedPasses(window_loss, batches, sync=sync, device=device,
                                                checked=trainer.accumulator_state.checked_replays)
            if not batches:
                raise ConfigurationError("ExactTrainer: a window without micro-batches on this rank")
            passes.first_pass(module, graph_model=model)
            passes.gather()  # N: the window's rows, every rank's
            window = trainer.open_window(passes.total, passes.parts)  # the driver records it after the last micro-batch
            passes.loss_gradient(loss_model, params, weight=window.window_loss_weight(passes.total))
        loss = passes.surrogate(passes.ran, model)
        if passes.ran == passes.parts:
            passes.finish()
        return loss


def window_loss_of(kwargs: dict, args: tuple, source: str) -> Optional[WindowLoss]:
    """The WindowLoss an ExactTrainer trains with: ``compute_loss_func=WindowLoss(...)`` (taken out of
    ``kwargs``), else a contrastive model's own where ExactTrainer computes the loss; else None."""
    given = kwargs.get("compute_loss_func")
    if isinstance(given, WindowLoss):
        if source != "head":
            raise ConfigurationError(f"ExactTrainer(compute_loss_func=WindowLoss(...)) with a trainer whose own "
                                     f"compute_loss runs (items: {source}): the two losses conflict; use "
                                     "ExactTrainer itself with the WindowLoss")
        return kwargs.pop("compute_loss_func")
    if given is not None:
        name = getattr(given, "__qualname__", type(given).__name__)
        raise ConfigurationError(f"ExactTrainer(compute_loss_func={name}): ExactTrainer "
                                 "cannot weigh a loss whose reduction it does not know. A loss that couples the "
                                 "batch's rows (in-batch negatives, contrastive) goes in as compute_loss_func="
                                 "gradaccum.WindowLoss(encode, loss), run over the whole window; for the model's "
                                 "own loss drop compute_loss_func (ExactTrainer computes it), or use Trainer")
    if source != "head":
        return None
    model = kwargs.get("model", args[0] if args else None)
    return contrastive_window_loss(model) if isinstance(model, nn.Module) else None
