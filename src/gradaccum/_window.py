"""One window: its micro-batches' forward and weighted backward, then one boundary.

:class:`Window` owns the per-window state (micro-batches done, the loss sum, the item counts, the
padding); :class:`WindowContext` is everything a window needs from its Accumulator, passed
explicitly. :func:`run_window` is the one entry point that runs a list of micro-batches through a
``loss_fn``: ``Accumulator.step``, ``Accumulator.train`` and the out-of-memory back-off all call it.
The weights are :func:`gradaccum._maths.backward_weight`; the maths is in :mod:`gradaccum._maths`.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch import nn

from ._boundary import Boundary, InFlight, WindowTotals
from ._maths import backward_weight, loss_check_term
from ._checks import Count, as_number, item_count, positive_int, scalar_loss, split_loss_output, training_batchnorms
from ._gradients import WindowGradients
from ._ranks import RankAgreement, WindowPlan
from .batching import Batch, leading_dim, split_batch
from .precision import MixedPrecision
from .result import StepResult
from .sync import GradSync

__all__ = ["Window", "WindowContext", "OpenWindow", "run_window", "Counts", "count_items", "is_out_of_memory",
           "LossFn", "CountFn"]

#: ``loss_fn(model, micro_batch)`` -> the mean loss over the micro-batch's items, or ``(mean, count)``
LossFn = Callable[[nn.Module, Batch], Union[torch.Tensor, Tuple[torch.Tensor, Count]]]
#: ``num_items(micro_batch)`` -> how many items its mean loss is over, counted before any forward
CountFn = Callable[[Batch], Count]


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA's ``torch.OutOfMemoryError`` and the CPU allocator's "can't allocate memory"."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


class OpenWindow:
    """At most one window is open per Accumulator; opening one clears stale gradients and warns
    once about BatchNorm in training mode."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.window: Optional["Window"] = None
        self._warned = False

    def check_idle(self) -> None:
        if self.window is not None:
            raise RuntimeError(
                "a window is already open on this Accumulator: finish it with window.step() before "
                "calling step(), train() or window() again (a nested window would drop the open "
                "window's gradients)"
            )

    def enter(self, window: "Window") -> None:
        self.check_idle()  # before anything changes: a nested window would clear the open one
        if not self._warned and self.model.training:
            self._warned = True
            names = training_batchnorms(self.model)
            if names:
                warnings.warn(
                    f"the model holds BatchNorm layers in training mode ({', '.join(names[:3])}"
                    f"{', ...' if len(names) > 3 else ''}): their statistics are per micro-batch, so "
                    "accumulation is not equivalent to one big batch. Check with "
                    "gradaccum.check_equivalence, or use GroupNorm/LayerNorm.",
                    stacklevel=5,
                )
        self.window = window

    def leave(self, window: "Window") -> None:
        if self.window is window:
            self.window = None


@dataclass(frozen=True)
class WindowContext:
    """What a window needs from its Accumulator, in one explicit place."""

    model: nn.Module
    device: torch.device
    sync: GradSync
    precision: MixedPrecision
    grads: WindowGradients
    ranks: RankAgreement
    boundary: Boundary
    slot: OpenWindow


class _MicroBatch:
    """One micro-batch's context: the sync switch (skip the reduction unless ``reduces``) and autocast,
    each entered only where it does something (a local fp32 window pays for neither)."""

    __slots__ = ("window", "reduces", "stack")

    def __init__(self, window: "Window", reduces: bool) -> None:
        self.window, self.reduces = window, reduces
        self.stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> None:
        ctx = self.window.ctx
        if ctx.sync.distributed or ctx.precision.dtype is not None:
            stack = self.stack = contextlib.ExitStack()
            stack.enter_context(ctx.sync.micro_batch(last=self.reduces))
            stack.enter_context(ctx.precision.autocast())
        self.window.in_micro_batch = True
        self.window.reducing = self.reduces

    def __exit__(self, *exc: Any) -> None:
        self.window.in_micro_batch = False
        self.window.reducing = False
        if self.stack is not None:
            self.stack.close()  # restores every switch, also when an exception leaves the block


