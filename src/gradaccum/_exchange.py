"""What a rank adds up over a window, and what the ranks exchange at its boundary, by name.

:class:`Tally` is one rank's running sums while its micro-batches run: ``sum n_k L_k`` (in float64,
so the loss sum does not round with the model's dtype) and the item counts, Python numbers apart from
device tensors (a count left on the device is never read per micro-batch). A micro-batch only files
its detached loss and count; the sum is taken where it is read: on the device (:attr:`Tally.loss_sum`,
for the boundary's all-reduce), or on one process in the one copy to the host
(:meth:`Tally.host_loss_sum`), so a window pays no tensor operation per micro-batch for its tally.

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
        losses, counts: each micro-batch's detached mean loss and its count, in the order they ran.
        host_items: the sum of the counts given as Python numbers.
        device_items: the sum of the counts given as tensors, on the device (None if none was).
        counts_from_loss_fn: ``loss_fn`` returned its own count for some micro-batch (a ``(mean, count)`` pair)
            rather than weighing a bare mean by the count known up front.
    """

    __slots__ = ("losses", "counts", "host_items", "device_items", "counts_from_loss_fn", "dtype", "_sum", "_summed")

    def __init__(self, device: torch.device) -> None:
        self.dtype = count_dtype(device)
        self.losses: List[torch.Tensor] = []
        self.counts: List[Count] = []
        self.host_items = 0.0
        self.device_items: Optional[torch.Tensor] = None
        self.counts_from_loss_fn = False
        self._sum: Optional[torch.Tensor] = None  # the device sum of the first _summed micro-batches
        self._summed = 0

    def add(self, loss: torch.Tensor, count: Count, *, from_loss_fn: bool = False) -> None:
        """File one micro-batch's mean loss and its count (no tensor operation for a Python count, no host
        synchronisation). ``from_loss_fn``: ``loss_fn`` returned the count itself."""
        if from_loss_fn:
            self.counts_from_loss_fn = True
        if type(count) is int:
            self.host_items += count
        elif isinstance(count, torch.Tensor):
            count = count.to(self.dtype)
            self.device_items = count if self.device_items is None else self.device_items + count
        else:
            self.host_items += count
        self.losses.append(loss.detach())
        self.counts.append(count)

    @property
    def loss_sum(self) -> Optional[torch.Tensor]:
        """``sum n_k L_k`` on the device, in float64 (None before the first micro-batch): the micro-batches
        not summed yet are added in the order they ran, each product in the sum's precision."""
        for loss, count in zip(self.losses[self._summed:], self.counts[self._summed:]):
            if isinstance(count, torch.Tensor):
                part = loss * count
                self._sum = part.to(self.dtype) if self._sum is None else self._sum.add_(part)
            elif self._sum is None:  # the first: one op, in the sum's (float64) precision
                self._sum = loss.to(self.dtype) * count
            else:
                self._sum.add_(loss, alpha=count)  # promoted into the float64 sum
        self._summed = len(self.losses)
        return self._sum

    def loss_sum_on(self, device: torch.device) -> torch.Tensor:
        """``sum n_k L_k``, zero for a rank that ran no micro-batch of its own."""
        total = self.loss_sum
        return total if total is not None else torch.zeros((), dtype=self.dtype, device=device)

    def host_losses(self) -> Optional[torch.Tensor]:
        """The micro-batches' losses as one flat tensor, for :meth:`host_loss_sum` to read in the boundary's
        one copy to the host; None when the sum must be taken on the device (a count is a tensor) or no
        micro-batch ran."""
        if self.device_items is not None or not self.losses:
            return None
        return torch.stack(self.losses) if len(self.losses) > 1 else self.losses[0].reshape(1)

    def host_loss_sum(self, losses: List[float]) -> float:
        """``sum n_k L_k`` from the losses :meth:`host_losses` gave, read on the host: the products and
        the sum in float64, in the order the micro-batches ran (every count is a Python number here).

        >>> t = Tally(torch.device("cpu")); t.add(torch.tensor(0.5), 4); t.add(torch.tensor(0.25), 2)
        >>> t.host_loss_sum(t.host_losses().tolist()), t.loss_sum.item()
        (2.5, 2.5)
        """
        total = 0.0
        for loss, count in zip(losses, self.counts):
            total += loss * count  # type: ignore[operator]
        return total


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
    >>> read_on_host(norm=None)
    {}
    """
    named = [(name, t.reshape(-1)) for name, t in parts.items() if t is not None]
    if len(named) == 1:
        return {named[0][0]: named[0][1].tolist()}
    if not named:
        return {}
    first = named[0][1]
    dtype = first.dtype
    for _, t in named[1:]:  # the widest of them (a bf16 loss read with a float32 norm stays float32)
        dtype = torch.promote_types(dtype, t.dtype)
    flat = torch.cat([t.to(device=first.device, dtype=dtype) for _, t in named]).tolist()
    out, at = {}, 0
    for name, t in named:
        out[name], at = flat[at:at + t.numel()], at + t.numel()
    return out
