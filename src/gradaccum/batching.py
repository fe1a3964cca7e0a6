"""Batches and micro-batches: split along dim 0, join, slice, count items, check leading dimensions.

A *batch* is a Tensor, a tuple/list of batches, or a dict of batches. Its *leaves* are everything else it holds,
and one walker (:func:`leaves` and :func:`rebuild`) serves every operation here. A leaf that is a tensor with at
least one dimension is *split*: every such tensor of one batch shares its leading dimension, which is what gets
split and what counts as items by default. Every other leaf (a 0-d tensor such as an index or a flag, a string, a
number, ``None``) is *carried* to every chunk unchanged. Splitting returns views (slices), so no data is copied.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from ._checks import (LABEL_DTYPES, ROWS, Count, as_number, holds_ignored_labels, item_count, label_tensors,
                      padded_rows_refusal)
from .errors import ConfigurationError, NotExactError, SplitError

#: a Tensor, a tuple/list of batches, or a dict of batches (other values ride along unchanged)
Batch = Any
MicroBatchSize = Union[int, str, None]

__all__ = ["Batch", "CountFn", "Counts", "count_items", "leaves", "rebuild", "first_tensor", "leading_dim",
           "split_batch", "concat_batches", "slice_batch", "check_micro_batch_size", "as_micro_batches"]


def leaves(batch: Batch, path: str = "") -> Iterator[Tuple[str, Any]]:
    """Yield ``(path, leaf)`` for everything ``batch`` holds, depth first, in the order
    :func:`rebuild` puts them back (``path`` is like ``"['x'][0]"``)."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            yield from leaves(value, f"{path}[{i}]")
    else:
        yield path, batch


def rebuild(template: Batch, values: Iterator[Any]) -> Batch:
    """``template``'s structure with its leaves replaced, in :func:`leaves` order, by ``values``
    (namedtuples, tuples, lists and dicts keep their types)."""
    if isinstance(template, Mapping):
        return {k: rebuild(v, values) for k, v in template.items()}
    if isinstance(template, (tuple, list)):
        parts = [rebuild(v, values) for v in template]
        if isinstance(template, tuple):
            make = getattr(type(template), "_make", None)  # namedtuple
            return make(parts) if make else tuple(parts)
        return parts
    return next(values)


