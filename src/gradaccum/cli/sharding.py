"""The command line's own use of ``torch.distributed``: joining the group, ``--shard`` and its checkpoints.

The library's seam (:mod:`gradaccum.sync`) reduces gradients; this module is what a training *run*
adds on top: joining torchrun's process group, sharding the model with FSDP2 (``fully_shard``), and
checkpoints of a sharded model through ``torch.distributed.checkpoint`` (DCP).

A sharded checkpoint is a folder (``last.dcp``): every rank writes its shards, rank 0 adds
``gradaccum.pt`` (the position, the Accumulator's state, the settings, and the SHA-256 of every
other file in the folder, under ``"shards"``). DCP's files carry no checksum of their own, so a flipped
byte in a tensor would load as other weights: before anything is loaded, rank 0 compares every
file with its checksum (:func:`read_sharded_meta`), and a damaged checkpoint is refused on every rank
in one line and left in place, like a damaged ``last.pt``. It is atomic in effect: it is written to
a temporary folder, which rank 0 then puts in place with two renames (the old folder aside, the
new one in)::

    .last.dcp.tmp-dcp  --(all ranks: dcp.save; rank 0: gradaccum.pt)-->  complete
    last.dcp -> .last.dcp.old ;  .last.dcp.tmp-dcp -> last.dcp ;  remove .last.dcp.old

A reader takes ``last.dcp``, or ``.last.dcp.old`` if a crash fell between the two renames; a
temporary folder is never read. DCP stores global tensor shapes, so a checkpoint written by W ranks
loads on W' ranks, sharded or not.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import sync
from .atomic import fsync_dir
from .checkpoint import EVAL_FIX, TRAIN_FIX, corrupt, load_checkpoint, save_atomic
from .checksum import SHARD_CHECKSUMS, file_digests, files_damaged
from .errors import CLIError
from .launch import launch

__all__ = ["setup_distributed", "teardown_distributed", "shard_model", "save_sharded", "load_sharded",
           "load_sharded_model", "read_sharded_meta", "sharded_folder", "META", "META_KEYS", "SHARD_CHECKSUMS"]

META = "gradaccum.pt"
_made_group = False  # this process joined (or made) the group: the command leaves it at its end
#: what gradaccum.pt holds (the model and optimizer are DCP's shards beside it)
META_KEYS = ("accumulator", "config", "epoch", "window")


def setup_distributed(device: torch.device, *, shard: bool = False) -> None:
    """Join torchrun's process group (several processes), or make a group of one for ``--shard``.

    The group's keys go under a prefix of torchrun's restart count: a restarted worker group meets in
    the agent's store, where the previous attempt's keys (its peers' closed addresses) still are, and
    gloo could read those before the new peer writes its own."""
    global _made_group
    if sync.is_distributed():
        return
    started = launch()
    if started.several:
        _made_group = True
        store, rank, world_size = next(dist.rendezvous("env://"))
        attempt = started.restart_count
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore(f"gradaccum/attempt_{attempt}", store),
                                rank=rank, world_size=world_size)
    elif shard:  # fully_shard and DCP need a group, even of one process
        _made_group = True
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)


def teardown_distributed() -> bool:
    """Leave the group this command made: a gloo group still alive at interpreter exit can abort the
    process ('terminate called without an active exception') after its work is done. The sharded
    model's DTensors and device mesh sit in reference cycles that still hold the group: collected
    first, so the group goes now, not in the interpreter's teardown (how often it aborted with and
    without: docs/measurements.md). True when it left a group of several ranks (then the process has
    nothing left to do but exit: :func:`gradaccum.cli.main` ends it without the interpreter's
    teardown, where gloo can still abort)."""
    global _made_group
    several = False
    if _made_group and sync.is_distributed():
        several = dist.get_world_size() > 1
        gc.collect()
        dist.destroy_process_group()
    _made_group = False
    return several


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 over all ranks: each child that holds parameters, then the root (parameters, gradients
    and optimizer state sharded; each forward all-gathers a child's parameters in turn)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _temp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-dcp")  # one name for every rank: they write one folder


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def sharded_folder(path: Path) -> Optional[Path]:
    """The complete checkpoint folder to read: ``path``, or the previous one set aside by a swap a
    crash interrupted; None when there is none."""
    for candidate in (path, _old(path)):
        if (candidate / META).is_file():
            return candidate
    return None


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, meta: Dict[str, Any], path: Path) -> None:
    """Every rank: write the sharded checkpoint at ``path`` (see the module docstring). Raises an
    OSError on every rank when the write fails; ``path`` then still holds the previous checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, old = _temp(path), _old(path)
    error = None
    if sync.is_rank_zero():
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)  # a write a crash abandoned
    sync.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
        if sync.is_rank_zero():  # every rank's shards are written once dcp.save returns on the coordinator
            save_atomic({**meta, SHARD_CHECKSUMS: file_digests(tmp, but=META)}, tmp / META)
    except Exception as e:  # noqa: BLE001 - DCP wraps the OSError of a full disk in its own exception
        error = e
    error = sync.broadcast_object(None if error is None else _os_error(error))
    if error is not None:
        if sync.is_rank_zero():
            shutil.rmtree(tmp, ignore_errors=True)
        sync.barrier()
        raise error
    if sync.is_rank_zero():
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(path.parent)
    sync.barrier()


