"""Rank 0 decides, every rank learns the outcome: the command line's one way to do so.

The run folder, the default ``runs/version_K`` and the checkpoint to resume from are rank 0's to
inspect (another node's ``--out`` may hold no copy, or a stale one). :func:`rank0_decides` runs the
decision on rank 0 alone and hands its result, or its one-line refusal, to every rank in one
broadcast, so that all ranks go on alike or all stop with rank 0's words (which rank 0 alone
prints). On one process it is a plain call.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .. import sync
from .errors import CLIError

__all__ = ["rank0_decides"]

T = TypeVar("T")


def rank0_decides(decide: Callable[[], T]) -> T:
    """``decide()`` run on rank 0; its result on every rank, or its CLIError raised on every rank.

    Any other exception is raised on rank 0 as it is; the other ranks, told, raise a CLIError
    naming it instead of waiting for a broadcast that would never come."""
    outcome = None
    if sync.is_rank_zero():
        try:
            outcome = ("ok", decide())
        except CLIError as e:
            outcome = ("refused", (str(e), getattr(e, "exit_code", 2)))
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here
            sync.broadcast_object(("failed", f"{type(e).__name__}: {e}"))
            raise
    kind, value = sync.broadcast_object(outcome)
    if kind == "ok":
        return value
    if kind == "failed":
        raise CLIError(f"rank 0 failed: {value}")
    error = CLIError(value[0])
    if value[1] != 2:
        error.exit_code = value[1]  # type: ignore[attr-defined]
    raise error