class Window:
    """One open window: its micro-batches, each a forward and backward, then one ``step()``.

    This is the lower-level path for people who keep their own loop; ``Accumulator.step`` is built
    on it. Every micro-batch runs inside ``micro_batch()`` (which skips the gradient reduction
    before the last one and autocasts) and hands ``backward`` its *mean* loss and item count::

        with acc.window(len(micro_batches)) as window:
            for mb in micro_batches:
                with window.micro_batch():
                    loss = criterion(model(mb[0]), mb[1])
                    window.backward(loss, num_items=len(mb[0]))
            result = window.step()

    Under data parallelism every rank runs a forward in each window (DDP and FSDP2 run collectives
    there). A rank whose data ran out opens ``acc.window(0, pad=True)``, runs ``window.padding``
    zero-weight micro-batches (any micro-batch it has, through ``window.backward_padding``) and steps
    with the others: it contributes no items, and the step stays exact::

        with acc.window(len(mine), pad=True) as window:
            for mb in mine: ...                           # as above
            for _ in range(window.padding):               # DDP: one on a rank with none; FSDP2: up to the most
                with window.micro_batch():
                    window.backward_padding(criterion(model(spare[0]), spare[1]))
            result = window.step()

    ``num_items=`` (this rank's items in the window, known before the first backward) makes each
    backward weigh exactly ``n_k / N`` and saves the scaling pass at the boundary.

    Leaving the block by an exception, or without ``step()``, drops the window's gradients.
    """

    def __init__(self, ctx: WindowContext, num_micro_batches: Optional[int], *,
                 num_items: Optional[Count] = None, micro_batch_size: Optional[Any] = None,
                 defer_reduction: bool = False, can_pad: bool = False,
                 plan: Optional[WindowPlan] = None) -> None:
        if num_micro_batches is not None and not (ctx.sync.distributed and num_micro_batches == 0):
            positive_int("num_micro_batches", num_micro_batches)
        if num_items is not None:
            item_count("num_items", num_items)
        self.ctx = ctx
        self.size = num_micro_batches
        self.micro_batch_size = micro_batch_size
        self.done = 0
        #: zero-weight micro-batches this rank runs so that every rank runs enough (DDP, FSDP2)
        self.padding = 0
        self.plan: Optional[WindowPlan] = plan  # agreed already (train() needs it before opening)
        self.in_micro_batch = False
        #: the micro-batch running now is the one whose backward reduces across ranks
        self.reducing = False
        self._num_items = num_items
        self._can_pad = can_pad
        self._open = False
        self._result: Optional[StepResult] = None
        self._abandoned = False
        self._defer = defer_reduction
        self._reference: Optional[float] = None  # R for this window when known up front
        self._sum_dtype = torch.float32 if ctx.device.type == "mps" else torch.float64
        self._loss_sum: Optional[torch.Tensor] = None  # sum n_k L_k, on the device (made by the first)
        self._host_items = 0.0  # sum of the counts given as Python numbers
        self._device_items: Optional[torch.Tensor] = None  # sum of the counts given as tensors
        self._in_flight: Optional[InFlight] = None  # the boundary's all-reduce, launched before the last backward
        #: the boundary all-reduces the window's totals across ranks (see Boundary.exchanges)
        self.exchanges = True
        self._reduced = False  # the backward that reduces across ranks has run
        self._share_note: Optional[str] = None  # this rank counted other items than its known share
        #: loss_fn returned its own count for some micro-batch (run_window sets it)
        self.counts_from_loss_fn = False

    # -- opening and closing ---------------------------------------------------------------------

    def __enter__(self) -> "Window":
        ctx = self.ctx
        ctx.slot.enter(self)
        ctx.grads.open()
        try:
            if self.size is not None and self.plan is None:
                self.plan = (ctx.ranks.local_plan(self.size, self._num_items, can_pad=self._can_pad)
                             or ctx.ranks.agree(self.size, self._num_items, self._can_pad))
            self._reference = ctx.ranks.window_reference(self.plan if self.size is not None else None,
                                                         self._num_items)
            known = self.plan.items if self.plan is not None and self.plan.share is not None else None
            self.exchanges = self._defer or ctx.boundary.exchanges(known, ctx.ranks.count_ratio)
            if self.plan is not None and self.size is not None:
                padding = ctx.ranks.padding(self.plan)
                # the agreement refused, on every rank alike, any window where a rank that must pad cannot
                assert padding == 0 or self._can_pad, "the agreement lets no rank pad that cannot"
                self.padding += padding
                self.size += padding
        except BaseException:
            self._close()
            raise
        self._open = True
        return self

    def _close(self) -> None:
        self.ctx.slot.leave(self)
        self.ctx.grads.close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._open = False
        self._close()
        if self._result is None:
            self.ctx.grads.clear()
            if exc_type is None and not self._abandoned:
                raise RuntimeError(
                    "the window was closed without step(); call window.step() inside the "
                    "`with acc.window(...)` block to take its optimizer step"
                )

    # -- micro-batches ---------------------------------------------------------------------------

    def micro_batch(self, *, last: Optional[bool] = None) -> _MicroBatch:
        """Context for one micro-batch's forward and backward.

        ``last`` defaults to "this is micro-batch number ``num_micro_batches``"; pass it when the
        window was opened without a size. Only the last micro-batch reduces gradients across ranks.
        """
        if not self._open:
            raise RuntimeError("use window.micro_batch() inside `with acc.window(...) as window:`")
        if self.size is not None and self.done >= self.size:
            raise RuntimeError(
                f"the window was opened for {self.size} micro-batches and all have run; "
                "call window.step(), or open it with the right num_micro_batches"
            )
        if last is None:
            if self.size is None:
                raise ValueError("pass micro_batch(last=...) when the window was opened without a size")
            last = self.done == self.size - 1
        return _MicroBatch(self, bool(last) and not self._defer)

    def _checked(self, loss: Any) -> torch.Tensor:
        if self._reduced:
            raise RuntimeError(
                "window.backward() after the backward of the micro-batch that reduces across ranks (the "
                "last): the window's gradient was already reduced and its counts fixed. Run one backward per "
                "micro_batch() block, and mark only the last micro-batch with micro_batch(last=True)"
            )
        if not self.in_micro_batch:
            raise RuntimeError(
                "window.backward() must run inside `with window.micro_batch():`, which also wraps "
                "the forward pass (DDP decides in forward whether the backward reduces)"
            )
        return scalar_loss(loss, where="window.micro_batch()")

    def _weight(self, num_items: Count, loss: torch.Tensor) -> Union[float, torch.Tensor]:
        ref = self._reference if self._reference is not None else self.ctx.ranks.reference_for(num_items)
        return backward_weight(num_items, ref, self.ctx.sync.grad_divisor, loss.dtype)

    def _backward(self, weighted: torch.Tensor) -> None:
        scaled = self.ctx.precision.scale(weighted)
        if self.ctx.precision.dtype is None:
            scaled.backward()
        else:  # the forward ran under autocast; its backward must not
            with torch.autocast(device_type=self.ctx.device.type, enabled=False):
                scaled.backward()

    def backward(self, loss: torch.Tensor, num_items: Count) -> None:
        """Backpropagate ``loss`` with the weight ``n_k * W / R``; remember its item sum for the step.

        Args:
            loss: the **mean** loss over the micro-batch's items, a scalar tensor.
            num_items: how many items that mean is over (an int, a float weight, or a tensor left on
                the device).
        """
        loss = self._checked(loss)
        item_count("num_items", num_items)
        weighted = loss * self._weight(num_items, loss)
        if isinstance(num_items, torch.Tensor):
            count = num_items.to(self._sum_dtype)
            part = loss.detach() * count
            self._device_items = count if self._device_items is None else self._device_items + count
            self._loss_sum = part.to(self._sum_dtype) if self._loss_sum is None else self._loss_sum.add_(part)
        else:
            self._host_items += num_items
            if self._loss_sum is None:  # the first: one op, in the sum's (float64) precision
                self._loss_sum = loss.detach().to(self._sum_dtype) * num_items
            else:
                self._loss_sum.add_(loss.detach(), alpha=num_items)  # promoted into the float64 sum
        self._backward(self._before_reduction(weighted))
        self.done += 1

    def _before_reduction(self, weighted: torch.Tensor) -> torch.Tensor:
        """Before the backward that reduces across ranks every count of the window is known: start
        the boundary's all-reduce now, so that it overlaps the backward (see :meth:`Boundary.launch`);
        or, in a window that exchanges nothing, fold this rank's loss check into the gradient
        (:func:`gradaccum._maths.loss_check_term`)."""
        if not (self.reducing and self.ctx.sync.distributed):
            return weighted
        self._reduced = True
        if self.exchanges:
            if self.ctx.boundary.launch_before_last_backward:
                self._in_flight = self.ctx.boundary.launch(self.totals(ran=True))
            return weighted
        assert self.plan is not None and self.plan.share is not None, "a window exchanges nothing only on a known share"
        share = self.plan.share
        if self._device_items is None and self._host_items != share:  # said after the boundary: a warning
            self._share_note = (  # filtered into an error here would leave the other ranks in the reduction
                f"this rank counted {self._host_items:g} items in a window where its WindowSampler share is "
                f"{share:g} (a collate_fn that drops rows, or a loss_fn that returns its own count): the "
                "window's global item count is not the one every rank assumed, so it is dropped on every "
                "rank (as a non-finite window). Windows that exchange their loss (Accumulator(loss_every=1)) "
                "sum the real counts instead")
        probe = self.ctx.grads.probe
        assert probe is not None, "a window exchanges nothing only with a reduced parameter to carry its check"
        term = loss_check_term(self._loss_sum, self._host_items, self._device_items, share, probe.reshape(-1)[0])
        return weighted if term is None else weighted + term

    def backward_padding(self, loss: torch.Tensor) -> None:
        """Backpropagate a zero-weight micro-batch: it adds nothing to the gradient or the counts, but
        runs the forward and backward collectives that ranks with data run."""
        loss = self._checked(loss)
        self._weight(0, loss)  # takes part in fixing R, as the ranks with data do
        weighted = self._before_reduction(loss * 0.0)
        with torch.autocast(device_type=self.ctx.device.type, enabled=False):
            self.ctx.precision.scale(weighted).backward()
        self.done += 1

    # -- the boundary ----------------------------------------------------------------------------

    @property
    def reference_items(self) -> Optional[float]:
        """R: the count the backward weights were divided by (see :mod:`gradaccum._maths`)."""
        return self._reference if self._reference is not None else self.ctx.ranks.reference_items

    def totals(self, *, ran: Optional[bool] = None) -> WindowTotals:
        """This rank's loss sum and item counts, as the boundary reads them."""
        loss_sum = self._loss_sum
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=self._sum_dtype, device=self.ctx.device)
        known = None if self.exchanges or self.plan is None else self.plan.items
        return WindowTotals(loss_sum, self._host_items, self._device_items, self.reference_items or 1.0,
                            ran=self.done > 0 if ran is None else ran,
                            can_pad=self._can_pad or self.ctx.ranks.replay is not None,
                            known_items=known, counts_from_loss_fn=self.counts_from_loss_fn)

    def abandon(self) -> None:
        """Drop this window's gradients and take no step (e.g. after an out-of-memory error)."""
        self._abandoned = True
        self.ctx.grads.clear()

    def step(self) -> StepResult:
        """Reduce counts, normalize, unscale, clip, take (or skip) the one optimizer step."""
        if self._result is not None:
            raise RuntimeError("step() was already called for this window; open a new one")
        empty_here = self.plan is not None and self.ctx.sync.distributed
        if self.done == 0 and not empty_here:
            raise RuntimeError(
                "step() on a window where window.backward() never ran: call "
                "window.backward(loss, num_items=...) inside `with window.micro_batch():` for each "
                "micro-batch (a plain loss.backward() is not counted, so the step could not be normalized)"
            )
        if self.size is not None and self.done != self.size:
            raise RuntimeError(
                f"the window was opened for {self.size} micro-batches but {self.done} ran; under "
                "data parallelism the last one is the one that reduces gradients, so the counts must match"
            )
        ctx = self.ctx
        if self._defer:
            ctx.sync.reduce_gradients_(ctx.grads.materialized())
        try:
            out = ctx.boundary.finish(self.totals(), self._in_flight, exchange=self.exchanges)
        finally:
            if self._share_note is not None:  # every rank has left the window's collectives
                warnings.warn(self._share_note, stacklevel=3)
        ctx.ranks.observe(self.plan, out.num_items, out.peers_can_pad)
        size, counted = self.micro_batch_size, self.done - self.padding
        loss = None if out.loss_sum is None else out.loss_sum / out.num_items if out.num_items > 0 else float("nan")
        self._result = StepResult(
            loss=loss,
            num_items=int(out.num_items) if float(out.num_items).is_integer() else out.num_items,
            micro_batches=counted, grad_norm=out.grad_norm, skipped=out.skipped, lr=out.lr, step=out.step,
            micro_batch_size=size if isinstance(size, int) else None, accum_steps=counted,
            stop_requested=out.stop_requested,
        )
        return self._result


