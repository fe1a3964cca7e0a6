"""The distributed seam: the one module that imports ``torch.distributed``.

A :class:`GradSync` decides, per micro-batch, whether the backward pass reduces gradients across
ranks, and does the window's one small all-reduce of the item count and loss sum. The local default
does nothing. Data-parallel wrappers *average* the gradient over ``world_size`` ranks while reducing;
``grad_divisor`` says by how much, so that the boundary can turn the result into the exact
item-weighted mean over every rank's window::

    reduced grad   = (1 / W) * sum_ranks sum_micro (n_k / R) * grad(mean_loss_k)
    window grad    = reduced grad * (R * W / N_global)  =  sum_k n_k * grad(mean_loss_k) / N_global

Every switch a context flips is restored on the way out, also when an exception leaves it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["GradSync", "LocalSync", "DDPSync", "FSDP2Sync", "sync_for", "is_distributed",
           "rank", "world_size", "is_rank_zero", "barrier", "broadcast_object", "all_reduce_"]


def _fsdp2_module_type() -> Any:
    """FSDP2's ``FSDPModule``, or None when FSDP was never imported: a model can only have been
    sharded after that import, and importing it here would cost every user about a second."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):  # torch >= 2.6, 2.4/2.5
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "FSDPModule"):
            return module.FSDPModule
    return None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_rank_zero() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (identity when not distributed)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In-place all-reduce (``"sum"``, ``"max"`` or ``"min"``); identity when not distributed."""
    if is_distributed():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                    "min": dist.ReduceOp.MIN}[op], group=group)
    return tensor


class GradSync:
    """Local training: every backward keeps its gradient; nothing to reduce."""

    #: the backward reduction divides the gradient sum by this many ranks
    grad_divisor: float = 1.0
    #: ``True`` when the window's counts must be summed across ranks
    distributed: bool = False
    #: whether reduce_gradients_ works (after backward passes that all skipped their reduction)
    can_reduce_later: bool = True
    group: Any = None

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def world_size(self) -> int:
        return 1

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        """Wraps one micro-batch's forward *and* backward; reduces gradients only when ``last``."""
        yield

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.distributed:
            all_reduce_(tensor, op, self.group)
        return tensor

    def reduce_gradients_(self, grads: List[torch.Tensor]) -> None:
        """Average already-accumulated local gradients across ranks now (used when every backward
        of the window skipped its reduction, e.g. while the micro-batch size is being found)."""


LocalSync = GradSync


class DDPSync(GradSync):
    """``DistributedDataParallel``: ``no_sync()`` around every micro-batch but the last.

    DDP reads ``require_backward_grad_sync`` in *forward*, so the context covers forward and backward.
    """

    distributed = True

    def __init__(self, model: DistributedDataParallel, *, reduce_every_micro_batch: bool = False) -> None:
        super().__init__(model)
        if getattr(model, "static_graph", False) and not reduce_every_micro_batch:
            raise ValueError(
                "DistributedDataParallel(static_graph=True) cannot skip the gradient reduction "
                "between micro-batches: its graph is recorded from the first iteration, and "
                "no_sync() iterations break it. Construct DDP with static_graph=False (the default), "
                "or pass reduce_every_micro_batch=True to reduce after every micro-batch."
            )
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.group = getattr(model, "process_group", None)
        self.grad_divisor = float(self.world_size)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        if last or self.reduce_every_micro_batch:
            yield
        else:
            with self.model.no_sync():  # restores require_backward_grad_sync on any exit
                yield

    def reduce_gradients_(self, grads: List[torch.Tensor]) -> None:
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class FSDP2Sync(GradSync):
    """FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` until the last micro-batch.

    Skipping keeps each rank's *unsharded* gradient between micro-batches: about
    ``P * bytes * (1 - 1/W)`` more memory than the sharded gradient, for one reduce-scatter per window
    instead of N. ``reduce_every_micro_batch=True`` trades the other way: sharded gradients only, N
    reduce-scatters per window.
    """

    distributed = True
    can_reduce_later = False

    def __init__(self, model: nn.Module, *, reduce_every_micro_batch: bool = False) -> None:
        super().__init__(model)
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.grad_divisor = float(self.world_size)

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def _set_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled, recurse=True)  # type: ignore[operator]

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        if last or self.reduce_every_micro_batch:
            yield
            return
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def reduce_gradients_(self, grads: List[torch.Tensor]) -> None:
        raise NotImplementedError("FSDP2 reduces gradients only inside its backward pass")


def sync_for(model: nn.Module, *, reduce_every_micro_batch: bool = False) -> GradSync:
    """The seam that fits ``model``: DDP, FSDP2, or local."""
    if isinstance(model, DistributedDataParallel):
        return DDPSync(model, reduce_every_micro_batch=reduce_every_micro_batch)
    fsdp_module = _fsdp2_module_type()
    if fsdp_module is not None and isinstance(model, fsdp_module):
        return FSDP2Sync(model, reduce_every_micro_batch=reduce_every_micro_batch)
    return GradSync(model)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (FSDP2 norms); any other tensor unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]
