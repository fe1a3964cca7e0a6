"""Checkpoints: written atomically (temporary file, fsync, rename), refused and left in place when corrupt."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

import torch

__all__ = ["CLIError", "save_atomic", "load_checkpoint", "REQUIRED_KEYS"]

REQUIRED_KEYS = ("model", "optimizer", "accumulator", "config", "epoch", "window")


class CLIError(Exception):
    """A user-facing problem: the command line prints it as one line and exits non-zero."""


def save_atomic(obj: Dict[str, Any], path: Path) -> None:
    """Write ``obj`` to ``path`` so that a reader (or a kill -9) sees the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Load a gradaccum checkpoint with ``weights_only=True``; a bad file is refused, never touched."""
    if not path.is_file():
        raise CLIError(f"checkpoint {path} does not exist; train first, or give the path of a last.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same answer
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise CLIError(f"checkpoint {path} is corrupt or unreadable ({reason}); it was left in place: "
                       "move it away to start over, or restore a good copy") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CLIError(f"checkpoint {path} is not a gradaccum checkpoint (missing {', '.join(missing)}); "
                       "it was left in place")
    return state
