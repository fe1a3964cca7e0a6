"""Batches and micro-batches: split along dim 0, count items, check leading dimensions.

A *batch* is a Tensor, a tuple/list of batches, or a dict of batches; anything else (a string,
a number, ``None``) is carried to every chunk unchanged. Every tensor in a batch must share its
leading dimension: that dimension is what gets split and what counts as items by default.
Splitting returns views (``torch.split``), so no data is copied.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, List, Optional, Union

import torch

#: a Tensor, a tuple/list of batches, or a dict of batches (other values ride along unchanged)
Batch = Any
MicroBatchSize = Union[int, str, None]

__all__ = ["Batch", "leading_dim", "split_batch", "concat_batches", "slice_batch", "check_micro_batch_size",
           "as_micro_batches"]


def _tensors(batch: Batch) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in ``batch``, depth first."""
    if isinstance(batch, torch.Tensor):
        yield "", batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            for path, t in _tensors(value):
                yield f"[{key!r}]{path}", t
    elif isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            for path, t in _tensors(value):
                yield f"[{i}]{path}", t


def leading_dim(batch: Batch, *, argument: str = "batch") -> int:
    """The shared leading dimension of every tensor in ``batch``.

    Raises:
        ValueError: when the batch holds no tensor, a 0-d tensor, or tensors whose leading
            dimensions disagree (the message names both paths and sizes).
    """
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return batch.shape[0]
    if type(batch) in (tuple, list) and batch and all(type(t) is torch.Tensor and t.dim() > 0 for t in batch):
        n = batch[0].shape[0]  # the common (inputs, targets) case, without the general walk
        if all(t.shape[0] == n for t in batch):
            return n
    first: Optional[tuple[str, int]] = None
    for path, t in _tensors(batch):
        if t.dim() == 0:
            raise ValueError(
                f"{argument}{path} is a 0-d tensor; every tensor in a batch needs a leading "
                "(item) dimension to split and count. Give it shape (n, ...)."
            )
        if first is None:
            first = (path, t.shape[0])
        elif t.shape[0] != first[1]:
            raise ValueError(
                f"tensors in {argument} disagree on their leading dimension: "
                f"{argument}{first[0] or ''} has {first[1]} items but {argument}{path} has "
                f"{t.shape[0]}. Every tensor of one batch must hold the same items along dim 0."
            )
    if first is None:
        raise ValueError(
            f"{argument} holds no tensor (got {type(batch).__name__}); a batch is a Tensor, "
            "a tuple/list of Tensors, or a dict of Tensors."
        )
    return first[1]


def _split(batch: Batch, size: int, chunks: int) -> List[Batch]:
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, size, dim=0))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, size, chunks) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(chunks)]
    if isinstance(batch, (tuple, list)):
        columns = [_split(v, size, chunks) for v in batch]
        rows = [[col[i] for col in columns] for i in range(chunks)]
        if isinstance(batch, tuple):
            make = getattr(type(batch), "_make", None)  # namedtuple
            return [make(r) if make else tuple(r) for r in rows]
        return rows
    return [batch] * chunks  # non-tensor values reach every chunk unchanged


def check_micro_batch_size(micro_batch_size: MicroBatchSize) -> None:
    """Raise a ``ValueError`` naming the value unless it is None, a positive int or "auto"."""
    if micro_batch_size is None or micro_batch_size == "auto":
        return
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ValueError(
            f"micro_batch_size must be a positive int, 'auto' or None, got {micro_batch_size!r}"
        )
    if micro_batch_size <= 0:
        raise ValueError(
            f"micro_batch_size must be >= 1, got {micro_batch_size}; pass the number of items "
            "per forward/backward pass, or 'auto' to find it on out-of-memory errors"
        )


def split_batch(batch: Batch, micro_batch_size: int) -> List[Batch]:
    """Split ``batch`` along dim 0 into chunks of ``micro_batch_size`` items (the last may be smaller).

    >>> [c.shape[0] for c in split_batch(torch.zeros(10, 3), 4)]
    [4, 4, 2]
    """
    check_micro_batch_size(micro_batch_size)
    n = leading_dim(batch)
    if n == 0:
        raise ValueError("batch has 0 items along dim 0; there is nothing to step on")
    chunks = math.ceil(n / micro_batch_size)
    return _split(batch, micro_batch_size, chunks)


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """The inverse of :func:`split_batch`: micro-batches joined along dim 0 (non-tensor values are
    taken from the first).

    >>> concat_batches([torch.zeros(2, 3), torch.zeros(1, 3)]).shape[0]
    3
    """
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches)) if len(batches) > 1 else first
    if isinstance(first, Mapping):
        return {k: concat_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        columns = [concat_batches([b[i] for b in batches]) for i in range(len(first))]
        if isinstance(first, tuple):
            make = getattr(type(first), "_make", None)  # namedtuple
            return make(columns) if make else tuple(columns)
        return columns
    return first


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Items ``start:stop`` of every tensor in ``batch`` (views; non-tensor values unchanged)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        parts = [slice_batch(v, start, stop) for v in batch]
        if isinstance(batch, tuple):
            make = getattr(type(batch), "_make", None)
            return make(parts) if make else tuple(parts)
        return parts
    return batch


def as_micro_batches(window: Union[Batch, Sequence[Batch]], micro_batch_size: Optional[int], *,
                     allow_empty: bool = False) -> List[Batch]:
    """Turn ``step()``'s ``window`` argument into a checked list of micro-batches.

    With ``micro_batch_size=None`` the window is a list of micro-batches; with an int it is one
    batch to split. A tuple or list holding bare tensors is refused without ``micro_batch_size``:
    ``(inputs, targets)`` would otherwise be read as two micro-batches, ``inputs`` and then
    ``targets``.
    """
    if micro_batch_size is not None:
        if allow_empty and leading_dim(window) == 0:
            return []  # a rank whose share is empty: it takes part with zero items
        return split_batch(window, micro_batch_size)
    if isinstance(window, (torch.Tensor, Mapping)) or not isinstance(window, Sequence) or isinstance(window, str):
        raise ValueError(
            f"window must be a list of micro-batches when micro_batch_size is None, got a "
            f"{type(window).__name__}; pass a list of micro-batches, or one batch together "
            "with micro_batch_size=M to split it"
        )
    if any(isinstance(mb, torch.Tensor) for mb in window):
        shapes = ", ".join(str(tuple(mb.shape)) if isinstance(mb, torch.Tensor) else type(mb).__name__
                           for mb in list(window)[:4])
        raise ValueError(
            f"window is a {type(window).__name__} holding tensors ({shapes}{', ...' if len(window) > 4 else ''}), "
            "which is ambiguous: one batch such as (inputs, targets), or a window of micro-batches? "
            "For one batch pass micro_batch_size=M (step(batch, loss_fn, micro_batch_size=8)); for a "
            "window pass a list of micro-batches ([(x1, y1), (x2, y2)]; a micro-batch that is a single "
            "tensor goes in a tuple: [(x1,), (x2,)])"
        )
    micro_batches = list(window)
    if not micro_batches and not allow_empty:
        raise ValueError("window is empty (0 micro-batches); pass at least one micro-batch")
    return micro_batches  # leading dimensions are checked when the Accumulator counts the items