# -- running a window's micro-batches ---------------------------------------------------------------

@dataclass(frozen=True)
class Counts:
    """Each micro-batch's item count before any forward pass, and their sum (a tensor count is read
    once, here: one host synchronisation per tensor)."""

    each: List[Count]
    total: float


def count_items(micro_batches: List[Batch], count_fn: Optional[CountFn]) -> Counts:
    """What a bare mean loss is weighted by: the leading dimension, or the ``num_items`` counter.
    Every micro-batch's leading dimensions are checked here, before anything runs."""
    each: List[Count] = [leading_dim(mb, argument=f"window[{i}]") for i, mb in enumerate(micro_batches)]
    if count_fn is not None:
        each = [item_count("num_items(micro_batch)", count_fn(mb)) for mb in micro_batches]
    return Counts(each, float(sum(as_number(c) for c in each)))


def _loss(window: Window, loss_fn: LossFn, micro_batch: Batch, count: Count) -> Tuple[torch.Tensor, Count]:
    out = loss_fn(window.ctx.model, micro_batch)
    if isinstance(out, (tuple, list)):
        window.counts_from_loss_fn = True
    return split_loss_output(out, count)


def run_window(ctx: WindowContext, micro_batches: List[Batch], loss_fn: LossFn, counts: Counts, *,
               micro_batch_size: Any = None, catch_oom: bool = False,
               plan: Optional[WindowPlan] = None) -> Optional[StepResult]:
    """Forward/backward every micro-batch (and the padding the ranks need), then step. With
    ``catch_oom``, an out-of-memory error drops the window and returns None, after every rank has
    agreed on it (their reductions are deferred to the boundary, so no rank waits in a backward)."""
    defer = catch_oom and ctx.sync.distributed  # no collective before the ranks agree
    # DDP runs collectives in a window's first forward (its buffer broadcast, its one bucket rebuild):
    # under "auto", every rank first runs that forward on one item with zero weight, so that an
    # out-of-memory error before a rank's forward cannot leave its peers waiting there
    flush = ([split_batch(micro_batches[0], 1)[0]]
             if defer and ctx.sync.collectives_in_forward and micro_batches else [])
    ranks = ctx.ranks
    with Window(ctx, len(flush) + len(micro_batches), num_items=counts.total, micro_batch_size=micro_batch_size,
                defer_reduction=defer, can_pad=bool(micro_batches) or ranks.replay is not None,
                plan=plan) as window:
        window.padding += len(flush)
        oom = False
        try:
            for mb in flush:
                with window.micro_batch():
                    window.backward_padding(_loss(window, loss_fn, mb, 0)[0])
            for mb, count in zip(micro_batches, counts.each):
                with window.micro_batch():
                    window.backward(*_loss(window, loss_fn, mb, count))
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an OOM we handle
            if not (catch_oom and is_out_of_memory(error)):
                raise
            oom = True
        if ctx.sync.distributed and micro_batches:
            ranks.replay = micro_batches[-1]  # to pad a later window where this rank has none
        if not oom:
            for _ in range(window.padding - len(flush)):
                with window.micro_batch():
                    window.backward_padding(_loss(window, loss_fn, ranks.replay, 0)[0])
        if defer:
            flag = torch.tensor([1.0 if oom else 0.0], device=ctx.device)
            oom = bool(ctx.sync.all_reduce_(flag, "max").item())
        if oom:
            window.abandon()
            return None
        return window.step()
