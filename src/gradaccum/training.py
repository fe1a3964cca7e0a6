"""``Accumulator.train``: a loader's micro-batches -> windows -> one step each, epoch after epoch.

Windows come from the loader's :class:`~gradaccum.WindowSampler` (it knows where every global window
ends and which micro-batches are this rank's) or from ``accum_steps`` consecutive micro-batches.
``epochs=E`` trains E epochs from where training stands: the sampler's position (a finished epoch
moves on to the next; a resumed one is finished first), else the Accumulator's epoch counter, so
calling ``train`` once per epoch trains one new epoch each time (and tells the sampler which).
``acc.epoch`` counts the finished epochs (saved in ``acc.state_dict()``): a run of E epochs resumed
from a checkpoint goes on with ``epochs=E - acc.epoch``.

Under data parallelism the ranks agree at every window (one small all-gather): while any rank has
micro-batches left, every rank opens the window, a rank whose data ran out repeating its last
micro-batch with zero weight (DDP and FSDP2 run collectives in every forward) and so contributing no
items. Every rank takes the same steps and each step is exact on the items that exist; when no rank
has any left, the epoch ends on all of them together. Uneven shards (streaming data, packing,
filtering) therefore neither hang nor drift.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import islice
from typing import TYPE_CHECKING, Any, Iterable, Iterator, List, Optional

from .batching import Batch
from .result import StepResult
from .schedule import AccumSchedule, AccumSteps, check_positive_int

if TYPE_CHECKING:
    from .accumulator import Accumulator, CountFn, LossFn

__all__ = ["train_windows"]


def _window_sampler(loader: Any) -> Any:
    """The loader's WindowSampler, or None. One wrapped in another batch sampler is refused: the
    wrapper (Accelerate's BatchSamplerShard from ``accelerator.prepare``) would shard each rank's
    share again, and part of the data would never be seen."""
    from .sampler import WindowSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, WindowSampler):
        return batch_sampler
    inner, depth = batch_sampler, 0
    while inner is not None and depth < 4:
        inner, depth = getattr(inner, "batch_sampler", None) or getattr(inner, "sampler", None), depth + 1
        if isinstance(inner, WindowSampler):
            raise ValueError(
                f"the loader's WindowSampler is wrapped in a {type(batch_sampler).__name__}, which shards "
                "it again (accelerator.prepare does this), so each rank would see only part of its share: "
                "the WindowSampler already gives every rank its share, so do not pass this DataLoader to "
                "accelerator.prepare; move each micro-batch to the device in loss_fn instead"
            )
    return None


def train_windows(acc: "Accumulator", loader: Iterable[Batch], loss_fn: "LossFn", *,
                  accum_steps: Optional[AccumSteps], epochs: int, drop_last: bool,
                  num_items: Optional["CountFn"]) -> Iterator[StepResult]:
    """Validate everything up front (nothing runs before the first ``next()`` otherwise), then loop."""
    check_positive_int("epochs", epochs)
    sampler = _window_sampler(loader)
    if sampler is not None:
        if accum_steps is not None:
            raise ValueError(
                f"accum_steps={accum_steps!r} was given, but the loader's WindowSampler already cuts the "
                "epoch into windows of global_batch_size items: drop accum_steps"
            )
        if drop_last:
            raise ValueError("drop_last=True was given, but the loader's WindowSampler decides about the "
                             "short last window: construct it with WindowSampler(..., drop_last=True)")
        return _sampler_windows(acc, loader, sampler, loss_fn, epochs, num_items)
    if accum_steps is None:
        raise ValueError("accum_steps is required (micro-batches per window, e.g. accum_steps=4) unless the "
                         "loader's batch_sampler is a gradaccum.WindowSampler, which cuts the windows")
    return _grouped_windows(acc, loader, loss_fn, AccumSchedule(accum_steps), epochs, drop_last, num_items)


def _set_epoch(loader: Any, epoch: int) -> None:
    holders: List[Any] = [getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)]
    for holder in holders:
        if callable(getattr(holder, "set_epoch", None)):
            holder.set_epoch(epoch)
            return


def _grouped_windows(acc: "Accumulator", loader: Iterable[Batch], loss_fn: "LossFn", schedule: AccumSchedule,
                     epochs: int, drop_last: bool, num_items: Optional["CountFn"]) -> Iterator[StepResult]:
    start = acc.epoch
    for epoch in range(start, start + epochs):
        _set_epoch(loader, epoch)
        n = schedule(epoch)
        batches = iter(loader)
        window = 0
        while True:
            pending: List[Batch] = list(islice(batches, n))
            counts, total = acc._count(pending, num_items)  # checks every micro-batch, before any forward
            plan = acc._agree(len(pending), total, bool(pending) or acc._replay is not None)
            if plan.most == 0:
                break  # no rank has any micro-batch left
            if drop_last and plan.fewest < n:
                break  # the short last window (on some rank) is dropped on every rank
            result = acc._attempt(pending, loss_fn, num_items, micro_batch_size=None, plan=plan, counts=counts)
            assert result is not None
            yield replace(result, accum_steps=n, epoch=epoch, window=window)
            window += 1
        acc.epoch = epoch + 1


def _sampler_windows(acc: "Accumulator", loader: Iterable[Batch], sampler: Any, loss_fn: "LossFn",
                     epochs: int, num_items: Optional["CountFn"]) -> Iterator[StepResult]:
    start = sampler.epoch + (1 if sampler.start_window >= sampler.num_windows else 0)
    for epoch in range(start, start + epochs):
        sampler.set_epoch(epoch)
        first = sampler.start_window
        sizes = sampler.window_sizes()  # this rank's micro-batches in each remaining window
        batches = iter(loader)
        for offset, size in enumerate(sizes):
            pending = list(islice(batches, size))
            if len(pending) != size:
                raise RuntimeError(f"the loader yielded {len(pending)} micro-batches for window "
                                   f"{first + offset} of epoch {epoch}, its WindowSampler planned {size}")
            result = acc._attempt(pending, loss_fn, num_items, micro_batch_size=None)
            assert result is not None
            sampler.advance()  # the position a checkpoint saves: this window is done
            if offset == len(sizes) - 1:
                acc.epoch = epoch + 1  # finished, also in a checkpoint taken at this step
            yield replace(result, accum_steps=size, epoch=epoch, window=first + offset)
        acc.epoch = epoch + 1