def _os_error(error: BaseException) -> OSError:
    """The OSError under a DCP failure (its text names the system's reason), or one that says what failed."""
    seen: Any = error
    for _ in range(8):
        if isinstance(seen, OSError):
            return OSError(seen.errno, seen.strerror or str(seen))
        failures = getattr(seen, "failures", None)  # CheckpointException: {rank: exception}
        if isinstance(failures, dict) and failures:
            seen = next(iter(failures.values()))
            seen = seen[0] if isinstance(seen, tuple) else seen
            continue
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            break
    return OSError(f"the sharded checkpoint could not be written ({type(error).__name__})")


def read_sharded_meta(path: Path, *, fix: str = TRAIN_FIX) -> Dict[str, Any]:
    """A sharded checkpoint's ``gradaccum.pt``, after every shard file was compared with the
    checksum written with it; a damaged or missing one is refused in one line, the folder left in
    place. A checkpoint written before the checksums existed has none to compare."""
    folder = sharded_folder(path)
    if folder is None:
        raise CLIError(f"checkpoint {path} does not exist or is incomplete (no {META}); train first, or give "
                       "the last.dcp folder a --shard run wrote")
    meta = load_checkpoint(folder / META, required=META_KEYS, fix=fix)
    expected = meta.get(SHARD_CHECKSUMS)
    reason = files_damaged(folder, expected) if isinstance(expected, dict) else None
    if reason is not None:
        raise corrupt(path, reason, fix)
    return meta


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every rank: load the model's and the optimizer's shards, whatever the world size that wrote them
    (their checksums were compared by rank 0 when the run decided to resume: :func:`read_sharded_meta`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = sharded_folder(path)
    if folder is None:
        raise CLIError(f"checkpoint {path} does not exist or is incomplete; train first, or give a last.dcp folder")
    model_state, optim_state = get_state_dict(model, optimizer)
    state: Dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception:  # noqa: BLE001 - DCP fails on every rank alike; its own text is a long traceback
        raise corrupt(path, "DCP cannot read its shards (damaged, or from another model)") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_sharded_model(model: nn.Module, path: Path) -> None:
    """One process, no group: a sharded checkpoint's model into a plain model (``gradaccum eval``),
    whose ``gradaccum.pt`` and checksums :func:`read_sharded_meta` has read."""
    import torch.distributed.checkpoint as dcp

    folder = sharded_folder(path) or path
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # DCP warns of the single-process load we ask for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, checkpoint_id=str(folder), no_dist=not sync.is_distributed())
    except Exception:  # noqa: BLE001 - DCP's own text is long; the reason in our words
        raise corrupt(path, "DCP cannot read its shards into this model (damaged, or another model)", EVAL_FIX) from None
    model.load_state_dict(state["model"])
