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
from .atomic import describe_os_error
from .rank0 import rank0_decides

__all__ = ["RUNS", "claim_run_folder", "release_if_empty"]

RUNS = Path("runs")
_VERSION = re.compile(r"version_(\d+)$")


def _next_version(root: Path) -> int:
    taken = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION.match(p.name))] if root.is_dir() else []
    return max(taken, default=-1) + 1


def claim_run_folder(root: Path = RUNS) -> Path:
    """Create and return ``root/version_K`` (rank 0; every rank gets the same path)."""
    def claim() -> Path:
        try:
            root.mkdir(parents=True, exist_ok=True)
            k = _next_version(root)
            while True:
                try:
                    (root / f"version_{k}").mkdir()
                    return root / f"version_{k}"
                except FileExistsError:  # another run claimed it first
                    k += 1
        except OSError as e:
            raise CLIError(f"the default run folder cannot be made under {root.resolve()} "
                           f"({describe_os_error(e)}); pass --out with a folder you can write to") from None

    return rank0_decides(claim)


def release_if_empty(folder: Optional[Path]) -> None:
    """A claimed folder that a refused run left empty goes again (rank 0)."""
    if folder is not None and sync.is_rank_zero():
        with contextlib.suppress(OSError):
            folder.rmdir()
