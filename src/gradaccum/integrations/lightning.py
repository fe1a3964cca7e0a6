"""PyTorch Lightning: exact gradient accumulation with one callback.

    trainer = Trainer(accumulate_grad_batches=4, callbacks=[ExactAccumulation(num_items=count)])

Lightning's automatic optimization backpropagates ``L_k / A`` for every micro-batch (``A`` =
``accumulate_grad_batches``, also on the short last window of an epoch) and DDP averages over the
``W`` ranks, so every micro-batch weighs the same whatever it holds. :class:`ExactAccumulation`
weighs each one by its item count instead; nothing else of the loop changes.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

try:
    import pytorch_lightning as pl
    from pytorch_lightning import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gradaccum.integrations.lightning needs PyTorch Lightning: pip install 'gradaccum[lightning]' "
        "(or pip install 'pytorch-lightning>=2.4')"
    ) from exc

__all__ = ["ExactAccumulation"]

Count = Union[int, float, torch.Tensor]
NumItems = Callable[[Any], Count]


def leading_dimension(batch: Any) -> int:
    """The batch's size: the leading dimension of its first tensor (a tensor, the first element of a
    tuple or list, or the first value of a mapping, searched depth first)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("ExactAccumulation: the batch is a 0-d tensor, it has no leading dimension to count; "
                             "pass num_items=lambda batch: <its item count>")
        return int(batch.shape[0])
    values: Sequence[Any] = ()
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = batch
    for value in values:
        try:
            return leading_dimension(value)
        except ValueError:
            continue
    raise ValueError(f"ExactAccumulation: found no tensor in a batch of type {type(batch).__name__} to count "
                     "items by its leading dimension; pass num_items=lambda batch: <its item count>")


def _as_count(value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"ExactAccumulation: {where} returned a tensor of shape {tuple(value.shape)}; "
                             "it must be one number, the micro-batch's item count")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ExactAccumulation: {where} returned {value!r} ({type(value).__name__}); "
                        "it must be a number, the micro-batch's item count")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"ExactAccumulation: {where} returned {value!r}; an item count is finite and >= 0")
    return float(value)