def _split(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def first_tensor(batch: Batch) -> Optional[torch.Tensor]:
    """The first tensor in ``batch`` (0-d ones too), depth first, or None."""
    return next((leaf for _, leaf in leaves(batch) if isinstance(leaf, torch.Tensor)), None)


def leading_dim(batch: Batch, *, argument: str = "batch") -> int:
    """The shared leading dimension of every tensor in ``batch`` that has one (0-d tensors are
    carried, not counted).

    Raises:
        ValueError: when the batch holds no tensor with a leading dimension, or tensors whose leading
            dimensions disagree (the message names both paths and sizes).
    """
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return batch.shape[0]
    if type(batch) in (tuple, list) and batch and all(type(t) is torch.Tensor and t.dim() for t in batch):
        rows = {t.shape[0] for t in batch}  # the common (inputs, targets) case, without the general walk
        if len(rows) == 1:
            return rows.pop()
    found = list(leaves(batch))
    split = [(path, leaf.shape[0]) for path, leaf in found if _split(leaf)]
    for path, n in split[1:]:
        if n != split[0][1]:
            raise SplitError(
                f"tensors in {argument} disagree on their leading dimension: "
                f"{argument}{split[0][0]} has {split[0][1]} items but {argument}{path} has "
                f"{n}. Every tensor of one batch must hold the same items along dim 0.")
    if not split:
        scalars = [path for path, leaf in found if isinstance(leaf, torch.Tensor)]  # 0-d: carried, not split
        held = (f"only 0-d tensors ({', '.join(argument + p for p in scalars[:3])}), which are carried to every "
                "micro-batch, not split" if scalars else f"no tensor (got {type(batch).__name__})")
        raise SplitError(
            f"{argument} holds {held}; a batch needs at least one tensor with a leading (item) dimension "
            "to split and count: a Tensor, a tuple/list of Tensors, or a dict of Tensors of shape (n, ...).")
    return split[0][1]


def check_micro_batch_size(micro_batch_size: MicroBatchSize) -> None:
    """Raise a ``ValueError`` naming the value unless it is None, a positive int or "auto"."""
    if micro_batch_size is None or micro_batch_size == "auto":
        return
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ConfigurationError(f"micro_batch_size must be a positive int, 'auto' or None, got {micro_batch_size!r}")
    if micro_batch_size <= 0:
        raise ConfigurationError(
            f"micro_batch_size must be >= 1, got {micro_batch_size}; pass the number of items "
            "per forward/backward pass, or 'auto' to find it on out-of-memory errors")


def split_batch(batch: Batch, micro_batch_size: int) -> List[Batch]:
    """Split ``batch`` along dim 0 into chunks of ``micro_batch_size`` items (the last may be smaller).

    >>> [c.shape[0] for c in split_batch(torch.zeros(10, 3), 4)]
    [4, 4, 2]
    """
    check_micro_batch_size(micro_batch_size)
    return _split_rows(batch, micro_batch_size)[0]


def _split_rows(batch: Batch, micro_batch_size: int) -> Tuple[List[Batch], List[int]]:
    """:func:`split_batch` at a checked size, with each chunk's rows (no chunk is measured again)."""
    n = leading_dim(batch)
    if n == 0:
        raise SplitError("batch has 0 items along dim 0; there is nothing to step on")
    starts = range(0, n, micro_batch_size)
    rows = [min(micro_batch_size, n - start) for start in starts]
    if type(batch) in (tuple, list) and all(type(t) is torch.Tensor and t.dim() for t in batch):  # (inputs, targets)
        return [type(batch)(chunk) for chunk in zip(*(torch.split(t, micro_batch_size) for t in batch))], rows
    return [slice_batch(batch, start, start + micro_batch_size) for start in starts], rows


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """The inverse of :func:`split_batch`: micro-batches joined along dim 0. A carried leaf (a 0-d tensor, a
    string, a number) must be the same in every micro-batch, since the joined batch holds it once.

    >>> concat_batches([torch.zeros(2, 3), torch.zeros(1, 3)]).shape[0]
    3
    """
    joined = []
    for column in zip(*(list(leaves(b)) for b in batches)):
        path, first = column[0]
        if _split(first):
            joined.append(torch.cat([leaf for _, leaf in column]) if len(column) > 1 else first)
            continue
        for i, (_, leaf) in enumerate(column[1:], start=1):
            if not _same_leaf(leaf, first):
                raise SplitError(
                    f"micro-batches 0 and {i} carry different values at {path or 'the top'} ({first!r} and "
                    f"{leaf!r}), a value without a leading dimension that one joined batch can hold only once "
                    "(micro_batch_size='auto' joins a window's micro-batches): give it a leading dimension "
                    "(shape (n, ...)), or pass an int micro_batch_size")
        joined.append(first)
    return rebuild(batches[0], iter(joined))


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return a is b or bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # an array-like that compares element-wise
        return False


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Items ``start:stop`` of every tensor in ``batch`` that has a leading dimension (views; carried
    leaves unchanged)."""
    return rebuild(batch, (leaf[start:stop] if _split(leaf) else leaf for _, leaf in leaves(batch)))


def as_micro_batches(window: Union[Batch, Sequence[Batch]], micro_batch_size: Optional[int], *,
                     allow_empty: bool = False) -> Tuple[List[Batch], Optional[List[int]]]:
    """Turn ``step()``'s ``window`` argument (and its ``micro_batch_size``, which ``step()`` has checked) into a
    checked list of micro-batches, and their rows where the split made them (else None: :func:`count_items`
    measures and checks each micro-batch).

    With ``micro_batch_size=None`` the window is a list of micro-batches; with an int it is one batch to split.
    A tuple or list holding bare tensors is refused without ``micro_batch_size`` (``(inputs, targets)`` would
    otherwise be read as two micro-batches), and so is a list of micro-batches with it.
    """
    if micro_batch_size is not None:
        if isinstance(window, list) and window and all(isinstance(mb, (tuple, list, Mapping)) for mb in window):
            raise SplitError(
                f"window is a list of {len(window)} micro-batches and micro_batch_size={micro_batch_size!r} was "
                "given, which is ambiguous: a list of micro-batches is already split, and micro_batch_size splits "
                "one batch. Drop micro_batch_size to run the list as it is, or pass one batch (a tensor, a tuple "
                "(inputs, targets) or a dict) to split; a nested batch goes in a tuple, not a list")
        if allow_empty and leading_dim(window) == 0:
            return [], []  # a rank whose share is empty: it takes part with zero items
        return _split_rows(window, micro_batch_size)
    if isinstance(window, (torch.Tensor, Mapping)) or not isinstance(window, Sequence) or isinstance(window, str):
        raise SplitError(
            f"window must be a list of micro-batches when micro_batch_size is None, got a "
            f"{type(window).__name__}; pass a list of micro-batches, or one batch together "
            "with micro_batch_size=M to split it")
    if any(isinstance(mb, torch.Tensor) for mb in window):
        shapes = ", ".join(str(tuple(mb.shape)) if isinstance(mb, torch.Tensor) else type(mb).__name__
                           for mb in list(window)[:4])
        raise SplitError(
            f"window is a {type(window).__name__} holding tensors ({shapes}{', ...' if len(window) > 4 else ''}), "
            "which is ambiguous: one batch such as (inputs, targets), or a window of micro-batches? "
            "For one batch pass micro_batch_size=M (step(batch, loss_fn, micro_batch_size=8)); for a "
            "window pass a list of micro-batches ([(x1, y1), (x2, y2)]; a micro-batch that is a single "
            "tensor goes in a tuple: [(x1,), (x2,)])")
    micro_batches = list(window)
    if not micro_batches and not allow_empty:
        raise SplitError("window is empty (0 micro-batches); pass at least one micro-batch")
    return micro_batches, None  # leading dimensions are checked when the Accumulator counts the items


# -- what each micro-batch's mean loss is over, counted before any forward ------------------------------

#: ``num_items(micro_batch)`` -> how many items its mean loss is over, counted before any forward; or
#: ``"rows"``: a bare mean loss is over the micro-batch's rows (dim 0), declared so
CountFn = Union[Callable[[Batch], Count], str]


@dataclass
class Counts:
    """Each micro-batch's item count before any forward, and their sum (a tensor count is read once,
    here: one host synchronisation per tensor). ``unchecked``: micro-batches counted by their rows
    without ``num_items``, until a bare mean loss meets them (:meth:`weigh_bare_mean`)."""

    each: List[Count]
    total: float
    unchecked: Optional[List[Batch]] = None

    def weigh_bare_mean(self) -> None:
        """A bare mean loss weighed by undeclared rows is refused where labels hold -100, or where a mapping's labels
        differ in length between micro-batches (a mean over targets)."""
        batches, self.unchecked = self.unchecked, None
        if not batches:
            return
        fix = ("Pass num_items=lambda mb: gradaccum.count_targets(mb['labels']) (the targets of a causal LM; "
               "shift=False for other heads; mb[2], or wherever a tuple holds the labels), or return (mean, count) "
               "from loss_fn, e.g. gradaccum.causal_lm_loss(outputs.logits, mb['labels']); if the mean really is over "
               "the rows, say so: num_items='rows'")
        if holds_ignored_labels(batches):
            raise padded_rows_refusal("Accumulator: loss_fn", fix)
        lengths = {tuple(t.shape[1:]) for mb in batches if isinstance(mb, Mapping) for t in label_tensors(mb)
                   if t.dim() >= 2}
        if len(lengths) > 1:
            raise NotExactError(
                "Accumulator: loss_fn returned a bare mean loss on micro-batches whose 'labels' differ in length "
                f"({', '.join(str(list(n)) for n in sorted(lengths))} after the rows), and no num_items says what "
                "that mean is over, so each micro-batch would be weighed by its rows, not by its targets (a Hugging "
                f"Face model's outputs.loss is a mean over the targets). {fix}")


def _labelled(micro_batches: List[Batch]) -> bool:
    """Whether a micro-batch may hold labels (:func:`~gradaccum._checks.label_tensors`), in plain loops: a tuple of
    float tensors, on every window's path, costs no call."""
    for mb in micro_batches:
        if isinstance(mb, Mapping):
            if "labels" in mb:
                return True
        elif isinstance(mb, (tuple, list)):
            for t in mb:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.dtype in LABEL_DTYPES:
                    return True
    return False


def count_items(micro_batches: List[Batch], count_fn: Optional[CountFn],
                rows: Optional[List[int]] = None) -> Counts:
    """What a bare mean loss is weighted by: the leading dimension (``count_fn`` None or ``"rows"``),
    or the ``num_items`` counter. Every micro-batch's leading dimensions are checked here, before
    anything runs, unless a split made them (``rows``)."""
    each: List[Count] = list(rows) if rows is not None else [
        leading_dim(mb, argument=f"window[{i}]") for i, mb in enumerate(micro_batches)]
    if count_fn is None or count_fn == ROWS:
        return Counts(each, float(sum(each)), micro_batches if count_fn is None and _labelled(micro_batches) else None)
    each = [item_count("num_items(micro_batch)", count_fn(mb)) for mb in micro_batches]  # type: ignore[operator]
    return Counts(each, float(sum(as_number(c) for c in each)))
