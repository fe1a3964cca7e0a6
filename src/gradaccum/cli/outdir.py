"""The default run folder: each plain ``gradaccum train`` gets a new ``runs/version_K``.

K is one more than the largest K under ``runs/`` (0 for the first), claimed by creating the folder,
so two runs started at once never share one. Under torchrun rank 0 claims it and tells the others.
An explicit ``--out`` is never chosen here: it keeps its refusal, ``--resume`` and ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Optional

from .. import sync
from .errors import CLIError
from .checkpoint import describe_os_error

__all__ = ["RUNS", "claim_run_folder", "release_if_empty"]

RUNS = Path("runs")
_VERSION = re.compile(r"version_(\d+)$")


def _next_version(root: Path) -> int:
    taken = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION.match(p.name))] if root.is_dir() else []
    return max(taken, default=-1) + 1


def claim_run_folder(root: Path = RUNS) -> Path:
    """Create and return ``root/version_K`` (rank 0; every rank gets the same path)."""
    outcome = None
    if sync.is_rank_zero():
        try:
            root.mkdir(parents=True, exist_ok=True)
            k = _next_version(root)
            while True:
                try:
                    (root / f"version_{k}").mkdir()
                    break
                except FileExistsError:  # another run claimed it first
                    k += 1
            outcome = ("ok", str(root / f"version_{k}"))
        except OSError as e:
            outcome = ("error", f"the default run folder cannot be made under {root.resolve()} "
                                f"({describe_os_error(e)}); pass --out with a folder you can write to")
    kind, value = sync.broadcast_object(outcome)
    if kind == "error":
        raise CLIError(value)
    return Path(value)


def release_if_empty(folder: Optional[Path]) -> None:
    """A claimed folder that a refused run left empty goes again (rank 0)."""
    if folder is not None and sync.is_rank_zero():
        with contextlib.suppress(OSError):
            folder.rmdir()
