"""The window of ``Accumulator.train`` and of ``micro_batch_size="auto"``, run as ``Accumulator.step`` runs its own,
or handed to the loops of a :class:`~gradaccum.WindowLoss` and an exact :class:`~gradaccum.MoELoss`."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch import nn

from ._autosize import AutoMicroBatch
from ._cached import WindowLoss, run_cached_window
from ._checks import Count
from ._ranks import Plan, Request
from ._window import Parts, Window
from .batching import Batch, CountFn, Counts, count_items, split_batch
from .moe import MoELoss, run_moe_window
from .result import StepResult

__all__ = ["LossFn", "run_window", "run_auto"]

#: ``loss_fn(model, micro_batch)`` -> the mean loss over the micro-batch's items, or ``(mean, count)``;
#: or a :class:`~gradaccum.WindowLoss`, for a loss over the whole window
LossFn = Union[Callable[[nn.Module, Batch], Union[torch.Tensor, Tuple[torch.Tensor, Count]]], WindowLoss]


def run_window(ctx: Parts, micro_batches: List[Batch], loss_fn: LossFn, counts: Counts, *,
               micro_batch_size: Any = None, catch_oom: bool = False,
               plan: Optional[Plan] = None) -> Optional[StepResult]:
    """Forward/backward every micro-batch (and the padding the ranks need), then step. With ``catch_oom``, an
    out-of-memory error on any rank drops the window on all and returns None (their reductions are deferred
    to the boundary, so no rank waits in a backward)."""
    ctx.slot.check_idle()  # before a two-pass loss's first pass: a window still open is refused first
    if isinstance(loss_fn, WindowLoss):
        return run_cached_window(ctx, micro_batches, loss_fn, counts, micro_batch_size=micro_batch_size, plan=plan)
    if isinstance(loss_fn, MoELoss):
        if loss_fn.mode == "exact":
            # counts and plan are the routing's (Routing.open all-gathers them; num_items and "auto" were refused)
            return run_moe_window(ctx, micro_batches, loss_fn, micro_batch_size=micro_batch_size)
        loss_fn = loss_fn.per_micro_batch()  # the cheaper modes: a (mean, count) loss_fn like any other
    defer = catch_oom and ctx.sync.shares_windows  # no collective before the ranks agree
    # DDP runs collectives in a window's first forward (its buffer broadcast, its one bucket rebuild): under "auto",
    # every rank first runs it on one item with zero weight, so an out-of-memory error cannot leave peers waiting
    flush = ([split_batch(micro_batches[0], 1)[0]]
             if defer and ctx.sync.collectives_in_forward and micro_batches else [])
    request = Request(len(flush) + len(micro_batches), counts.total, can_pad=ctx.ranks.can_pad(bool(micro_batches)),
                      defer=defer, plan=plan, flush=len(flush))
    with Window(ctx, request, micro_batch_size=micro_batch_size) as window:
        ran = window.run(loss_fn, micro_batches, counts, flush=flush, catch_oom=catch_oom)
        if defer:
            ran = not ctx.sync.any_rank(not ran, ctx.device)
        if not ran:
            window.abandon()
            return None
        return window.step()


def run_auto(ctx: Parts, auto: AutoMicroBatch, batch: Batch, loss_fn: LossFn,
             count_fn: Optional[CountFn]) -> StepResult:
    """One window of ``micro_batch_size="auto"``, each attempt a :func:`run_window` dropped on every rank alike."""
    return auto.step(batch, lambda mbs, size: run_window(ctx, mbs, loss_fn, count_items(mbs, count_fn),
                                                         micro_batch_size=size, catch_oom=True))
