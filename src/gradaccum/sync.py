"""The distributed seam: :func:`sync_for`, its one factory, and its DDP and FSDP2 backends (the interface and
local default: :mod:`gradaccum._seam`; DeepSpeed: :mod:`gradaccum._deepspeed`). The wrapper is found anywhere in
the model (``torch.compile(DDP(model))``, Accelerate's wrappers, user modules holding one). Every switch a
context flips is restored on the way out, also on an exception."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._deepspeed import DeepSpeedSync, deepspeed_engine
from ._maths import tensor_norms
from ._seam import (LOW_PRECISION, GradSync, all_reduce_, barrier, broadcast_object, is_distributed, is_rank_zero,
                    loaded_type, rank, world_size)
from .errors import ConfigurationError, NotExactError

__all__ = ["GradSync", "DDPSync", "FSDP2Sync", "sync_for", "is_distributed",
           "rank", "world_size", "is_rank_zero", "barrier", "broadcast_object", "all_reduce_",
           "loaded_type", "full_tensor", "sharded_stage"]

#: what a pipeline stage is told: the Accumulator runs no pipeline schedule; gradaccum.PipelineWindow does
PIPELINE = ("the Accumulator does not run a pipeline's stages; hand them to gradaccum.PipelineWindow(stages, "
            "optimizer, loss_fn, n_microbatches=..., reduction='sum'), build the torch.distributed.pipelining "
            "schedule with loss_fn=pipe.loss and scale_grads=False, and step pipe.step(schedule, ...) "
            "(gradaccum.pipeline, docs/guides/pipeline.md)")
_PIPELINE_TYPES = (("torch.distributed.pipelining._IR", "Pipe"),
                   ("torch.distributed.pipelining.stage", "_PipelineStageBase"),
                   ("torch.distributed.pipelining.schedules", "_PipelineSchedule"))


def _fsdp2_module_type() -> Any:
    return loaded_type(("torch.distributed.fsdp", "torch.distributed._composable.fsdp"), "FSDPModule")


class _WrapperSync(GradSync):
    """A wrapper's modules that reduce in the last micro-batch's backward (or, asked, in every one's),
    their switch (:meth:`_skip_sync`) flipped around every other micro-batch's forward and backward."""

    shares_windows = True

    def __init__(self, modules: Sequence[nn.Module], *, reduce_every_micro_batch: bool = False) -> None:
        self.modules = list(modules)
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.group_size = dist.get_world_size(self.group)
        self.grad_divisor = float(self.group_size)

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if not (last or self.reduce_every_micro_batch):
                self._skip_sync(stack)
            yield

    def _skip_sync(self, stack: contextlib.ExitStack) -> None:
        raise NotImplementedError


class DDPSync(_WrapperSync):
    """``DistributedDataParallel``: ``no_sync()`` around every micro-batch but the last, on every DDP module
    of the model (DDP reads ``require_backward_grad_sync`` in *forward*)."""

    collectives_in_forward = True
    replicated_grads = True

    def __init__(self, modules: Sequence[DistributedDataParallel], *, reduce_every_micro_batch: bool = False) -> None:
        if not reduce_every_micro_batch and any(getattr(ddp, "static_graph", False) for ddp in modules):
            raise ConfigurationError(
                "DistributedDataParallel(static_graph=True) cannot skip the gradient reduction "
                "between micro-batches: its graph is recorded from the first iteration, and "
                "no_sync() iterations break it. Construct DDP with static_graph=False (the default), "
                "or pass reduce_every_micro_batch=True to reduce after every micro-batch.")
        sizes = {dist.get_world_size(getattr(m, "process_group", None)) for m in modules}
        if len(sizes) != 1:
            raise ConfigurationError(f"the model's DistributedDataParallel modules span process groups of "
                             f"different sizes {sorted(sizes)}; use one process group for data parallelism")
        self.group = getattr(modules[0], "process_group", None)
        self.needs_equal_counts = reduce_every_micro_batch
        self.folds_outside_gradients = not any(getattr(ddp, "find_unused_parameters", False) for ddp in modules)
        super().__init__(modules, reduce_every_micro_batch=reduce_every_micro_batch)

    def _skip_sync(self, stack: contextlib.ExitStack) -> None:
        for ddp in self.modules:
            stack.enter_context(ddp.no_sync())  # restores require_backward_grad_sync on any exit

    def check_reduced(self) -> None:
        """After the reducing backward, before the step: every bucket was reduced. Without
        ``find_unused_parameters=True``, a parameter the last micro-batch did not use leaves its bucket unreduced,
        which DDP itself says only at the next forward with gradients, after the step (or never)."""
        for ddp in self.modules:
            try:
                getattr(ddp, "_check_reducer_finalized", lambda: None)()  # torch's check for after a backward
            except RuntimeError:
                raise NotExactError(
                    "a parameter of the DistributedDataParallel model got no gradient in this window's last "
                    "micro-batch, the one that reduces, and DDP was built without find_unused_parameters=True: it "
                    "did not reduce that parameter's bucket, so the ranks' gradients differ. No step was taken. Wrap "
                    "the model in DistributedDataParallel(model, find_unused_parameters=True)") from None

    def reduce_gradients_(self, grads: List[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.group_size)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def low_precision_sum(self, params: Sequence[nn.Parameter]) -> Optional[str]:
        low = sorted({str(p.dtype) for p in params if p.dtype in LOW_PRECISION})
        if not low:
            return None
        return (f"DistributedDataParallel sums the window's gradient in the parameters' own .grad ({', '.join(low)}); "
                "keep float32 parameters and run the forward under precision='bf16' (autocast) to sum it in float32")


class FSDP2Sync(_WrapperSync):
    """FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` until the last micro-batch.

    Skipping keeps each rank's *unsharded* gradient between micro-batches: about
    ``P * bytes * (1 - 1/W)`` more memory than the sharded gradient, for one reduce-scatter per window
    instead of N. ``reduce_every_micro_batch=True`` trades the other way: sharded gradients only, N
    reduce-scatters per window. FSDP2 all-gathers in every forward, so every rank runs the same number
    of micro-batches; ``Accumulator.step``/``train`` pad a rank that has fewer with zero-weight ones.
    """

    can_reduce_later = False
    needs_equal_counts = True
    sharded_grads = True

    def _skip_sync(self, stack: contextlib.ExitStack) -> None:
        for module in self.modules:
            module.set_requires_gradient_sync(False, recurse=True)  # type: ignore[operator]
            stack.callback(module.set_requires_gradient_sync, True, recurse=True)  # type: ignore[operator]

    def low_precision_sum(self, params: Sequence[nn.Parameter]) -> Optional[str]:
        """FSDP2 keeps the unsharded gradient between micro-batches, and reduce-scatters it, in ``reduce_dtype``."""
        for module in self.modules:
            try:
                policy = module._get_fsdp_state()._mp_policy  # type: ignore[operator]  # torch's private state
            except Exception:  # noqa: BLE001 - a torch without it: the parameters' dtype decides alone
                policy = None
            param_dtype, asked = getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)
            sums_in = asked or param_dtype or next((p.dtype for p in module.parameters()), None)
            if sums_in in LOW_PRECISION:
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


def _outermost(modules: List[nn.Module]) -> List[nn.Module]:
    """The ``modules`` that no other of them holds (a wrapper inside a wrapper switches with the outer one)."""
    inner = {id(child) for m in modules for child in m.modules() if child is not m}
    return [m for m in modules if id(m) not in inner]


def sync_for(model: nn.Module, *, reduce_every_micro_batch: bool = False, data_parallel: str = "auto") -> GradSync:
    """The seam that fits ``model``: its DeepSpeed engine, the DDP or FSDP2 module found anywhere inside it,
    or local (refused: FSDP1, DDP mixed with FSDP2, or under ``data_parallel="auto"`` a model that no
    data-parallel wrapper reduces while ``torch.distributed`` runs several ranks)."""
    if data_parallel not in ("auto", "none"):
        raise ConfigurationError(f"data_parallel must be 'auto' or 'none', got {data_parallel!r}")
    if deepspeed_engine(model) is not None:
        if data_parallel == "none" or reduce_every_micro_batch:
            given = f"data_parallel={data_parallel!r}" if data_parallel == "none" else "reduce_every_micro_batch=True"
            raise ConfigurationError(
                f"{given} around a DeepSpeed engine: the engine reduces across its data-parallel ranks itself "
                "(ZeRO-2/3 in every backward already); leave the default")
        return DeepSpeedSync(model)
    modules = list(model.modules())
    fsdp1 = loaded_type(("torch.distributed.fsdp",), "FullyShardedDataParallel")
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in modules):
        raise ConfigurationError(
            "FullyShardedDataParallel (FSDP1) is not supported: its no_sync() and gradient "
            "pre/post-division differ from DDP's. Shard the model with FSDP2's fully_shard(model) "
            "instead (torch.distributed.fsdp.fully_shard), which gradaccum supports")
    ddps = [m for m in modules if isinstance(m, DistributedDataParallel)]
    fsdp_type = _fsdp2_module_type()
    fsdps = [m for m in modules if fsdp_type is not None and isinstance(m, fsdp_type)]
    if data_parallel == "none" and (ddps or fsdps):
        raise ConfigurationError(
            f"data_parallel='none' but the model holds a {'DistributedDataParallel' if ddps else 'fully_shard'} "
            "module, which reduces gradients across ranks: leave data_parallel='auto'")
    if ddps and fsdps:
        raise ConfigurationError("the model holds both DistributedDataParallel and fully_shard modules; "
                                 "use one data-parallel wrapper")
    if ddps:
        return DDPSync(_outermost(ddps), reduce_every_micro_batch=reduce_every_micro_batch)  # type: ignore[arg-type]
    if fsdps:
        return FSDP2Sync(_outermost(fsdps), reduce_every_micro_batch=reduce_every_micro_batch)
    if data_parallel == "auto" and is_distributed() and dist.get_world_size() > 1:
        raise ConfigurationError(
            f"torch.distributed runs {dist.get_world_size()} ranks but no DistributedDataParallel or "
            f"fully_shard module reduces this {type(model).__name__}'s gradients: every rank would step "
            "on its own gradients and the replicas would drift apart. Wrap the whole model, the same on every "
            "rank (DistributedDataParallel(model) or fully_shard(model); torch.compile(ddp_model) is fine), "
            "or pass data_parallel='none' to train each rank on its own data on purpose. Where each rank holds "
            f"a stage of a pipeline: {PIPELINE}")
    return GradSync()


