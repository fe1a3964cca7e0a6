"""What a rank adds up over a window, and what the ranks exchange at its boundary, by name.

:class:`Tally` is one rank's running sums while its micro-batches run: ``sum n_k L_k`` on the device
(float64, so the loss sum does not round with the model's dtype) and the item counts, Python numbers
apart from device tensors (a count left on the device is never read per micro-batch).

:class:`ExchangeRow` is the layout of the boundary's one small all-reduce: each rank packs its row
(:func:`pack_row`), the all-reduce sums the rows, and every rank reads the sums back by name; the
boundary turns them into :class:`Exchanged`, what the window learned from the other ranks. Adding a
number to the exchange is adding a field here. :func:`read_on_host` brings every tensor the boundary
needs to the host in one copy: the window's one host synchronisation.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional

import torch

from ._checks import Count

__all__ = ["Tally", "ExchangeRow", "Exchanged", "pack_row", "read_on_host", "count_dtype"]


def count_dtype(device: torch.device) -> torch.dtype:
    """The dtype counts and loss sums are added in: float64, so that they do not round with the
    model's dtype, except on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


class Tally:
    """One rank's running sums over a window: ``sum n_k L_k`` and the item counts.

    Attributes:
        loss_sum: ``sum n_k L_k`` on the device (None before the first micro-batch).
        host_items: the sum of the counts given as Python numbers.
        device_items: the sum of the counts given as tensors, on the device (None if none was).
        counts_from_loss_fn: ``loss_fn`` returned its own count for some micro-batch (a ``(mean, count)``
            pair) rather than weighing a bare mean by the count known up front.
    """

    __slots__ = ("loss_sum", "host_items", "device_items", "counts_from_loss_fn", "dtype")

    def __init__(self, device: torch.device) -> None:
        self.dtype = count_dtype(device)
        self.loss_sum: Optional[torch.Tensor] = None
        self.host_items = 0.0
        self.device_items: Optional[torch.Tensor] = None
        self.counts_from_loss_fn = False

    def add(self, loss: torch.Tensor, count: Count, *, from_loss_fn: bool = False) -> None:
        """Add one micro-batch: its mean loss times its count (no host synchronisation).
        ``from_loss_fn``: ``loss_fn`` returned the count itself."""
        self.counts_from_loss_fn |= from_loss_fn
        if isinstance(count, torch.Tensor):
            count = count.to(self.dtype)
            part = loss.detach() * count
            self.device_items = count if self.device_items is None else self.device_items + count
            self.loss_sum = part.to(self.dtype) if self.loss_sum is None else self.loss_sum.add_(part)
        else:
            self.host_items += count
            if self.loss_sum is None:  # the first: one op, in the sum's (float64) precision
                self.loss_sum = loss.detach().to(self.dtype) * count
            else:
                self.loss_sum.add_(loss.detach(), alpha=count)  # promoted into the float64 sum

    def loss_sum_on(self, device: torch.device) -> torch.Tensor:
        """``sum n_k L_k``, zero for a rank that ran no micro-batch of its own."""
        return self.loss_sum if self.loss_sum is not None else torch.zeros((), dtype=self.dtype, device=device)


class ExchangeRow(NamedTuple):
    """The boundary's all-reduce, position by position: what each rank adds; after the sum, what
    every rank reads. Flags are 1.0 or 0.0 per rank, so their sums count ranks."""

    loss_sum: float            #: ``sum n_k L_k``
    num_items: float           #: N
    can_pad_next: float        #: ranks that can pad a later window (all of them: the group's size)
    stop: float                #: ranks that asked to stop since the last boundary
    counts_from_loss_fn: float  #: ranks whose loss_fn returned its own counts
    counted_first: float       #: ranks that counted the window's items before its first backward
    square_norm: float = math.nan  #: FSDP2: the shards' squared gradient norms, when measured


class Exchanged(NamedTuple):
    """What a boundary's all-reduce told every rank (on one process: the rank itself)."""

    loss_sum: float
    num_items: float
    raw_norm: Optional[float]  # the reduced gradient's norm before the boundary scale, when measured
    peers_can_pad: bool  # every rank has a micro-batch to pad a later window with
    stop: bool  # some rank asked to stop
    counts_from_loss_fn: bool  # some rank's loss_fn returned its own counts
    counted_first: bool  # every rank counted the window's items before its first backward


def pack_row(tally: Tally, loss_sum: torch.Tensor, *, can_pad_next: bool, stop: bool, counted_first: bool,
             square_norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's :class:`ExchangeRow` as one tensor on the loss sum's device and dtype."""
    items = loss_sum.new_tensor(tally.host_items)
    if tally.device_items is not None:
        items = items + tally.device_items
    flags = loss_sum.new_tensor([float(can_pad_next), float(stop), float(tally.counts_from_loss_fn), float(counted_first)])
    row = torch.cat([torch.stack([loss_sum, items]), flags])
    if square_norm is not None:
        row = torch.cat([row, square_norm.to(row).reshape(1)])
    return row


def read_on_host(**parts: Optional[torch.Tensor]) -> Dict[str, List[float]]:
    """Every tensor given (None ones skipped), as Python numbers by name, in one device-to-host copy.

    >>> read_on_host(row=torch.tensor([1.0, 2.0]), norm=None, extra=torch.tensor(3.0))
    {'row': [1.0, 2.0], 'extra': [3.0]}
    """
    named = [(name, t.reshape(-1)) for name, t in parts.items() if t is not None]
    first = named[0][1]
    flat = torch.cat([t.to(device=first.device, dtype=first.dtype) for _, t in named]).tolist() \
        if len(named) > 1 else first.tolist()
    out, at = {}, 0
    for name, t in named:
        out[name], at = flat[at:at + t.numel()], at + t.numel()
    return out
