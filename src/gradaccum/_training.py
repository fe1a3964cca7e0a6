"""``Accumulator.train``: a loader's micro-batches cut into windows, by its :class:`~gradaccum.WindowSampler` or
``accum_steps`` at a time (the ranks agreeing at each window), each run by :func:`gradaccum._run.run_window`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import count, islice
from typing import Any, Iterable, Iterator, List, Optional

from ._autosize import AutoMicroBatch
from ._checks import ROWS, non_negative_int
from ._maths import ceil_div
from ._ranks import Plan
from ._run import LossFn, run_auto, run_window
from ._window import Parts
from .batching import Batch, CountFn, Counts, concat_batches, count_items, slice_batch
from .result import StepResult
from .sampler import WindowSampler
from .schedule import AccumSchedule, AccumSteps
from .errors import ConfigurationError

__all__ = ["TrainSpec", "train_windows"]


@dataclass(frozen=True)
class TrainSpec:
    """``train()``'s arguments, checked."""

    loss_fn: LossFn
    accum_steps: Optional[AccumSteps]
    epochs: int
    drop_last: bool
    num_items: Optional[CountFn]
    auto: Optional[AutoMicroBatch]  # set for micro_batch_size="auto"


def window_sampler(loader: Any) -> Optional[WindowSampler]:
    """The loader's WindowSampler, or None; one wrapped in another batch sampler (which shards it again) is refused."""
    batch_sampler = inner = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, WindowSampler):
        return batch_sampler
    for _ in range(4):  # a few wrappers deep
        inner = getattr(inner, "batch_sampler", None) or getattr(inner, "sampler", None)
        if isinstance(inner, WindowSampler):
            raise ConfigurationError(
                f"the loader's WindowSampler is wrapped in a {type(batch_sampler).__name__}, which shards "
                "it again (accelerator.prepare does this), so each rank would see only part of its share: "
                "the WindowSampler already gives every rank its share, so do not pass this DataLoader to "
                "accelerator.prepare; move each micro-batch to the device in loss_fn instead")
    return None


def train_windows(ctx: Parts, loader: Iterable[Batch], spec: TrainSpec) -> Iterator[StepResult]:
    """Checks everything now (a generator would check nothing before its first ``next()``), then loops."""
    non_negative_int("epochs", spec.epochs, hint=" (0 for a finished run: nothing to train)")
    sampler = window_sampler(loader)
    if sampler is not None:
        if spec.accum_steps is not None:
            raise ConfigurationError(
                f"accum_steps={spec.accum_steps!r} was given, but the loader's WindowSampler already cuts the "
                "epoch into windows of global_batch_size items: drop accum_steps")
        if spec.drop_last:
            raise ConfigurationError("drop_last=True was given, but the loader's WindowSampler decides about the "
                             "short last window: construct it with WindowSampler(..., drop_last=True)")
        return _sampler_windows(ctx, loader, sampler, spec)
    if spec.accum_steps is None:
        raise ConfigurationError("accum_steps is required (micro-batches per window, e.g. accum_steps=4) unless the "
                         "loader's batch_sampler is a gradaccum.WindowSampler, which cuts the windows")
    return _grouped_windows(ctx, loader, AccumSchedule(spec.accum_steps), spec)


def _step(ctx: Parts, pending: List[Batch], spec: TrainSpec, *, counts: Optional[Counts] = None,
          plan: Optional[Plan] = None) -> StepResult:
    """One window: through the out-of-memory back-off under "auto", else with the caller's ``counts`` and ``plan``."""
    if spec.auto is not None:
        if pending:
            batch = concat_batches(pending)
        elif ctx.state.padding_batch is not None:  # an empty share: zero items, shaped like a micro-batch it ran
            batch = slice_batch(ctx.state.padding_batch, 0, 0)
        else:
            raise ConfigurationError("this rank's share of the window is empty and it has run no micro-batch yet: "
                             "give it one to pad with, acc.set_padding(micro_batch)")
        return run_auto(ctx, spec.auto, batch, spec.loss_fn, spec.num_items)
    counts = counts or count_items(pending, spec.num_items)
    return run_window(ctx, pending, spec.loss_fn, counts, plan=plan)  # type: ignore[return-value]  # None: catch_oom


def _grouped_windows(ctx: Parts, loader: Iterable[Batch], schedule: AccumSchedule,
                     spec: TrainSpec) -> Iterator[StepResult]:
    start = ctx.state.epoch
    for epoch in range(start, start + spec.epochs):
        # told the epoch: Accelerate's prepared loader itself (its own count would start again at 0 on a resume)
        for holder in (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
            if callable(getattr(holder, "set_epoch", None)):
                holder.set_epoch(epoch)  # type: ignore[union-attr]
                break
        n = schedule(epoch)
        known = ctx.ranks.equal_shares(loader)
        batches = iter(loader)
        for window in count():
            pending: List[Batch] = list(islice(batches, n))
            counts = count_items(pending, spec.num_items)  # checks every micro-batch, before any forward
            if known:  # every rank holds as many micro-batches as this one: nothing to ask (the items,
                k = len(pending)  # which a collate_fn may change, are summed at the boundary)
                plan = Plan(k, k, k, None)
            else:
                plan = ctx.ranks.agree(len(pending), counts.total, ctx.ranks.can_pad(bool(pending)))
            if plan.most == 0 or (spec.drop_last and plan.fewest < n):
                break  # no rank has any micro-batch left, or the short last window (on some rank) is dropped
            yield replace(_step(ctx, pending, spec, counts=counts, plan=plan), epoch=epoch, window=window)
        ctx.state.epoch = epoch + 1


def _sampler_windows(ctx: Parts, loader: Iterable[Batch], sampler: WindowSampler,
                     spec: TrainSpec) -> Iterator[StepResult]:
    start = sampler.epoch + (1 if sampler.start_window >= sampler.num_windows else 0)
    for epoch in range(start, start + spec.epochs):
        sampler.set_epoch(epoch)
        first = sampler.start_window
        sizes = sampler.window_sizes()  # this rank's micro-batches in each remaining window
        batches = iter(loader)
        for offset, size in enumerate(sizes):
            pending = list(islice(batches, size))
            if len(pending) != size:
                raise ConfigurationError(
                    f"the loader yielded {len(pending)} micro-batches for window {first + offset} of epoch {epoch}, "
                    f"its WindowSampler planned {size}: pass the sampler as the loader's batch_sampler "
                    "(DataLoader(dataset, batch_sampler=sampler)), with no other sampler or batch_size")
            plan = None
            if spec.auto is None:  # every rank's share is known: no agreement to ask for
                shares = sampler.shares(first + offset)
                rows = spec.num_items in (None, ROWS)  # then the sampler's shares are the items counted
                plan = ctx.ranks.known_plan(size, [ceil_div(s, sampler.micro_batch_size) for s in shares],
                                            float(sum(shares)) if rows else None)
            result = _step(ctx, pending, spec, plan=plan)
            sampler.advance()  # the position a checkpoint saves: this window is done
            if offset == len(sizes) - 1:
                ctx.state.epoch = epoch + 1  # finished, also in a checkpoint taken at this step
            yield replace(result, epoch=epoch, window=first + offset)
