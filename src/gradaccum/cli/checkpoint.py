"""Checkpoint files: written atomically with a checksum, refused and left in place when corrupt.

What a checkpoint holds and when it is written is decided in :mod:`gradaccum.cli.lifecycle`; this module
only reads and writes one file.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any, Dict

import torch

from .atomic import write_atomic
from .checksum import CHECKSUM_KEY, contents_damaged, records_damaged, with_checksum
from .errors import CLIError

__all__ = ["save_atomic", "load_checkpoint", "corrupt", "REQUIRED_KEYS", "EVAL_FIX", "TRAIN_FIX"]

REQUIRED_KEYS = ("model", "optimizer", "accumulator", "config", "epoch", "window")
#: what a user can do about a damaged checkpoint, per command
TRAIN_FIX = "restore a good copy, or start over with --overwrite (which removes it)"
EVAL_FIX = "restore a good copy, or evaluate another checkpoint"


def save_atomic(obj: Dict[str, Any], path: Path) -> None:
    """Write ``obj`` to ``path`` so that a reader (or a kill -9) sees the old file or the new, never half
    (:func:`~gradaccum.cli.atomic.write_atomic`), with the checksum of its contents
    (:mod:`gradaccum.cli.checksum`).

    On failure the temporary file is removed, ``path`` is untouched, and the error is an OSError with
    the system's reason (``File too large``, ``No space left on device``) where there is one.
    """
    obj = with_checksum(obj)
    write_atomic(path, lambda f: torch.save(obj, f))


def _is_zip(path: Path) -> bool:
    try:
        return zipfile.is_zipfile(path)
    except Exception:  # noqa: BLE001 - zipfile raises BadZipFile on some damaged end records
        return False


def corrupt(path: Path, reason: str, fix: str = TRAIN_FIX) -> CLIError:
    """The one line for a damaged checkpoint: what is wrong, that it was left in place, the fix."""
    return CLIError(f"checkpoint {path} is corrupt or unreadable ({reason}); it was left in place: {fix}")


def load_checkpoint(path: Path, required: Any = REQUIRED_KEYS, *, fix: str = TRAIN_FIX) -> Dict[str, Any]:
    """Load a gradaccum checkpoint with ``weights_only=True``; a bad file is refused, never touched.

    The reason is in our words: torch's own text is long, may carry ANSI escapes, and cut to one
    line it stops mid-word. ``fix``: what the refusal tells the user to do."""
    if not path.is_file():
        raise CLIError(f"checkpoint {path} does not exist; train first, or give the path of a last.pt")
    reason = None
    if not _is_zip(path):
        reason = "not a torch.save archive: empty, truncated or another format"
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            reason = "it holds objects that torch.load(weights_only=True) does not load"
        except Exception:  # noqa: BLE001 - any unreadable file gets the same answer
            reason = "a torch.save archive that torch.load cannot read (damaged, or from a newer torch)"
    if reason is None:  # what was loaded is what was saved: the checksum, or (older files) the records' CRCs
        if isinstance(state, dict) and CHECKSUM_KEY in state:
            reason = contents_damaged(state)
        else:
            reason = records_damaged(path)
    if reason is not None:
        raise corrupt(path, reason, fix)
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise CLIError(f"checkpoint {path} is not a gradaccum checkpoint (missing {', '.join(missing)}); "
                       "it was left in place")
    return state
