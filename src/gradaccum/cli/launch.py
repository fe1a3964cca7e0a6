"""The launcher's environment, read in one place: what torchrun (or nothing) told this process.

torchrun sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` in every worker;
its elastic agent adds ``TORCHELASTIC_RESTART_COUNT`` (0 on the first start, K after the K-th
restart of the worker group) and ``TORCHELASTIC_RUN_ID``. A plain ``python -m gradaccum`` sets
none of them: one process, rank 0. No other module of the command line reads these variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["Launch", "launch"]


@dataclass(frozen=True)
class Launch:
    """How this process was started.

    Attributes:
        world_size: the processes of the run (``WORLD_SIZE``; 1 without a launcher).
        rank: this process's rank (``RANK``; 0 without a launcher).
        local_rank: its rank on this machine (``LOCAL_RANK``), the CUDA device it takes; None
            without a launcher.
        local_world_size: the processes on this machine (``LOCAL_WORLD_SIZE``).
        restart_count: how often torchrun's agent restarted the worker group (``--max-restarts``).
        elastic: started by torchrun's elastic agent, which forwards a Ctrl-C to its workers.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: Optional[int] = None
    local_world_size: int = 1
    restart_count: int = 0
    elastic: bool = False

    @property
    def several(self) -> bool:
        """More than one process: the run joins a process group."""
        return self.world_size > 1

    @property
    def single_node(self) -> bool:
        """Every process on this machine (``torchrun --standalone`` or one ``--nnodes``)."""
        return self.local_world_size == self.world_size


def _int(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    """A launcher's number; an empty or malformed value counts as not set."""
    try:
        return max(minimum, int(environ.get(name, "") or default))
    except ValueError:
        return default


def launch(environ: Optional[Mapping[str, str]] = None) -> Launch:
    """This process's :class:`Launch`, read from ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    world = _int(env, "WORLD_SIZE", 1, 1)
    local_rank = env.get("LOCAL_RANK")
    return Launch(world_size=world, rank=_int(env, "RANK", 0, 0),
                  local_rank=_int(env, "LOCAL_RANK", 0, 0) if local_rank not in (None, "") else None,
                  local_world_size=_int(env, "LOCAL_WORLD_SIZE", world, 1),
                  restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0),
                  elastic="TORCHELASTIC_RUN_ID" in env)
