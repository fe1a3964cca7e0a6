"""The distributed seam: the one module that imports ``torch.distributed``.

A :class:`GradSync` decides, per micro-batch, whether the backward pass reduces gradients across
ranks, and does the window's small collectives: the agreement when a window opens (how many
micro-batches and items each rank holds) and the all-reduce of the item count and loss sum at its
end. The local default does nothing. Data-parallel wrappers *average* the gradient over
``group_size`` ranks while reducing, which the backward weights make up for with the factor W
(``grad_divisor``; the maths is in :mod:`gradaccum._maths`).

The wrapper is found anywhere in the model: ``torch.compile(DDP(model))`` (``OptimizedModule``),
Accelerate's wrappers and user modules that hold a DDP or FSDP2 module all reduce through it. A model
that no data-parallel wrapper reduces is refused in a process group of several ranks: each rank would
step on its own gradients and the replicas would drift apart in silence.

Every switch a context flips is restored on the way out, also when an exception leaves it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import zlib
from typing import Any, ContextManager, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._maths import tensor_norms
from .errors import ConfigurationError, RankAgreementError

__all__ = ["GradSync", "DDPSync", "FSDP2Sync", "sync_for", "is_distributed",
           "rank", "world_size", "is_rank_zero", "barrier", "broadcast_object", "all_reduce_",
           "DATA_PARALLEL", "loaded_type"]

#: ``data_parallel=`` values: find the wrapper (and refuse none under several ranks), or train per rank
DATA_PARALLEL = ("auto", "none")


def loaded_type(modules: Sequence[str], name: str) -> Any:
    """``name`` from the first of ``modules`` already imported, else None. A model can only have
    been wrapped by a class whose module was imported, and importing FSDP here would cost every
    user about a second."""
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    return None


def _fsdp2_module_type() -> Any:
    return loaded_type(("torch.distributed.fsdp", "torch.distributed._composable.fsdp"), "FSDPModule")


def _fsdp1_type() -> Any:
    return loaded_type(("torch.distributed.fsdp",), "FullyShardedDataParallel")


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
    #: several ranks train each window together: their counts are summed and they agree on the window
    #: (the rank agreement, :mod:`gradaccum._ranks`, asks this; other modules ask the two questions
    #: below). False on one process, and on several under ``data_parallel="none"`` (each rank alone).
    #: A question about the window's *counts*; :attr:`reduces_across_ranks` is one about its *gradient*.
    #: Both wrappers here do both; a sync that summed counts but reduced gradients itself would not
    shares_windows: bool = False
    #: the last micro-batch's backward reduces the window's gradient across ranks (DDP, FSDP2): its
    #: ``micro_batch()`` switches the wrapper's sync, the boundary's all-reduce can start before that
    #: backward, and an out-of-memory agreement must come before it
    reduces_across_ranks: bool = False
    #: a rank may hold no micro-batch in a window its peers have data for (it runs zero-weight padding)
    allows_empty_share: bool = False
    #: whether reduce_gradients_ works (after backward passes that all skipped their reduction)
    can_reduce_later: bool = True
    #: whether every rank must run the same number of micro-batches per window (a collective in
    #: every forward or every backward)
    needs_equal_counts: bool = False
    #: whether the wrapper runs collectives in a window's first forward (DDP's buffer broadcast and
    #: bucket rebuild), so every rank must reach that forward
    collectives_in_forward: bool = False
    #: whether every rank holds the whole reduced gradient (DDP), so replicas can be compared
    replicated_grads: bool = False
    #: whether each rank holds a shard of the reduced gradient (FSDP2): its norm needs the ranks
    sharded_grads: bool = False
    #: the wrapper steps the optimizer itself (DeepSpeed's ``engine.step()``, which also clips and measures
    #: the norm): the boundary asks :meth:`step` and measures no norm of its own
    owns_step: bool = False
    #: the gradient lives where it cannot be rescaled at the boundary (DeepSpeed's partitions): every
    #: window's item count must be known before its first backward, so that R = N and the scale is 1
    needs_known_items: bool = False
    group: Any = None

    @property
    def group_size(self) -> int:
        """Ranks in the data-parallel group that reduces the gradient (1 on one process); the global
        world is :func:`world_size`."""
        return 1

    def micro_batch(self, *, last: bool) -> ContextManager[Any]:
        """Wraps one micro-batch's forward *and* backward; reduces gradients only when ``last``."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward of its weighted (and loss-scaled) loss."""
        loss.backward()

    def step(self, optimizer: Any, precision: Any) -> Optional[float]:
        """The window's optimizer step (through the GradScaler under fp16); the norm of the gradient it
        stepped on where the step itself measured one (None: the boundary measured it, if asked)."""
        precision.step(optimizer)
        return None

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.shares_windows:
            all_reduce_(tensor, op, self.group)
        return tensor

    def plain_reduction(self) -> bool:
        """Whether the backward's reduction is, as things stand now, the wrapper's own average of every
        rank's whole gradient, so that a ``nan`` one rank adds to any parameter's gradient reaches every
        rank's reduced gradient in that window, and that window only (see
        :func:`gradaccum._maths.loss_check_term`). Only DDP's can be."""
        return False

    def folds_outside_gradients(self) -> bool:
        """Whether a gradient computed outside the model's forward, the same on every rank (a
        :class:`~gradaccum.WindowLoss`'s own parameters), rides in the backward that reduces, rather
        than being put in ``.grad`` before any backward. It rides there except under
        ``DistributedDataParallel(find_unused_parameters=True)``, whose reducer marks a parameter the
        forward did not use as ready before that backward (and refuses it there), and reads its ``.grad``."""
        return True

    def local_square_sum(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's part of the gradient's squared norm, when summing it across ranks gives the
        whole (each element held by exactly one rank); else None. Only sharded gradients have one."""
        return None

    def reduced_parameters(self) -> Optional[List[nn.Parameter]]:
        """The parameters the wrapper may reduce across ranks (DDP's, less those it was told to
        ignore), or None where that does not apply. One trained since it was built but frozen then
        is not reduced either: the caller also needs a gradient the ranks found equal."""
        return None

    def any_rank(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when ``flag`` is True on any (one max all-reduce of a tensor on ``device``
        and one host sync across ranks; the flag itself on one process)."""
        if not self.shares_windows:
            return flag
        return bool(self.all_reduce_(torch.tensor([1.0 if flag else 0.0], device=device), "max").item())

    def min_across(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` of any rank, on every rank (``value`` itself on one process)."""
        if not self.shares_windows:
            return value
        return int(self.all_reduce_(torch.tensor([value], device=device), "min").item())

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
        """Every rank's ``tensors`` (which share their leading dimension: this rank's items) joined along
        dim 0 in rank order, and where this rank's items start in them. Each rank may hold any number of
        items, none included: one all-gather of the counts, then one per tensor, padded to the most
        items. On one process, the tensors themselves. Nothing is differentiable: this is data. The
        first all-gather also carries each rank's layout (how many tensors, their shapes past dim 0 and
        dtypes): ranks whose layouts differ would send mismatched all-gathers, so every rank refuses alike."""
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
        most = max(counts)
        joined = []
        for t in tensors:
            sent = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool all-gather
            padded = sent.new_zeros((most, *t.shape[1:]))
            padded[:n] = sent
            parts = [torch.empty_like(padded) for _ in range(self.group_size)]
            dist.all_gather(parts, padded, group=self.group)
            whole = torch.cat([part[:c] for part, c in zip(parts, counts)])
            joined.append(whole.to(torch.bool) if t.dtype == torch.bool else whole)
        return joined, sum(counts[:dist.get_rank(self.group)])

    def reduce_gradients_(self, grads: List[torch.Tensor]) -> None:
        """Average already-accumulated local gradients across ranks now (used when every backward
        of the window skipped its reduction: a rank without data, or the micro-batch size search)."""

    def low_precision_sum(self, params: Sequence[nn.Parameter]) -> Optional[str]:
        """Where the wrapper sums the window's gradient in bf16/fp16 (its own accumulation, which
        gradaccum's float32 buffers cannot replace), with the setting that would sum it in float32;
        None where it sums in float32 (or gradaccum's buffers can, on one process)."""
        return None


class DDPSync(GradSync):
    """``DistributedDataParallel``: ``no_sync()`` around every micro-batch but the last.

    DDP reads ``require_backward_grad_sync`` in *forward*, so the context covers forward and backward.
    Every DDP module of the model (usually one) is switched.
    """

    shares_windows = reduces_across_ranks = allows_empty_share = True
    collectives_in_forward = True
    replicated_grads = True

    def __init__(self, modules: Sequence[DistributedDataParallel], *, reduce_every_micro_batch: bool = False) -> None:
        for ddp in modules:
            if getattr(ddp, "static_graph", False) and not reduce_every_micro_batch:
                raise ConfigurationError(
                    "DistributedDataParallel(static_graph=True) cannot skip the gradient reduction "
                    "between micro-batches: its graph is recorded from the first iteration, and "
                    "no_sync() iterations break it. Construct DDP with static_graph=False (the default), "
                    "or pass reduce_every_micro_batch=True to reduce after every micro-batch."
                )
        self.modules = list(modules)
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.needs_equal_counts = reduce_every_micro_batch
        self.group = getattr(modules[0], "process_group", None)
        sizes = {dist.get_world_size(getattr(m, "process_group", None)) for m in modules}
        if len(sizes) != 1:
            raise ConfigurationError(f"the model's DistributedDataParallel modules span process groups of "
                             f"different sizes {sorted(sizes)}; use one process group for data parallelism")
        self.grad_divisor = float(self.group_size)

    @property
    def group_size(self) -> int:
        return dist.get_world_size(self.group)

    def plain_reduction(self) -> bool:
        """Not under ``find_unused_parameters=True`` (DDP marks a parameter that missed the forward as
        reduced before the backward, and refuses a gradient reaching it from outside the forward), nor
        under a communication hook, read at every call since one may be registered at any time:
        PowerSGD's error feedback would keep a ``nan`` for every later window, a compressing or
        ``nan``-scrubbing hook could lose it. DDP's logging data names the hook, built-in ones too; a
        torch whose DDP no longer offers it (a private method) answers False: every window exchanges."""
        return not any(getattr(ddp, "find_unused_parameters", False) or _has_comm_hook(ddp) for ddp in self.modules)

    def folds_outside_gradients(self) -> bool:
        return not any(getattr(ddp, "find_unused_parameters", False) for ddp in self.modules)

    def reduced_parameters(self) -> Optional[List[nn.Parameter]]:
        reduced = []
        for ddp in self.modules:
            ignored: set = getattr(ddp, "parameters_to_ignore", set())
            reduced += [p for name, p in ddp.module.named_parameters() if name not in ignored and p.requires_grad]
        return reduced

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        if last or self.reduce_every_micro_batch:
            yield
            return
        with contextlib.ExitStack() as stack:
            for ddp in self.modules:
                stack.enter_context(ddp.no_sync())  # restores require_backward_grad_sync on any exit
            yield

    def reduce_gradients_(self, grads: List[torch.Tensor]) -> None:
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.group_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


    def low_precision_sum(self, params: Sequence[nn.Parameter]) -> Optional[str]:
        low = sorted({str(p.dtype) for p in params if p.dtype in _LOW_PRECISION})
        if not low:
            return None
        return (f"DistributedDataParallel sums the window's gradient in the parameters' own .grad ({', '.join(low)}); "
                "keep float32 parameters and run the forward under precision='bf16' (autocast) to sum it in float32")


#: floating dtypes whose running sum rounds to 8 (bf16) or 11 (fp16) bits of mantissa
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _has_comm_hook(ddp: DistributedDataParallel) -> bool:
    """Whether DDP's logging data names a communication hook (True as well when it cannot be read)."""
    try:
        return ddp._get_ddp_logging_data().get("comm_hook") is not None
    except Exception:  # noqa: BLE001 - a private method of DDP: unknown means "assume a hook"
        return True


class FSDP2Sync(GradSync):
    """FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` until the last micro-batch.

    Skipping keeps each rank's *unsharded* gradient between micro-batches: about
    ``P * bytes * (1 - 1/W)`` more memory than the sharded gradient, for one reduce-scatter per window
    instead of N. ``reduce_every_micro_batch=True`` trades the other way: sharded gradients only, N
    reduce-scatters per window. FSDP2 all-gathers in every forward, so every rank runs the same number
    of micro-batches; ``Accumulator.step``/``train`` pad a rank that has fewer with zero-weight ones.
    """

    shares_windows = reduces_across_ranks = allows_empty_share = True
    can_reduce_later = False
    needs_equal_counts = True
    sharded_grads = True

    def __init__(self, modules: Sequence[nn.Module], *, reduce_every_micro_batch: bool = False) -> None:
        self.modules = list(modules)  # the outermost fully_shard-ed modules
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.grad_divisor = float(self.group_size)

    @property
    def group_size(self) -> int:
        return dist.get_world_size()

    def _set_sync(self, enabled: bool) -> None:
        for module in self.modules:
            module.set_requires_gradient_sync(enabled, recurse=True)  # type: ignore[operator]

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

    def low_precision_sum(self, params: Sequence[nn.Parameter]) -> Optional[str]:
        """FSDP2 keeps the unsharded gradient between micro-batches in ``MixedPrecisionPolicy.reduce_dtype``
        (None: the ``param_dtype``, else the sharded parameters' dtype) and reduce-scatters in it."""
        for module in self.modules:
            try:
                policy = module._get_fsdp_state()._mp_policy  # type: ignore[operator]  # torch's private state
            except Exception:  # noqa: BLE001 - a torch without it: the parameters' dtype decides alone
                policy = None
            param_dtype = getattr(policy, "param_dtype", None)
            reduce_dtype = getattr(policy, "reduce_dtype", None) or param_dtype
            sums_in = reduce_dtype or next((p.dtype for p in module.parameters()), None)
            asked = getattr(policy, "reduce_dtype", None)
            if sums_in in _LOW_PRECISION:
                return (f"FSDP2 sums the window's unsharded gradient and reduce-scatters it in {sums_in} "
                        f"(MixedPrecisionPolicy(param_dtype={param_dtype}, reduce_dtype={asked}) "
                        "over the sharded parameters); shard float32 parameters with "
                        "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
        return None

    def local_square_sum(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """``sum ||local shard||^2`` in float64 when every gradient is a DTensor sharded over a mesh of
        all the ranks (plain FSDP2); None under HSDP (a replicated mesh dimension would count twice).
        The same answer on every rank: the placements are the model's."""
        shards = []
        for g in grads:
            mesh, placements = getattr(g, "device_mesh", None), getattr(g, "placements", None)
            if mesh is None or placements is None or mesh.size() != self.group_size \
                    or not all(p.is_shard() for p in placements):
                return None
            shards.append(g.to_local())  # type: ignore[attr-defined]
        if not shards:
            return None
        norms = tensor_norms(shards, torch.float64)
        return (norms * norms).sum()


def _outermost(modules: List[nn.Module], kind: Any) -> List[nn.Module]:
    inner = {id(child) for m in modules for child in m.modules() if child is not m and isinstance(child, kind)}
    return [m for m in modules if id(m) not in inner]


def sync_for(model: nn.Module, *, reduce_every_micro_batch: bool = False, data_parallel: str = "auto") -> GradSync:
    """The seam that fits ``model``: the DDP or FSDP2 module found anywhere inside it, or local.

    Raises:
        ValueError: FSDP1, DDP mixed with FSDP2, or (with ``data_parallel="auto"``) a model that no
            data-parallel wrapper reduces while ``torch.distributed`` runs several ranks.
    """
    if data_parallel not in DATA_PARALLEL:
        raise ConfigurationError(f"data_parallel must be 'auto' or 'none', got {data_parallel!r}")
    from ._deepspeed import DeepSpeedSync, deepspeed_engine

    if deepspeed_engine(model) is not None:
        if data_parallel == "none" or reduce_every_micro_batch:
            given = f"data_parallel={data_parallel!r}" if data_parallel == "none" else "reduce_every_micro_batch=True"
            raise ConfigurationError(
                f"{given} "
                "around a DeepSpeed engine: the engine reduces across its data-parallel ranks itself (ZeRO-2/3 in "
                "every backward already); leave the default")
        return DeepSpeedSync(model)
    modules = list(model.modules())
    fsdp1 = _fsdp1_type()
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in modules):
        raise ConfigurationError(
            "FullyShardedDataParallel (FSDP1) is not supported: its no_sync() and gradient "
            "pre/post-division differ from DDP's. Shard the model with FSDP2's fully_shard(model) "
            "instead (torch.distributed.fsdp.fully_shard), which gradaccum supports"
        )
    ddps = [m for m in modules if isinstance(m, DistributedDataParallel)]
    fsdp_type = _fsdp2_module_type()
    fsdps = [m for m in modules if fsdp_type is not None and isinstance(m, fsdp_type)]
    if data_parallel == "none":
        if ddps or fsdps:
            raise ConfigurationError(
                f"data_parallel='none' but the model holds a {'DistributedDataParallel' if ddps else 'fully_shard'} "
                "module, which reduces gradients across ranks: leave data_parallel='auto'"
            )
        return GradSync()
    if ddps and fsdps:
        raise ConfigurationError("the model holds both DistributedDataParallel and fully_shard modules; "
                         "use one data-parallel wrapper")
    if ddps:
        return DDPSync(_outermost(ddps, DistributedDataParallel),  # type: ignore[arg-type]
                       reduce_every_micro_batch=reduce_every_micro_batch)
    if fsdps:
        return FSDP2Sync(_outermost(fsdps, fsdp_type), reduce_every_micro_batch=reduce_every_micro_batch)
    if is_distributed() and dist.get_world_size() > 1:
        raise ConfigurationError(
            f"torch.distributed runs {dist.get_world_size()} ranks but no DistributedDataParallel or "
            f"fully_shard module reduces this {type(model).__name__}'s gradients: every rank would step "
            "on its own gradients and the replicas would drift apart. Wrap the model "
            "(DistributedDataParallel(model) or fully_shard(model); torch.compile(ddp_model) is fine), "
            "or pass data_parallel='none' to train each rank on its own data on purpose"
        )
    return GradSync()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (FSDP2 norms); any other tensor unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]
