"""The one entry point that runs a list of micro-batches through a ``loss_fn`` and steps once.

``Accumulator.step``, ``Accumulator.train`` and the out-of-memory back-off all call :func:`run_window`:
it counts the micro-batches' items before any forward, opens a :class:`~gradaccum._window.Window`,
runs each micro-batch's forward and weighted backward (and the zero-weight padding the ranks need),
and steps. A :class:`~gradaccum.WindowLoss`, whose loss couples the window's items, runs through
:func:`gradaccum._cached.run_cached_window` instead, and an exact :class:`~gradaccum.MoELoss` (its
router's load balancing over the whole window) through :func:`gradaccum.moe.run_moe_window`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch import nn

from ._autosize import AutoMicroBatch
from ._cached import WindowLoss, run_cached_window
from ._checks import ROWS, Count, as_number, holds_ignored_labels, item_count, padded_rows_refusal, split_loss_output
from ._ranks import Plan, Request
from ._window import Window, Parts
from .moe import MoELoss, run_moe_window
from .batching import Batch, leading_dim, split_batch
from .errors import SplitError
from .result import StepResult

__all__ = ["LossFn", "CountFn", "is_out_of_memory", "Counts", "count_items", "run_window", "run_auto"]

#: ``loss_fn(model, micro_batch)`` -> the mean loss over the micro-batch's items, or ``(mean, count)``;
#: or a :class:`~gradaccum.WindowLoss`, for a loss over the whole window
LossFn = Union[Callable[[nn.Module, Batch], Union[torch.Tensor, Tuple[torch.Tensor, Count]]], WindowLoss]
#: ``num_items(micro_batch)`` -> how many items its mean loss is over, counted before any forward; or
#: ``"rows"``: a bare mean loss is over the micro-batch's rows (dim 0), declared so
CountFn = Union[Callable[[Batch], Count], str]
#: what a bare mean loss weighed by rows, undeclared, on padded labels is told to do instead
PADDED_ROWS_FIX = ("Pass num_items=lambda mb: gradaccum.count_targets(mb['labels']) (the targets of a causal LM; "
                   "shift=False for other heads), or return (mean, count) from loss_fn, e.g. "
                   "gradaccum.causal_lm_loss(outputs.logits, mb['labels']); if the mean really is over the rows, "
                   "say so: num_items='rows'")


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA's ``torch.OutOfMemoryError`` and the CPU allocator's "can't allocate memory"."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)



@dataclass
class Counts:
    """Each micro-batch's item count before any forward, and their sum (a tensor count is read once,
    here: one host synchronisation per tensor). ``unchecked``: micro-batches counted by their rows
    without ``num_items``, until a bare mean loss meets them (:meth:`weigh_bare_mean`)."""

    each: List[Count]
    total: float
    unchecked: Optional[List[Batch]] = None

    def weigh_bare_mean(self) -> None:
        """Before a bare mean loss is weighed by rows nobody declared: refused where the labels hold
        -100, whose mean is over targets (checked once per window, before its first backward)."""
        batches, self.unchecked = self.unchecked, None
        if batches and holds_ignored_labels(batches):
            raise padded_rows_refusal("Accumulator", PADDED_ROWS_FIX)


def count_items(micro_batches: List[Batch], count_fn: Optional[CountFn]) -> Counts:
    """What a bare mean loss is weighted by: the leading dimension (``count_fn`` None or ``"rows"``),
    or the ``num_items`` counter. Every micro-batch's leading dimensions are checked here, before
    anything runs."""
    try:
        each: List[Count] = [leading_dim(mb) for mb in micro_batches]
    except SplitError:  # said again naming the micro-batch (the name is built only for the error)
        for i, mb in enumerate(micro_batches):
            leading_dim(mb, argument=f"window[{i}]")
        raise
    if count_fn is None or count_fn == ROWS:
        labelled = count_fn is None and any(isinstance(mb, Mapping) and "labels" in mb for mb in micro_batches)
        return Counts(each, float(sum(each)), micro_batches if labelled else None)  # ints: no count to read
    each = [item_count("num_items(micro_batch)", count_fn(mb)) for mb in micro_batches]  # type: ignore[operator]
    return Counts(each, float(sum(as_number(c) for c in each)))


def _backward(window: Window, loss_fn: Callable[..., Any], micro_batch: Batch, count: Count, counts: Counts) -> None:
    """One micro-batch's forward through ``loss_fn`` and its weighted backward, inside its block."""
    with window.micro_batch():
        out = loss_fn(window.ctx.model, micro_batch)
        if type(out) is torch.Tensor:  # a bare mean loss, weighed by the count known up front
            if counts.unchecked is not None:
                counts.weigh_bare_mean()
            window.backward(out, count)
            return
        loss, counted = split_loss_output(out, count)
        window.backward(loss, counted, from_loss_fn=isinstance(out, (tuple, list)))


