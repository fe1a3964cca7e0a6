"""``Accumulator``: a window of micro-batches -> weighted backward -> one reduction -> one optimizer step. The facade
checks its arguments, builds the parts and runs each window (docs/architecture.md, "One micro-batch's trip")."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from ._accum_dtype import LowPrecisionWarning, driver_buffers, warn_low_precision_grad_sum, window_buffers
from ._autosize import AutoMicroBatch
from ._boundary import Boundary
from ._weights import Gradients
from ._ranks import RankAgreement, Rules, Request
from ._resume import Resumable
from ._settings import Settings, check_training_objects
from ._state import AccumulatorState
from ._training import TrainSpec, train_windows
from ._cached import WindowLoss, check_window_loss
from ._checks import ROWS, Count, item_count, positive_int
from ._run import LossFn, run_auto, run_window
from ._window import OpenWindow, Parts, Window
from .batching import Batch, CountFn, MicroBatchSize, as_micro_batches, check_micro_batch_size, count_items, leading_dim
from .errors import ConfigurationError, NotExactError
from .moe import MoELoss, check_moe_loss
from .precision import MixedPrecision
from .result import StepResult
from .schedule import AccumSteps
from .sync import GradSync, sync_for

#: the trainer drivers import ``driver_buffers`` and ``warn_low_precision_grad_sum`` from here
__all__ = ["Accumulator", "LowPrecisionWarning", "driver_buffers", "warn_low_precision_grad_sum"]

#: a learning-rate scheduler: anything with ``step()`` over the Accumulator's optimizer
Scheduler = Any


class Accumulator(Resumable):
    """Gradient accumulation that equals one optimizer step on the whole window.

    Args:
        model: the module: plain, ``DistributedDataParallel``, FSDP2 ``fully_shard``-ed, or anything holding one of
            them (``torch.compile(ddp_model)``, Accelerate's prepared model); or a ``deepspeed.initialize`` engine
            (ZeRO 1-3) with ``"managed_gradient_accumulation": false``, which owns the reduction, the optimizer,
            clipping and its scheduler (:mod:`gradaccum._deepspeed`).
        optimizer: any ``torch.optim.Optimizer`` over (some of) the model's trainable parameters (None, or the
            optimizer ``deepspeed.initialize`` returned, around a DeepSpeed engine).
        scheduler: stepped once per optimizer step taken, never on a skipped window (a ``ReduceLROnPlateau`` with
            the window's loss).
        max_grad_norm: clip the window's gradient to this total 2-norm, after normalization and unscaling.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        accum_dtype: where bf16/fp16 parameters' window gradient is summed. ``"auto"`` (the default): in float32
            buffers, rounded once to the parameter's dtype for the optimizer (single process; under DDP, FSDP2 or
            DeepSpeed the wrapper owns the sum, and a setting that sums in bf16 there is named in a warning). A
            dtype such as ``torch.float64``: buffers of that dtype. ``"param"`` (or None): the sum stays in the
            parameter's own ``.grad``, rounded to bf16's 8 bits of mantissa after every micro-batch, so its error
            grows with the window (bf16 GPT-2, K = 64: about 2x the floor; ``make bench``'s precision section), for 2
            bytes per parameter less while a window is open (float32 buffers hold 4 bytes, 2 more than the bf16
            ``.grad``: docs/guides/deepspeed.md's precision section).
        nonfinite: ``"skip"`` a window whose loss or measured gradient is not finite (with a warning the first
            time; ``acc.skipped`` counts them), or ``"raise"``.
        reduce_every_micro_batch: reduce (all-reduce / reduce-scatter) after every micro-batch instead of once per
            window: for FSDP2 this keeps only sharded gradients between micro-batches (less memory, N times the
            communication).
        data_parallel: ``"auto"`` finds the DDP or FSDP2 module in ``model`` and, when ``torch.distributed`` runs
            several ranks and none reduces the gradients, refuses the model (the replicas would drift apart).
            ``"none"`` trains each rank on its own items on purpose: no collective at all.
        compute_grad_norm: measure the window's total gradient norm for ``StepResult.grad_norm`` (one pass
            over the gradient). It is always measured with ``max_grad_norm`` or fp16; otherwise ``grad_norm`` is
            None and the non-finite check uses the window's loss, which costs nothing.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> acc.step((torch.randn(10, 3), torch.randn(10, 1)), mse, micro_batch_size=4).micro_batches
        3
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        scheduler: Scheduler = None,
        max_grad_norm: Optional[float] = None,
        precision: str = "fp32",
        accum_dtype: Union[None, str, torch.dtype] = "auto",
        nonfinite: str = "skip",
        reduce_every_micro_batch: bool = False,
        data_parallel: str = "auto",
        compute_grad_norm: bool = False,
    ) -> None:
        if hasattr(scheduler, "scheduler") and hasattr(scheduler, "gradient_state"):  # accelerator.prepare's:
            scheduler = scheduler.scheduler  # it steps the one inside once per process; here once per step
        settings = Settings(max_grad_norm, precision, accum_dtype, nonfinite, reduce_every_micro_batch, data_parallel,
                            compute_grad_norm)  # each checked as it is made
        optimizer, params = check_training_objects(model, optimizer, scheduler, settings)
        device = params[0].device
        #: the checked settings (:class:`~gradaccum._settings.Settings`)
        self.settings = settings
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.max_grad_norm = settings.max_grad_norm
        self.precision = MixedPrecision(precision, device)
        self.sync: GradSync = sync_for(model, reduce_every_micro_batch=reduce_every_micro_batch,
                                       data_parallel=data_parallel)
        # every parameter, not only those trainable now: one unfrozen later has its gradient summed in float32,
        # cleared, weighed and clipped with the window's (a frozen one never holds a gradient the window reads)
        everything = list(model.parameters())
        self.buffers = window_buffers(accum_dtype, self.sync, precision, everything)
        self.state = state = AccumulatorState()
        grads = Gradients(everything, self.buffers)
        state.trainable = tuple(p.requires_grad for p in grads.params)
        boundary = Boundary(optimizer, scheduler, state=state, precision=self.precision, sync=self.sync, grads=grads,
                            max_grad_norm=self.max_grad_norm, compute_grad_norm=settings.compute_grad_norm,
                            nonfinite=nonfinite, device=device)
        rules = Rules(self.sync.shares_windows, self.sync.needs_equal_counts,
                      reference_is_count=self.sync.needs_count_first)
        self.auto = AutoMicroBatch(self.sync, device, state)
        self.context = Parts(model=model, device=device, sync=self.sync, precision=self.precision, grads=grads,
                             ranks=RankAgreement(self.sync, device, state, rules), boundary=boundary,
                             slot=OpenWindow(), state=state)
        stepped = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer a wrapper (Accelerate's) holds
        if isinstance(stepped, torch.optim.Optimizer):  # a step of the caller's own inside a window: refused
            slot = weakref.ref(self.context.slot)  # the optimizer may outlive this Accumulator: its hook goes with it
            hook = stepped.register_step_pre_hook(lambda *step: None if slot() is None else slot().refuse_a_step(*step))
            weakref.finalize(self.context.slot, hook.remove)

    # -- the three ways in ----------------------------------------------------------------------

    def step(self, window: Union[Batch, Sequence[Batch]], loss_fn: LossFn, *,
             micro_batch_size: MicroBatchSize = None, num_items: Optional[CountFn] = None) -> StepResult:
        """Run the window's micro-batches and take exactly one optimizer step (or skip it).

        Args:
            window: a list of micro-batches, or one batch when ``micro_batch_size`` is given. Under data
                parallelism a rank whose data ran out passes ``[]``.
            loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss, or ``(mean_loss, num_items)``.
            micro_batch_size: split the batch along dim 0 into chunks of this size (the last may be smaller; a
                batch smaller than it is one micro-batch); ``"auto"`` starts from the whole batch (or the last size
                that worked) and halves on out-of-memory errors.
            num_items: ``num_items(micro_batch)`` -> how many items its mean loss is over, counted before any
                forward pass (e.g. ``gradaccum.count_targets(mb["labels"])``). A bare loss is then weighted by it
                instead of the leading dimension, and each backward weighs exactly ``n_k / N``. ``"rows"`` says a
                bare loss is a mean over the rows (dim 0). Without either, a bare loss on mapping micro-batches
                whose ``labels`` hold -100 (a Hugging Face model's ``outputs.loss`` on padded batches: a mean over
                targets) is refused before the first backward, with the fix.
        """
        ctx = self.context
        if ctx.slot.window is not None:
            ctx.slot.check_idle()  # raises: a window still open is refused before anything runs
        check_micro_batch_size(micro_batch_size)
        check_loss_call(self.sync, loss_fn, num_items, micro_batch_size)
        if micro_batch_size == "auto":
            return run_auto(ctx, self.auto, window, loss_fn, num_items)
        micro_batches, rows = as_micro_batches(window, micro_batch_size,  # type: ignore[arg-type]
                                               allow_empty=self.sync.shares_windows)
        if rows:  # the size used: the batch's own where it is smaller
            micro_batch_size = rows[0]
        counts = count_items(micro_batches, num_items, rows)
        if isinstance(loss_fn, (WindowLoss, MoELoss)):  # a loss that runs its window its own way
            return run_window(ctx, micro_batches, loss_fn, counts, micro_batch_size=micro_batch_size)  # type: ignore
        can_pad = ctx.sync.shares_windows and ctx.ranks.can_pad(bool(micro_batches))  # padding is across ranks
        request = Request(len(micro_batches), counts.total, can_pad=can_pad)
        with Window(ctx, request, micro_batch_size=micro_batch_size) as opened:
            opened.run(loss_fn, micro_batches, counts)
            return opened.step()

    def window(self, micro_batches: Optional[int] = None, *, num_items: Optional[Count] = None,
               micro_batch_size: Optional[Any] = None, pad: bool = False) -> Window:
        """Open a window for a hand-written loop (see :class:`~gradaccum.Window`).

        Args:
            micro_batches: this rank's micro-batches in the window (0 on a rank whose data ran out). Ranks agree
                on the counts when it opens.
            num_items: this rank's items in the window, if known before the first backward: R = N, no
                rescale (across ranks summed as the window opens; give it on every rank or on none).
            micro_batch_size: recorded in the window's ``StepResult.micro_batch_size`` (an int), for logs;
                the loop itself decides how it splits its data.
            pad: this loop runs ``window.padding`` zero-weight micro-batches when the ranks' counts call for it
                (DDP: a rank with none runs one; FSDP2: every rank as many as the most). Without it such a window is
                refused on every rank alike.
        """
        ctx, n = self.context, micro_batches
        if ctx.slot.window is not None:
            ctx.slot.check_idle()  # raises: a window is open
        if n is not None and not (type(n) is int and n > 0) and not (self.sync.shares_windows and n == 0):
            positive_int("micro_batches", n)
        if num_items is not None:
            item_count("num_items", num_items)
        return Window(ctx, Request(n, num_items, can_pad=pad), micro_batch_size=micro_batch_size)

    def train(self, loader: Iterable[Batch], loss_fn: LossFn, *, accum_steps: Optional[AccumSteps] = None,
              epochs: int = 1, drop_last: bool = False, num_items: Optional[CountFn] = None,
              micro_batch_size: Optional[str] = None) -> Iterator[StepResult]:
        """Group the loader's micro-batches into windows and step once per window, for ``epochs`` epochs from where
        training stands (call it once per epoch, or once for all).

        Windows come from the loader's :class:`~gradaccum.WindowSampler` (``batch_sampler=``), which knows where
        each global window ends and where training stands, or from ``accum_steps`` consecutive micro-batches: an
        int, ``{epoch: N}`` or ``epoch -> N``, epochs counted by ``acc.epoch`` (saved in ``state_dict``; an epoch
        left unfinished starts again). At the end of each epoch a shorter window is stepped, normalized by its own
        item count, unless ``drop_last=True``. A sampler with ``set_epoch`` is told each epoch. Under data
        parallelism every rank steps as often as the rank with the most windows (with ``drop_last``, the fewest); a
        rank whose data ran out contributes no items. ``micro_batch_size="auto"`` joins each window's micro-batches
        into one batch and splits it as ``step(..., micro_batch_size="auto")`` does, halving on out-of-memory.
        """
        self.context.slot.check_idle()
        check_loss_call(self.sync, loss_fn, num_items, micro_batch_size)
        if micro_batch_size not in (None, "auto"):
            raise ConfigurationError(f"train(micro_batch_size=...) takes 'auto' or None, got {micro_batch_size!r}: the "
                                     "loader's batches are the micro-batches; use 'auto' to re-split each window on "
                                     "out-of-memory errors")
        if micro_batch_size == "auto":
            self.auto.check_supported()
        auto = self.auto if micro_batch_size == "auto" else None
        return train_windows(self.context, loader, TrainSpec(loss_fn, accum_steps, epochs, drop_last, num_items, auto))

    def request_stop(self) -> None:
        """Ask every rank to stop: the next window's ``StepResult.stop_requested`` is True on every rank (the flag
        rides in the boundary's all-reduce: no collective of its own). Safe to call from a signal handler."""
        self.state.stop_requests += 1

    def set_padding(self, micro_batch: Batch) -> None:
        """A micro-batch this rank may run with zero weight in a window where it has none.

        Under DDP and FSDP2 every rank must run a forward in each window (they run collectives in forward: DDP's
        buffer broadcast and bucket rebuild, FSDP2's all-gathers). ``step()`` and ``train()`` repeat the last
        micro-batch a rank ran; a rank that has none yet (a fresh process resumed at a window where its share is
        empty) needs this one. Its loss must depend on the model as a real micro-batch's does; it adds nothing to
        the gradient or the counts.
        """
        leading_dim(micro_batch, argument="micro_batch")
        self.state.padding_batch = micro_batch


def check_loss_call(sync: GradSync, loss_fn: Any, num_items: Any, micro_batch_size: Any) -> None:
    """``step``/``train``'s ``loss_fn``, ``num_items`` and ``micro_batch_size``: a WindowLoss or MoELoss by its own
    rules, else a callable with a ``num_items`` function or None; neither two-pass loss around a DeepSpeed engine."""
    if isinstance(loss_fn, WindowLoss):
        check_window_loss(num_items, micro_batch_size)
    elif isinstance(loss_fn, MoELoss):
        check_moe_loss(loss_fn, num_items, micro_batch_size)
    elif not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, micro_batch), got {loss_fn!r}")
    elif num_items is not None and num_items != ROWS and not callable(num_items):
        raise TypeError(f"num_items must be a function micro_batch -> count or 'rows', got {num_items!r}; "
                        "pass counts of a hand-written loop to window.backward(loss, num_items=...)")
    # a WindowLoss's cached passes and an exact MoELoss's counting pass run forwards and backwards of
    # their own (the unwrapped module, torch.autograd.backward) that a DeepSpeed engine would not see
    two_pass = isinstance(loss_fn, WindowLoss) or (isinstance(loss_fn, MoELoss) and loss_fn.mode == "exact")
    if sync.owns_step and two_pass:
        raise NotExactError(
            f"{type(loss_fn).__name__} around a DeepSpeed engine is not supported yet: its extra passes bypass "
            "engine.backward (and ZeRO-3's gathered forward). Train it under DDP or FSDP2"
            + ("" if isinstance(loss_fn, WindowLoss) else ", or use MoELoss(mode='micro_batch')"))