class ExactAccumulation(Callback):
    """Make Lightning's gradient accumulation exactly one big batch, on one process or under DDP.

    ``training_step`` keeps returning its mean loss ``L_k`` over the micro-batch's ``n_k`` items.
    The optimizer then steps on

        grad = sum_{ranks, k in window} n_k * grad(L_k) / N,   N = sum_{ranks, k in window} n_k,

    the gradient of the mean over every item of the window on every rank: a micro-batch of padded
    sequences counts by its target tokens, the short last window of an epoch by what it holds.

    How: Lightning backpropagates ``L_k / A`` (``A`` = ``accumulate_grad_batches``) and DDP averages
    over ``W`` ranks. A hook on the loss multiplies micro-batch k's backward by ``c_k = A * W * n_k / R``,
    so the window's synced gradient is ``sum n_k grad(L_k) / R``; in ``on_before_optimizer_step``,
    which Lightning calls after the last backward of the window and *before* gradient clipping, the
    window's count is all-reduced once and the gradients are multiplied by ``R / N``. ``R`` is a fixed
    reference count agreed once per ``fit`` (``A`` times the ranks' first micro-batch counts, all-reduced)
    so that the gradients keep Lightning's own scale until the step (what fp16 loss scaling expects).

    Unchanged: the logged and returned loss (only its gradient is scaled), ``gradient_clip_val``
    (applied to the normalized gradient), schedulers, ``global_step``, checkpoints,
    ``GradientAccumulationScheduler`` (``A`` is read every micro-batch). Cost: one scalar all-reduce
    per optimizer step, and one per ``fit``.

    Args:
        num_items: How many items a batch holds. ``None`` (default): the leading dimension of the
            batch's first tensor. A callable ``batch -> int | Tensor``, e.g.
            ``lambda batch: count_targets(batch["labels"])`` for a causal LM (next-token targets that
            are not -100). Or leave it ``None`` and return ``(mean_loss, count)`` from
            ``training_step``; the callback hands Lightning the mean.

    Raises:
        TypeError: ``num_items`` is neither ``None`` nor callable, or a count is not a number.
        ValueError: a count is negative or not finite, or ``training_step`` returns a count while
            ``num_items`` is set too.
        RuntimeError: manual optimization, or a strategy that accumulates by itself (DeepSpeed).

    Example:
        >>> from gradaccum import count_targets
        >>> cb = ExactAccumulation(num_items=lambda batch: count_targets(batch["labels"]))
        >>> trainer = pl.Trainer(accumulate_grad_batches=4, gradient_clip_val=1.0, callbacks=[cb])  # doctest: +SKIP

    Limits: automatic optimization with one optimizer; strategies that average gradients over ranks
    (single device, DDP; FSDP follows the same maths but is untested); optimizers that call their
    closure once per step (not LBFGS); a fit resumed in the middle of a window (Lightning saves at
    window ends) counts only the micro-batches seen after the resume.
    """

    def __init__(self, num_items: Optional[NumItems] = None) -> None:
        if num_items is not None and not callable(num_items):
            raise TypeError(f"ExactAccumulation(num_items={num_items!r}): num_items must be None (count the "
                            "batch's leading dimension) or a callable batch -> item count, e.g. "
                            "num_items=lambda batch: count_targets(batch['labels'])")
        self.num_items = num_items
        self._reference: Optional[float] = None   # R, agreed across ranks once per fit
        self.pending: Optional[float] = None      #:  n_k of the micro-batch about to be backpropagated
        self._window = 0.0                        # sum of n_k backpropagated since the last zero_grad
        self._batch: Any = None                   # the micro-batch, for the leading-dimension count
        self._original_training_step: Optional[Callable[..., Any]] = None
        self.last_window_items: Optional[float] = None  # N of the last step, all ranks: for logs and tests

    # -- set-up ------------------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise RuntimeError("ExactAccumulation works with automatic optimization; this LightningModule sets "
                               "automatic_optimization = False. Weight its losses by hand, or use "
                               "gradaccum.Accumulator in training_step")
        if trainer.strategy.handles_gradient_accumulation:
            raise RuntimeError(f"ExactAccumulation: strategy {type(trainer.strategy).__name__} accumulates gradients "
                               "itself (DeepSpeed), so the per-micro-batch weights cannot be applied; use strategy='ddp'")
        self._reference = None
        self._window = 0.0
        self._wrap_training_step(pl_module)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and self._original_training_step is not None:
            if "training_step" in vars(pl_module):
                del pl_module.training_step  # the class's method shows through again
            self._original_training_step = None

    def _wrap_training_step(self, pl_module: "pl.LightningModule") -> None:
        """Accept ``(mean, count)`` from ``training_step``: Lightning itself refuses tuples, so no valid
        return value changes meaning. The wrapper is an instance attribute, removed at teardown."""
        if self._original_training_step is not None:
            return
        original = pl_module.training_step
        callback = self

        def training_step(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, tuple):
                if len(out) != 2:
                    raise ValueError(f"ExactAccumulation: training_step returned a tuple of {len(out)} values; "
                                     "return the mean loss, or (mean_loss, item_count)")
                if callback.num_items is not None:
                    raise ValueError("ExactAccumulation: training_step returned (mean, count) and num_items is set "
                                     "too; keep one source of the count (drop num_items=... or return the mean)")
                callback.pending = _as_count(out[1], "training_step's (mean, count)")
                return out[0]
            return out

        self._original_training_step = original
        pl_module.training_step = training_step  # type: ignore[method-assign]

    # -- per micro-batch ---------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.num_items is not None:
            self.pending = _as_count(self.num_items(batch), "num_items(batch)")
        else:
            self.pending = None  # the leading dimension, unless training_step returns a count
        self._batch = batch

    def on_before_zero_grad(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                            optimizer: torch.optim.Optimizer) -> None:
        self._window = 0.0  # a new window: the gradients are zeroed before its first backward

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           loss: torch.Tensor) -> None:
        n = self.pending
        if n is None:
            n = float(leading_dimension(self._batch))
        self.pending = None
        self._batch = None
        if self._reference is None:
            self._reference = self._agree_reference(trainer, n)
        self._window += n
        scale = trainer.accumulate_grad_batches * trainer.world_size * n / self._reference
        if loss.requires_grad:
            loss.register_hook(lambda grad: grad * scale)

    def _agree_reference(self, trainer: "pl.Trainer", n: float) -> float:
        """R = A * sum over ranks of the first micro-batch's count: the same on every rank, near N."""
        total = self._all_reduce(trainer, n)
        return trainer.accumulate_grad_batches * (total if total > 0 else trainer.world_size)

    @staticmethod
    def _all_reduce(trainer: "pl.Trainer", value: float) -> float:
        if trainer.world_size == 1:
            return value
        exact = float(value).is_integer()
        t = torch.tensor(int(value) if exact else value, dtype=torch.int64 if exact else torch.float64,
                         device=trainer.strategy.root_device)
        return float(trainer.strategy.reduce(t, reduce_op="sum").item())

    # -- per window --------------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._reference is None:
            return  # no backward ran in this window (every training_step returned None)
        total = self._all_reduce(trainer, self._window)
        self._window = 0.0
        self.last_window_items = total
        factor = self._reference / total if total > 0 else 0.0
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)
