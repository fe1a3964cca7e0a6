"""A :class:`~gradaccum.WindowLoss` inside a Hugging Face ``Trainer``'s window: the Trainer keeps its
loop (its micro-batches, ``no_sync``, backward, clipping, optimizer and scheduler); this runs the cached
algorithm of :mod:`gradaccum._cached` across the Trainer's calls.

The Trainer hands over a window's micro-batches once (``get_batch_samples``), then calls
``compute_loss`` once per micro-batch, under ``no_sync`` but for the last. At micro-batch 0,
:meth:`TrainerWindow.start` runs pass 1 over all of them (no graph, the random state saved before
each), gathers every rank's representations (rank 0's first), computes the window's loss ``L`` and its
gradient ``g`` with respect to the representations and to the parameters the loss reaches itself (a
temperature). At micro-batch k, :meth:`TrainerWindow.part` runs its forward again (its random state
replayed) and returns the surrogate the Trainer backpropagates::

    s_k = W * sum_i <z_k,i, g_k,i>   (+ sum_p <p, g_p> in the last micro-batch)

DDP averages over the ``W`` ranks, so the reduced gradient is ``sum_{ranks, k} J_k^T g_k + g_p = grad L``:
the big batch's. The surrogate's *value* is ``L * n_k * W / N`` (``n_k`` rows of the ``N`` in the
window, every rank): the Trainer sums it over the window and averages over ranks, so it logs ``L``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._cached import (WindowLoss, _batchnorm_stats_kept, _differentiable, _flat, _same,
                       refuse_a_loss_without_representations, training_batchnorms)
from .._random import RandomState
from ..batching import _rebuild
from ..errors import ConfigurationError, replay_differs

__all__ = ["TrainerWindow", "TrainerWindows", "contrastive_window_loss", "refuse_what_a_window_loss_cannot_run",
           "window_loss_of", "window_compute_loss"]


class TrainerWindow:
    """One window of a :class:`~gradaccum.WindowLoss` under a Trainer, this rank's micro-batches.

    Args:
        window_loss: ``encode(model, micro_batch)`` -> representations; ``loss(model, representations)``.
        micro_batches: this rank's micro-batches of the window, as ``compute_loss`` will get them.
        gather: ``gather(tensors)`` -> (every rank's tensors joined along dim 0, rank 0's first;
            where this rank's rows start): the sync seam's ``gather_items``.
        world: ``W``, the ranks whose gradients DDP averages.
        params: the parameters ``loss`` may reach itself (its own, the model's temperature).
        check: compare pass 2's representations with pass 1's (the first window of a run).
    """

    def __init__(self, window_loss: WindowLoss, micro_batches: Sequence[Any], *,
                 gather: Callable[[List[torch.Tensor]], Tuple[List[torch.Tensor], int]], world: int,
                 params: Sequence[nn.Parameter], check: bool) -> None:
        self.window_loss, self.micro_batches = window_loss, list(micro_batches)
        self.gather, self.world, self.params, self.check = gather, world, list(params), check
        self.started = False
        self.ran = 0
        self.sizes: List[int] = []
        self.cached: List[List[torch.Tensor]] = []
        self.states: List[RandomState] = []
        self.end: Optional[RandomState] = None
        self.loss: Optional[torch.Tensor] = None
        self.slices: List[Optional[torch.Tensor]] = []
        self.own: List[Tuple[nn.Parameter, torch.Tensor]] = []
        self.total = 0
        self.alike = True
        self.kept: Optional[List[torch.Tensor]] = None  # micro-batch 0's representations with their graph
        self.differentiable: List[bool] = []

    # -- pass 1 and the loss ---------------------------------------------------------------------

    def start(self, module: nn.Module, loss_model: Any, device: torch.device, model: Optional[nn.Module] = None
              ) -> torch.Tensor:
        """Pass 1 on ``module`` (the unwrapped model: no collective), the gather, the window's loss on
        ``loss_model`` and its gradient. Returns ``L``. With ``model`` (the Trainer's, inside the
        Trainer's call for micro-batch 0, under its ``no_sync``), micro-batch 0's forward keeps its graph
        where the window has several micro-batches and no BatchNorm trains: its pass 2 is that graph's
        backward, without a second forward."""
        spec = None
        keep = (model is not None and len(self.micro_batches) > 1 and self.window_loss.keep_graphs > 0
                and not training_batchnorms(module))
        if self.world > 1:  # every rank alike: the kept forward runs through DDP, whose first forward is a collective
            keep = bool(self.gather([torch.tensor([[float(keep)]], device=device)])[0][0].min())
        with torch.no_grad(), _batchnorm_stats_kept(module):
            for k, mb in enumerate(self.micro_batches):
                self.states.append(RandomState(device))
                if k == 0 and keep:
                    with torch.enable_grad():
                        out = self.window_loss.encode(model, mb)
                    self.kept = _flat(out, _rows(out), k)
                    flat = [o.detach() for o in self.kept]
                else:
                    out = self.window_loss.encode(module, mb)
                    flat = _flat(out, _rows(out), k)
                self.sizes.append(flat[0].shape[0])
                self.cached.append(flat)
                spec = out if spec is None else spec
        self.end = RandomState(device)
        if spec is None:
            raise ConfigurationError("TrainerWindow: a window without micro-batches on this rank")
        local = [torch.cat(column) for column in zip(*self.cached)]
        joined, offset = self.gather(local)
        self.total = joined[0].shape[0]
        self.differentiable = _differentiable(spec)
        inputs = [t.detach().requires_grad_(d) for t, d in zip(joined, self.differentiable)]
        loss = self.window_loss.loss(loss_model, _rebuild(spec, iter(inputs)))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise ConfigurationError(f"WindowLoss: loss(model, representations) must return a scalar tensor that "
                                     f"depends on the representations, got {loss!r}")
        wrt = [t for t in inputs if t.requires_grad]
        params = [p for p in self.params if p.requires_grad]
        with torch.autocast(device_type=device.type, enabled=False):
            found = iter(torch.autograd.grad(loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss,
                                             wrt + params, allow_unused=True))
        of_inputs = [next(found) if t.requires_grad else None for t in inputs]
        refuse_a_loss_without_representations(of_inputs)
        mine = sum(self.sizes)
        self.slices = [None if g is None else g[offset:offset + mine] * self.world for g in of_inputs]
        self.own = [(p, g) for p, g in zip(params, found) if g is not None]
        self.loss = loss.detach()
        self.started = True
        return self.loss

    # -- pass 2 ----------------------------------------------------------------------------------

    def part(self, k: int, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        """Micro-batch k's forward again, its random state replayed: the surrogate to backpropagate."""
        assert self.started and self.loss is not None
        replayed = not (k == 0 and self.kept is not None)
        if replayed:
            self.states[k].restore()
            outs = _flat(self.window_loss.encode(model, micro_batch), self.sizes[k], k)
        else:  # pass 1 kept its graph
            outs, self.kept = self.kept, None
        if self.check:
            detached = [o for o, d in zip(outs, self.differentiable) if d and not o.requires_grad]
            if detached:
                raise ConfigurationError("WindowLoss: a representation encode returned does not require grad: it ran "
                                         "under torch.no_grad() or was detached. Return the model's outputs as they are")
            self.alike &= not replayed or _same(outs, self.cached[k])
        at = sum(self.sizes[:k])
        terms = [(o * g[at:at + self.sizes[k]].to(o.dtype)).sum() for o, g in zip(outs, self.slices) if g is not None]
        if k == len(self.micro_batches) - 1:
            terms += [(p * g.to(p.dtype)).sum() for p, g in self.own]  # rides in the backward that reduces
            assert self.end is not None
            self.end.restore()  # as after pass 1: the window drew its random numbers once
        dtype = torch.promote_types(self.loss.dtype, torch.float32)  # half-precision terms summed in float32
        surrogate = torch.stack([t.to(dtype) for t in terms]).sum() if terms else self.loss.to(dtype) * 0
        value = self.loss * (self.sizes[k] * self.world / max(self.total, 1))
        self.ran = k + 1
        return surrogate - surrogate.detach() + value.to(surrogate.dtype)

    def replay_was_alike(self) -> bool:
        return self.alike


#: ``make(micro_batches) -> (window_loss, params, loss_model)`` for one window
MakeWindow = Callable[[List[Any]], Tuple[WindowLoss, Sequence[nn.Parameter], Any]]


class TrainerWindows:
    """A Trainer's windows, one after the other: the micro-batches ``get_batch_samples`` hands over,
    the window being run, and whether the replay was compared yet (in the first window)."""

    def __init__(self, trainer: Any) -> None:
        refuse_what_a_window_loss_cannot_run(trainer)
        self.trainer = trainer
        self.pending: List[Any] = []
        self.window: Optional[TrainerWindow] = None
        self.checked = False

    def begin(self, batch_samples: List[Any]) -> None:
        self.pending, self.window = list(batch_samples), None

    def surrogate(self, model: nn.Module, inputs: Any, make: MakeWindow) -> torch.Tensor:
        """Micro-batch k's surrogate; pass 1 and the loss at the window's first micro-batch."""
        from ..sync import sync_for

        trainer = self.trainer
        window = self.window
        if window is None or window.ran == len(window.micro_batches):
            batches = [trainer._prepare_inputs(b) for b in self.pending]
            window_loss, params, loss_model = make(batches)
            sync = sync_for(trainer.model_wrapped)
            window = self.window = TrainerWindow(window_loss, batches, gather=sync.gather_items,
                                                 world=trainer.accelerator.num_processes, params=params,
                                                 check=not self.checked)
            window.start(trainer.accelerator.unwrap_model(model), loss_model, trainer.args.device, model)
        loss = window.part(window.ran, model, inputs)
        if window.ran == len(window.micro_batches) and not self.checked:
            self.checked = True
            flag = torch.tensor([float(not window.replay_was_alike())], device=trainer.args.device)
            if trainer.accelerator.num_processes > 1:
                flag = trainer.accelerator.gather(flag)
            if bool(flag.sum() > 0):
                raise replay_differs("WindowLoss", "gave other representations (encode's outputs)")
        return loss


def contrastive_window_loss(model: nn.Module) -> Optional[WindowLoss]:
    """The loss of a contrastive Hugging Face model (``CLIPModel``, ``SiglipModel``) as a WindowLoss:
    ``encode`` runs the model without its loss (``return_loss=False``) for the normalized text and
    image embeddings; ``loss`` is the model's own over the whole window, its ``logit_scale`` (and
    SigLIP's ``logit_bias``) reached through the model. None for another model."""
    name = type(model).__name__
    if name not in ("CLIPModel", "SiglipModel"):
        return None

    def encode(m: nn.Module, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        out = m(**{k: v for k, v in batch.items() if k not in ("return_loss", "labels")}, return_loss=False)
        return out.text_embeds, out.image_embeds

    def loss(m: nn.Module, reps: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        text, image = reps
        logits = text @ image.T * m.logit_scale.exp()
        if name == "CLIPModel":
            target = torch.arange(len(text), device=text.device)
            return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target)) / 2
        logits = logits + m.logit_bias
        signs = 2 * torch.eye(len(text), device=text.device, dtype=logits.dtype) - 1
        return -nn.functional.logsigmoid(signs * logits).sum(dim=-1).mean()

    return WindowLoss(encode, loss)


# -- ExactTrainer's hooks (gradaccum.integrations.hf_trainer calls these when it holds a WindowLoss) ------


def window_loss_of(kwargs: dict, args: tuple, source: str) -> Optional[WindowLoss]:
    """The WindowLoss an ExactTrainer trains with: ``compute_loss_func=WindowLoss(...)`` (taken out of
    the Trainer's arguments), or, without ``compute_loss_func``, a contrastive model's own loss
    (:func:`contrastive_window_loss`); None for every other model, and where a trainer's own
    ``compute_loss`` runs (``source`` is not "head")."""
    given = kwargs.get("compute_loss_func")
    if isinstance(given, WindowLoss):
        if source != "head":
            raise ConfigurationError(f"ExactTrainer(compute_loss_func=WindowLoss(...)) with a trainer whose own "
                                     f"compute_loss runs (items: {source}): the two losses conflict; use "
                                     "ExactTrainer itself with the WindowLoss")
        return kwargs.pop("compute_loss_func")
    if given is not None or source != "head":
        return None  # ExactTrainer refuses a compute_loss_func of another kind
    model = kwargs.get("model", args[0] if args else None)
    return contrastive_window_loss(model) if isinstance(model, nn.Module) else None


def window_compute_loss(windows: "TrainerWindows", window_loss: WindowLoss, accelerator: Any, model: nn.Module,
                        inputs: Any, return_outputs: bool) -> Any:
    """``compute_loss`` with a WindowLoss: in training micro-batch k's surrogate, in evaluation the
    loss of the evaluation batch alone."""
    module = accelerator.unwrap_model(model)
    if model.training:
        loss = windows.surrogate(model, inputs, lambda batches: (window_loss, list(module.parameters()),
                                                                           module))
    else:
        out = window_loss.encode(model, inputs)
        loss = window_loss.loss(module, _rebuild(out, iter(_flat(out, _rows(out), 0))))
    return (loss, {"loss": loss}) if return_outputs else loss


def _rows(out: Any) -> int:
    """The micro-batch's items: the leading size of the first tensor of the representations."""
    from ..batching import leaves
    from .._cached import Constant

    for _, leaf in leaves(out):
        leaf = leaf.tensor if isinstance(leaf, Constant) else leaf
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigurationError("WindowLoss: encode(model, micro_batch) returned no tensor with a leading dimension; "
                             "return the micro-batch's representations (a tensor, or a tuple/list/dict of tensors)")


def refuse_what_a_window_loss_cannot_run(trainer: Any) -> None:
    """A Trainer set-up under which the cached window is not tested: refused with the fix."""
    if trainer.args.n_gpu > 1:
        raise ConfigurationError(f"n_gpu={trainer.args.n_gpu} (DataParallel in one process) splits each batch without "
                                 "telling the loss; launch one process per GPU (torchrun) instead")
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ConfigurationError("a WindowLoss in the Trainer is tested with DDP (one process per device under "
                                 "torchrun), not with DeepSpeed or FSDP: train it with DDP")
    if getattr(trainer, "window_loss", None) is not None:  # ExactTrainer: the loss may read the model's parameters
        if trainer.args.ddp_find_unused_parameters:
            raise ConfigurationError(
                "ExactTrainer with a WindowLoss: ddp_find_unused_parameters=True makes DDP reduce a parameter the "
                "forward did not use before the backward, and refuse the gradient the window's loss gives it (a "
                "temperature read in the loss) there; leave ddp_find_unused_parameters unset or False")
        handler = getattr(trainer.accelerator, "ddp_handler", None)  # the loss's parameters ride in the reducing backward
        if handler is not None:
            handler.find_unused_parameters = False
    if trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        raise ConfigurationError("gradient_accumulation_kwargs={'sync_each_batch': True} reduces every micro-batch's "
                                 "surrogate: drop sync_each_batch")


@contextlib.contextmanager
def swapped(owner: nn.Module, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the block, the old value back after (also on an exception)."""
    old = owner._modules.get(name) if name in owner._modules else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
