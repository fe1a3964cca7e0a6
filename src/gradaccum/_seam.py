"""The distributed seam's interface, :class:`GradSync` (the local answers as its defaults, the collectives
every backend shares), and the rank helpers the command line uses; it imports no backend, so no cycle."""

from __future__ import annotations

import contextlib
import os
import sys
import zlib
from typing import Any, ContextManager, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .errors import RankAgreementError

__all__ = ["GradSync", "LOW_PRECISION", "loaded_type", "is_distributed", "rank", "world_size", "is_rank_zero",
           "barrier", "broadcast_object", "all_reduce_", "is_process_group", "shared_ranks"]

#: floating dtypes whose running sum rounds to 8 (bf16) or 11 (fp16) bits of mantissa
LOW_PRECISION = (torch.bfloat16, torch.float16)


def loaded_type(modules: Sequence[str], name: str) -> Any:
    """``name`` from the first of ``modules`` already imported, else None (a model can only have been
    wrapped by a class whose module was imported; importing FSDP would cost every user a second)."""
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, name):
            return getattr(module, name)
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


def is_process_group(group: Any) -> bool:
    return isinstance(group, dist.ProcessGroup)


def shared_ranks(a: Any, b: Any) -> List[int]:
    """The global ranks two process groups (None: the world) both hold."""
    ranks = [set(dist.get_process_group_ranks(dist.group.WORLD if g is None else g)) for g in (a, b)]
    return sorted(ranks[0] & ranks[1])


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
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=group)
    return tensor


class GradSync:
    """Local training: every backward keeps its gradient; nothing to reduce."""

    #: W: the backward reduction divides the gradient sum by this many ranks
    grad_divisor: float = 1.0
    #: several ranks train each window together (DDP, FSDP2, DeepSpeed; not ``data_parallel="none"``): their
    #: counts are summed, they agree on the window, a rank without a micro-batch runs zero-weight padding
    shares_windows: bool = False
    #: False: the wrapper reduces only inside its backward (FSDP2, DeepSpeed), so reduce_gradients_ refuses
    can_reduce_later: bool = True
    #: every rank runs as many micro-batches per window (a collective in every forward or backward)
    needs_equal_counts: bool = False
    #: a collective in a window's first forward (DDP's buffer broadcast), which every rank must reach
    collectives_in_forward: bool = False
    #: every rank holds the whole reduced gradient (DDP), so replicas can be compared
    replicated_grads: bool = False
    #: each rank holds a shard of the parameters and gradient (FSDP2): its norm needs the ranks, and every
    #: forward all-gathers the shards (a collective every rank runs in order)
    sharded_grads: bool = False
    #: the wrapper steps (and clips, and measures the norm) itself (DeepSpeed's ``engine.step()``)
    owns_step: bool = False
    #: the gradient cannot be rescaled at the boundary (DeepSpeed's partitions): N is known before the first
    #: backward, so that R = N and the scale is 1
    needs_count_first: bool = False
    #: a gradient outside the model's forward, the same on every rank (a WindowLoss's parameters), rides in
    #: the reducing backward, not in ``.grad`` first: not under DDP(find_unused_parameters=True), whose
    #: reducer reads the ``.grad`` of a parameter the forward did not use
    folds_outside_gradients: bool = True
    group: Any = None
    group_size: int = 1  #: ranks in the data-parallel group (1 on one process)

    def micro_batch(self, *, last: bool) -> ContextManager[Any]:
        """Wraps one micro-batch's forward *and* backward; reduces gradients only when ``last``."""
        return contextlib.nullcontext()

    def check_reduced(self) -> None:
        """With ``replicated_grads``, after the reducing backward and before the step: raise where the wrapper did
        not reduce the whole gradient."""

    #: one micro-batch's backward of its weighted (and loss-scaled) loss: ``loss.backward()`` itself, with no
    #: frame of ours around it; a wrapper that owns the backward (DeepSpeed's ``engine.backward``) overrides it
    backward = staticmethod(torch.Tensor.backward)

    def step(self, optimizer: Any, precision: Any) -> Optional[float]:
        """The window's optimizer step (through the GradScaler under fp16); the norm of the gradient it
        stepped on where the step itself measured one (None: the boundary measured it, if asked)."""
        precision.step(optimizer)
        return None

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.shares_windows:
            all_reduce_(tensor, op, self.group)
        return tensor

    def local_square_sum(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's part of the gradient's squared norm, when summing it across ranks gives the
        whole (each element held by exactly one rank); else None. Only sharded gradients have one."""
        return None

    def any_rank(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when ``flag`` is True on any (one all-reduce on ``device``, one host sync)."""
        return flag if not self.shares_windows else self.min_across(not flag, device) == 0

    def min_across(self, value: int, device: torch.device) -> int:
        if not self.shares_windows:
            return value
        return int(self.all_reduce_(torch.tensor([int(value)], device=device), "min").item())

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        """Start an in-place sum all-reduce and return its work handle (``.wait()``), or None locally."""
        if not self.shares_windows:
            return None
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, in rank order."""
        if not self.shares_windows:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.group_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)

    def gather_items(self, tensors: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], int]:
        """Every rank's ``tensors`` (dim 0: this rank's items, any number) joined along dim 0 in rank order, not
        differentiable, and where this rank's items start: one all-gather of the counts and layouts (ranks whose
        layouts differ refuse alike), then one per tensor, padded to the most items."""
        if not self.shares_windows:
            return list(tensors), 0
        n = tensors[0].shape[0]
        layout = zlib.crc32(repr([(tuple(t.shape[1:]), str(t.dtype)) for t in tensors]).encode())
        rows = self.all_gather(torch.tensor([n, layout], dtype=torch.float64, device=tensors[0].device)).tolist()
        if any(row[1] != rows[0][1] for row in rows):
            raise RankAgreementError(
                "the ranks' representations differ in layout (the number of tensors, their shapes past the item "
                "dimension, or their dtypes), so they cannot be joined into one window: return the same structure "
                "of tensors on every rank, padded to one length where a rank's sequences are shorter")
        counts = [int(row[0]) for row in rows]
        joined = []
        for t in tensors:
            sent = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool all-gather
            padded = sent.new_zeros((max(counts), *t.shape[1:]))
            padded[:n] = sent
            whole = torch.cat([part[:c] for part, c in zip(self.all_gather(padded), counts)])
            joined.append(whole.to(torch.bool) if t.dtype == torch.bool else whole)
        return joined, sum(counts[:dist.get_rank(self.group)])

    def reduce_gradients_(self, grads: List[torch.Tensor]) -> None:
        """Average the local gradients across ranks now; every backward of the window skipped it (the size search)."""
        if not self.can_reduce_later:  # never step on gradients that were not averaged across ranks
            raise NotImplementedError(f"{type(self).__name__} reduces the gradient only inside its backward")

    def low_precision_sum(self, params: Sequence[nn.Parameter]) -> Optional[str]:
        """Where the wrapper sums the window's gradient in bf16/fp16 (which gradaccum's float32 buffers cannot
        replace), with the setting that would sum it in float32; None where it sums in float32 (or gradaccum's
        buffers can, on one process)."""
        return None
