"""PyTorch Lightning: exact gradient accumulation with one callback, :class:`ExactAccumulation`, which drives the
window core :class:`gradaccum._weights.WindowWeights` (the running R) from Lightning's hooks (docs/guides/lightning.md).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ._versions import FLOORS, require

require("pytorch-lightning", "gradaccum.integrations.lightning")
try:
    import pytorch_lightning as pl
    from pytorch_lightning import Callback
    from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gradaccum.integrations.lightning needs PyTorch Lightning: pip install 'gradaccum[lightning]' "
        f"(or pip install 'pytorch-lightning>={FLOORS['pytorch-lightning']}')"
    ) from exc

from .._cached import WindowLoss
from .._checks import ROWS, Count, ignored_labels, item_count, padded_rows_refusal
from .._gradients import AccumulationBuffers
from .._patching import Swaps
from .._settings import nonfinite_choice
from .._state import AccumulatorState
from .._weights import WindowWeights
from .._empty import graph_leaves
from ..accumulator import driver_buffers
from ..batching import leading_dim
from ..errors import ConfigurationError, NotExactError
from .hf_router import refuse_aux_term

__all__ = ["ExactAccumulation", "strategy_model", "count_step"]


class ExactAccumulation(Callback):
    """Make Lightning's gradient accumulation exactly one big batch, on one process, under DDP or
    under FSDP2 (``ModelParallelStrategy``).

    ``training_step`` keeps returning its mean loss ``L_k`` over the micro-batch's ``n_k`` items.
    The optimizer then steps on

        grad = sum_{ranks, k in window} n_k * grad(L_k) / N,   N = sum_{ranks, k in window} n_k,

    the gradient of the mean over every item of the window on every rank. What windows teach each other
    is :attr:`state`, in Lightning's checkpoint; a window of ``N = 0`` items, or whose gradient is not
    finite, is skipped as the core skips it (:attr:`skipped` counts it). How, what stays Lightning's, the cost and the limits:
    docs/guides/lightning.md ("What it changes", "Limits").

    Args:
        num_items: A callable ``batch -> int | Tensor``, the micro-batch's item count (e.g.
            ``lambda batch: count_targets(batch["labels"])``). ``None`` (default): the batch's leading
            dimension, or the count ``training_step`` returns as ``(mean_loss, count)``
            (docs/guides/lightning.md, "The one line"); a bare mean on a dict batch whose ``labels`` hold
            -100 (padding: a mean over its targets, not its rows) is refused, naming the fix. ``"rows"``:
            the leading dimension, declared (no such refusal).
        accum_dtype: ``"auto"`` (default) or ``"param"``: where bf16/fp16 parameters sum the window
            (docs/guides/deepspeed.md, "bf16 and fp16 parameters").
        nonfinite: ``"skip"`` (default) a window whose loss or gradient is not finite (a nan or inf in any
            micro-batch, on any rank: read from the norm of the window's gradient, before Lightning clips):
            no optimizer or scheduler step, ``global_step`` not advanced, :attr:`skipped` counts it, a
            warning once; or ``"raise"`` ``FloatingPointError`` at that window. With a ``16-mixed`` loss
            scaler the scaler skips an overflowing step itself.

    Raises:
        TypeError, ConfigurationError, NotExactError: as docs/guides/lightning.md ("Misuse that is
            refused") lists, in ``__init__`` or ``setup``, before any step; a bare mean on padded labels
            counted by rows at the window's boundary, before that window's step.

    Example:
        >>> from gradaccum import count_targets
        >>> cb = ExactAccumulation(num_items=lambda batch: count_targets(batch["labels"]))
        >>> trainer = pl.Trainer(accumulate_grad_batches=4, gradient_clip_val=1.0, callbacks=[cb])  # doctest: +SKIP
    """

    def __init__(self, num_items: Optional[Callable[[Any], Count]] = None, accum_dtype: str = "auto",
                 nonfinite: str = "skip") -> None:
        self.nonfinite = nonfinite_choice("ExactAccumulation", nonfinite)
        if num_items not in (None, ROWS) and not callable(num_items):
            raise TypeError(f"ExactAccumulation(num_items={num_items!r}): num_items must be None or 'rows' (count "
                            "the batch's leading dimension) or a callable batch -> item count, e.g. "
                            "num_items=lambda batch: count_targets(batch['labels'])")
        driver_buffers("ExactAccumulation", (), accum_dtype, owns_the_sum=True, fix="")  # refuses a bad name now
        self.num_items, self.accum_dtype = num_items, accum_dtype
        self.buffers: Optional[AccumulationBuffers] = None  # float32 sums of bf16/fp16 gradients (None: in .grad)
        #: what the fit's windows teach each other: fresh for each fit, saved in Lightning's checkpoint
        self.state = AccumulatorState()
        self.pending: Optional[Count] = None      #:  n_k of the micro-batch about to be backpropagated
        self._window: Optional[WindowWeights] = None  # the open window (running R)
        self._count: Count = 0                    # the items the open window has weighed on this rank (its n_k summed)
        self._batch: Any = None                   # the micro-batch, for the leading-dimension count
        self._padded: Optional[torch.Tensor] = None  # a bare mean's labels held -100 in the open window
        self.skipping = False                     #: the window that just closed takes no step
        self._hooks = Swaps()                     # the module's hooks wrapped for this fit
        self._nothing = contextlib.ExitStack()    # during a backward of a micro-batch that may hold no item

    @property
    def skipped(self) -> int:
        """Windows skipped in this fit (a resumed fit included), of 0 items or whose gradient was not finite."""
        return self.state.skipped

    @property
    def last_window_items(self) -> Optional[float]:
        """N of the last window with items, all ranks: ``state.last_window_items``."""
        return self.state.last_window_items

    CHECKPOINT_KEY = "gradaccum.ExactAccumulation"  #: where Lightning's checkpoint holds the state's saved fields
    MID_WINDOW_KEY = CHECKPOINT_KEY + ".mid_window"  #: whether it was saved inside a window

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: Dict[str, Any]) -> None:
        """The :attr:`state`'s saved fields, under :attr:`CHECKPOINT_KEY` (a ``state_dict`` would have Lightning
        refuse two callbacks before :func:`_refuse_a_second_callback` names both and the fix)."""
        checkpoint[self.CHECKPOINT_KEY] = self.state.saved()
        checkpoint[self.MID_WINDOW_KEY] = self._window is not None  # that window's gradient is not saved

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: Dict[str, Any]) -> None:
        """On resume (after ``setup``): the saved state, if the checkpoint holds one; one saved inside a window is
        refused, before any step."""
        if checkpoint.get(self.MID_WINDOW_KEY):
            raise ConfigurationError(
                "ExactAccumulation: this checkpoint was saved inside a window, after some of its micro-batches (a "
                "ModelCheckpoint after a validation that is not at a window's end): their gradient is not in it, so a "
                "fit resumed from it would step on the rest of the window alone. Resume from a checkpoint saved at a "
                "window's end (an earlier one, if this one came from a signal or an exception), and save them there: "
                "val_check_interval a multiple of accumulate_grad_batches, or ModelCheckpoint(every_n_train_steps=...)")
        saved = checkpoint.get(self.CHECKPOINT_KEY)
        if isinstance(saved, dict):
            self.state.load_saved(self.state.read_saved(saved))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_items={self.num_items!r})"

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        _refuse_what_is_not_exact(trainer, pl_module)
        if self.buffers is not None:
            self.buffers.retire()  # a previous fit's, where its teardown never ran
        # one device without a loss scaler (which unscales .grad before on_before_optimizer_step): the sum is ours
        owns = isinstance(trainer.strategy, SingleDeviceStrategy) and getattr(trainer.precision_plugin, "scaler",
                                                                              None) is None
        self.buffers = driver_buffers(
            "ExactAccumulation", pl_module.parameters(), self.accum_dtype, owns_the_sum=owns,
            fix="Keep float32 parameters and train with precision='bf16-mixed' (autocast) to sum in float32 (under "
                "DDP/FSDP2 the wrapper owns the sum; with a 16-mixed scaler Lightning unscales .grad first), or pass "
                "ExactAccumulation(accum_dtype='param') to accept it without this warning")
        self.state, self._window = AccumulatorState(), None  # a checkpoint's is loaded after setup
        self._hooks.wrap(pl_module, "training_step", self._returning_a_count)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A scheduler with ``interval="step"`` does not step after a skipped window (wrapped after Lightning
        has validated the schedulers: an overridden hook would pass any scheduler); LBFGS refused."""
        if any(isinstance(o, torch.optim.LBFGS) for o in trainer.optimizers):
            raise ConfigurationError("ExactAccumulation: LBFGS calls its closure, each micro-batch's forward and "
                                     "backward, several times per step, which no window of micro-batches weighs as "
                                     "one big batch; use a first-order optimizer (SGD, Adam, AdamW)")

        def unless_skipped(original: Callable[..., Any]) -> Callable[..., Any]:
            def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
                if self.skipping and any(config.scheduler is scheduler and config.interval == "step"
                                         for config in trainer.lr_scheduler_configs):
                    return None
                return original(scheduler, metric)
            return lr_scheduler_step

        self._hooks.wrap(pl_module, "lr_scheduler_step", unless_skipped)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._hooks.restore()
            if self.buffers is not None:
                self.buffers.retire()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._nothing.close()
        self.teardown(trainer, pl_module, "fit")  # Lightning skips teardown after an exception

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.skipping, self._batch = False, batch
        if self._window is None:  # the window's first micro-batch: the running R (its count is known at its end)
            self._window, self._count = WindowWeights(self.state, trainer.world_size, buffers=self.buffers), 0
            self._padded = None  # whether a bare mean's labels held -100 in this window, on their device
        # None: the leading dimension, unless training_step returns a count
        self.pending = None if self.num_items in (None, ROWS) else item_count("num_items(batch)", self.num_items(batch))

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           loss: torch.Tensor) -> None:
        n = self.pending
        if n is None:
            try:
                n = leading_dim(self._batch)
            except ValueError as exc:
                raise ConfigurationError(f"ExactAccumulation counts a batch's items by its leading dimension, but the "
                                         f"{exc} Or pass num_items=lambda batch: <its item count>, or return "
                                         "(mean_loss, count) from training_step") from None
            padded = ignored_labels([self._batch]) if self.num_items is None else None  # read at the boundary
            if padded is not None:
                self._padded = padded if self._padded is None else self._padded | padded
        self.pending, self._batch = None, None
        window = self._window
        if window.reference is None:  # the ranks' first micro-batches: once per fit (then in the state)
            window.fix_reference(trainer.accumulate_grad_batches * _all_reduce(trainer, n)[0])
        leaves = (pl_module.parameters if isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy))
                  else lambda: graph_leaves(loss))  # FSDP2: the unsharded parameters the forward ran on
        self._count = self._count + n
        self._nothing.enter_context(window.weigh(loss, n, leaves, divided_by=trainer.accumulate_grad_batches))

    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._nothing.close()  # the hooks of a micro-batch that may hold no item

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        """The boundary, before Lightning clips (docs/architecture.md, "Lightning's ``ExactAccumulation``")."""
        window, self._window = self._window, None  # opened by on_train_batch_start
        count, padded = _all_reduce(trainer, self._count, self._padded)  # every rank learns of any rank's padding
        if padded:  # a bare mean over targets, weighed by rows
            raise padded_rows_refusal(
                "ExactAccumulation: training_step", "Pass ExactAccumulation(num_items=lambda batch: gradaccum."
                "count_targets(batch['labels'])) (the targets of a causal LM; shift=False for other heads), or "
                "return (mean, count) from training_step; if the mean really is over the rows: num_items='rows'")
        total = item_count("ExactAccumulation: the window's item count (its counts summed over the window and the "
                           "ranks)", count)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        closing = window.hand_over(params, total)
        if getattr(trainer.precision_plugin, "scaler", None) is None:  # every rank holds the same reduced gradient
            closing = window.judge(closing, params, nonfinite=self.nonfinite, who="ExactAccumulation")  # one verdict
        self.skipping, said = not closing.steps, None
        if self.skipping:  # Lightning counts the step after this hook returns
            trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.increment_by(-1)
            if trainer.is_global_zero:
                said = "global_step not advanced; ExactAccumulation.skipped counts them"
        window.record(closing, warn_empty=said and f"ExactAccumulation: no optimizer or scheduler step, {said}",
                      warn_nonfinite=said and window.judged_skip_warning("ExactAccumulation", closing, said))

    def _returning_a_count(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Accept ``(mean, count)`` from ``training_step`` (a tuple Lightning itself would refuse)."""

        def training_step(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, WindowLoss):
                raise ConfigurationError(
                    "ExactAccumulation: training_step returned a WindowLoss; a loss that couples the window's items "
                    "(in-batch negatives, CLIP) is not a mean per micro-batch, so no weighting makes Lightning's "
                    "accumulation exact. Use manual optimization with gradaccum.Accumulator in training_step "
                    "(docs/guides/lightning.md, 'A loss that couples the batch'): acc.step(batch, window_loss)")
            if isinstance(out, tuple):
                if len(out) != 2:
                    raise ConfigurationError(f"ExactAccumulation: training_step returned a tuple of {len(out)} values; "
                                             "return the mean loss, or (mean_loss, item_count)")
                if self.num_items is not None:
                    raise ConfigurationError("ExactAccumulation: training_step returned (mean, count) and num_items is "
                                             "set too; keep one source of the count (drop num_items=... or return the "
                                             "mean)")
                self.pending = item_count("the count in training_step's (mean_loss, count)", out[1])
                return out[0]
            return out

        return training_step


def _all_reduce(trainer: "pl.Trainer", count: Count, flag: Optional[torch.Tensor] = None) -> Tuple[float, bool]:
    """The sum of ``count`` over the ranks, on the host (a float64 sum of counts is exact), and whether ``flag``
    (a device bool, None: unset) is set on any rank, in the same all-reduce."""
    if trainer.world_size == 1 and flag is None:
        return float(count), False
    device = trainer.strategy.root_device
    local = torch.stack([torch.as_tensor(count, dtype=torch.float64).detach().to(device).reshape(()),
                         torch.zeros((), dtype=torch.float64, device=device) if flag is None
                         else flag.detach().to(device, torch.float64).reshape(())])
    if trainer.world_size > 1:
        local = trainer.strategy.reduce(local, reduce_op="sum")
    total, flagged = local.tolist()  # one host synchronisation for both
    return total, flagged > 0


def _refuse_what_is_not_exact(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
    """In ``setup``, before any step: what the callback cannot make one big batch, refused with the fix."""
    _refuse_a_second_callback(trainer)
    if not pl_module.automatic_optimization:
        raise ConfigurationError("ExactAccumulation works with automatic optimization; this LightningModule sets "
                                 "automatic_optimization = False. Weight its losses by hand, or use "
                                 "gradaccum.Accumulator in training_step")
    if trainer.strategy.handles_gradient_accumulation:
        raise NotExactError(f"ExactAccumulation: strategy {type(trainer.strategy).__name__} accumulates gradients "
                            "itself (DeepSpeed), so the per-micro-batch weights cannot be applied; use strategy='ddp' "
                            "or ModelParallelStrategy (FSDP2)")
    for module in pl_module.modules():  # an MoE model's router load-balancing term, per micro-batch
        refuse_aux_term(getattr(module, "config", None), "ExactAccumulation",
                        "Set model.config.output_router_logits = False (the model's loss then leaves the term "
                        "out) or router_aux_loss_coef = 0.0; or train with gradaccum.Accumulator and "
                        "gradaccum.MoELoss, which computes it over the window")


def strategy_model(pl_module: "pl.LightningModule") -> torch.nn.Module:
    """The model to give an :class:`~gradaccum.Accumulator` inside ``training_step`` under manual
    optimization: Lightning's DDP wrapper of ``pl_module`` (whose ``forward`` it calls, and whose
    reduction the Accumulator runs once per window), or ``pl_module`` itself on one device. Call it
    once training has started (``on_train_start``), when the strategy has wrapped the module."""
    model = pl_module.trainer.strategy.model
    return model if model is not None else pl_module


def count_step(pl_module: "pl.LightningModule", result: Any) -> None:
    """Count the optimizer step an Accumulator took inside ``training_step`` (manual optimization) as
    Lightning counts one: ``global_step`` advances, as ``self.optimizers().step()`` would advance it.
    A skipped window (``result.skipped``) is not counted."""
    if result.skipped:
        return
    optimizer = pl_module.optimizers()
    optimizer = optimizer[0] if isinstance(optimizer, list) else optimizer
    optimizer._on_before_step()
    optimizer._on_after_step()


def _refuse_a_second_callback(trainer: "pl.Trainer") -> None:
    """Two callbacks would each weigh every micro-batch (``configure_callbacks()``'s are merged by setup)."""
    mine = [f"trainer.callbacks[{i}] = {cb!r}" for i, cb in enumerate(trainer.callbacks)  # type: ignore[attr-defined]
            if isinstance(cb, ExactAccumulation)]
    if len(mine) > 1:
        raise ConfigurationError(f"this Trainer holds {len(mine)} ExactAccumulation callbacks ({'; '.join(mine)}): each "
                         "would weigh every micro-batch and rescale every step again, away from one big batch. Keep "
                         "exactly one: remove the others from Trainer(callbacks=[...]), your config's "
                         "trainer.callbacks, or LightningModule.configure_callbacks()")