def sharded_stage(module: nn.Module) -> bool:
    """Whether a pipeline stage's module is in ``fully_shard`` (its replicas reduce its gradient); DDP is refused."""
    if isinstance(module, DistributedDataParallel):
        raise NotExactError(
            "a stage's module is wrapped in DistributedDataParallel: a PipelineStage's shape inference runs a "
            "backward outside no_sync, and DDP's reducer then fails its first window (torch 2.13: 'rebuilt "
            "parameter indices size is not same as original model parameters size'), so no exact window was "
            "measured over it; wrap each stage's module in fully_shard(module, mesh=mesh['dp']) instead, as "
            "torchtitan does, and pass dp_group=mesh['dp'].get_group()")
    fsdp_type = _fsdp2_module_type()
    return fsdp_type is not None and isinstance(module, fsdp_type)


def refuse_pipeline(model: Any) -> None:
    """A ``torch.distributed.pipelining`` object handed over as the model (a ``Pipe``, a stage, a schedule):
    refused with what is supported, before anything else is read of it."""
    for module, name in _PIPELINE_TYPES:
        kind = loaded_type((module,), name)
        if kind is not None and isinstance(model, kind):
            raise NotExactError(f"model is a {type(model).__name__}: {PIPELINE}")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (FSDP2 norms); any other tensor unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]