def _backward_padding(window: Window, loss_fn: Callable[..., Any], micro_batch: Batch) -> None:
    """A zero-weight micro-batch (the flush, or the padding the ranks ask for), inside its block."""
    with window.micro_batch():
        window.backward_padding(split_loss_output(loss_fn(window.ctx.model, micro_batch), 0)[0])


def run_window(ctx: Parts, micro_batches: List[Batch], loss_fn: LossFn, counts: Counts, *,
               micro_batch_size: Any = None, catch_oom: bool = False,
               plan: Optional[Plan] = None) -> Optional[StepResult]:
    """Forward/backward every micro-batch (and the padding the ranks need), then step. With
    ``catch_oom``, an out-of-memory error drops the window and returns None, after every rank has
    agreed on it (their reductions are deferred to the boundary, so no rank waits in a backward)."""
    if isinstance(loss_fn, WindowLoss):
        return run_cached_window(ctx, micro_batches, loss_fn, counts, micro_batch_size=micro_batch_size, plan=plan)
    if isinstance(loss_fn, MoELoss):
        if loss_fn.mode == "exact":
            return run_moe_window(ctx, micro_batches, loss_fn, counts, micro_batch_size=micro_batch_size,
                                  catch_oom=catch_oom, plan=plan)
        loss_fn = loss_fn.per_micro_batch()  # the cheaper modes: a (mean, count) loss_fn like any other
    defer = catch_oom and ctx.sync.reduces_across_ranks  # no collective before the ranks agree
    # DDP runs collectives in a window's first forward (its buffer broadcast, its one bucket rebuild):
    # under "auto", every rank first runs that forward on one item with zero weight, so that an
    # out-of-memory error before a rank's forward cannot leave its peers waiting there
    flush = ([split_batch(micro_batches[0], 1)[0]]
             if defer and ctx.sync.collectives_in_forward and micro_batches else [])
    ranks = ctx.ranks
    request = Request(len(flush) + len(micro_batches), counts.total, can_pad=ranks.can_pad(bool(micro_batches)),
                            defer=defer, plan=plan, flush=len(flush))
    with Window(ctx, request, micro_batch_size=micro_batch_size) as window:
        oom = False
        try:
            for mb in flush:
                _backward_padding(window, loss_fn, mb)
            for mb, count in zip(micro_batches, counts.each):
                _backward(window, loss_fn, mb, count, counts)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an OOM we handle
            if not (catch_oom and is_out_of_memory(error)):
                raise
            oom = True
        if micro_batches:
            ranks.remember(micro_batches[-1])  # to pad a later window where this rank has none
        if not oom:
            for _ in range(window.padding):  # what the ranks' counts ask of this rank
                _backward_padding(window, loss_fn, ctx.state.padding_batch)
        if defer:
            oom = ctx.sync.any_rank(oom, ctx.device)
        if oom:
            window.abandon()
            return None
        return window.step()


def run_auto(ctx: Parts, auto: AutoMicroBatch, batch: Batch, loss_fn: LossFn,
             count_fn: Optional[CountFn]) -> StepResult:
    """One window of ``micro_batch_size="auto"``: ``batch`` split at the size that last worked and
    re-split at half on an out-of-memory error (:mod:`gradaccum._autosize`), each attempt a
    :func:`run_window` that drops itself on every rank alike."""
    return auto.step(batch, lambda mbs, size: run_window(ctx, mbs, loss_fn, count_items(mbs, count_fn),
                                                         micro_batch_size=size, catch_oom=True))
