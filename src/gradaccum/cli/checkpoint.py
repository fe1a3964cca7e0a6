"""Checkpoint files: written atomically (temporary file, fsync, rename), refused and left in place when corrupt.

What a checkpoint holds and when it is written is decided in :mod:`gradaccum.cli.lifecycle`; this module
only reads and writes one file.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Dict, Optional

import torch

from .errors import CLIError

__all__ = ["save_atomic", "load_checkpoint", "corrupt", "digest", "CHECKSUM_KEY", "temp_name", "is_temp_for",
           "describe_os_error", "fsync_dir", "REQUIRED_KEYS", "EVAL_FIX", "TRAIN_FIX"]

REQUIRED_KEYS = ("model", "optimizer", "accumulator", "config", "epoch", "window")
#: what a user can do about a damaged checkpoint, per command
TRAIN_FIX = "restore a good copy, or start over with --overwrite (which removes it)"
EVAL_FIX = "restore a good copy, or evaluate another checkpoint"
#: the key under which a checkpoint holds the :func:`digest` of its other contents
CHECKSUM_KEY = "checksum"


def temp_name(path: Path) -> Path:
    """Where :func:`save_atomic` writes before the rename: hidden, beside ``path``, per process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def is_temp_for(name: str, target: str) -> bool:
    """Is ``name`` a temporary file of :func:`save_atomic` for ``target`` (of any process)?"""
    return name.startswith(f".{target}.tmp-")


def describe_os_error(error: BaseException) -> str:
    """``File too large`` / ``No space left on device``: the system's words, no class name."""
    if isinstance(error, OSError) and error.errno is not None:
        return os.strerror(error.errno)
    return "the write failed"


class _RecordingWriter:
    """A file wrapper that keeps the OSError of a failed write: torch.save turns it into its own
    RuntimeError text, which names neither the cause nor the fix."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def digest(obj: Any) -> str:
    """SHA-256 of a checkpoint's contents as ``torch.load`` returns them: every key, value and tensor
    (dtype, shape, bytes), in order. Saved beside them (:data:`CHECKSUM_KEY`) and compared after
    loading, it covers what the archive's own CRCs cannot: a damaged zip directory can make torch's
    reader take a record's bytes from elsewhere while every record still matches its CRC."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"{{{len(obj)}".encode())
        for key, value in obj.items():
            h.update(repr(key).encode())
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}[{len(obj)}".encode())
        for value in obj:
            _feed(h, value)
    else:
        h.update(f"{type(obj).__name__}:{obj!r}".encode())


def save_atomic(obj: Dict[str, Any], path: Path) -> None:
    """Write ``obj`` to ``path`` so that a reader (or a kill -9) sees the old file or the new, never half,
    with the :func:`digest` of its contents under :data:`CHECKSUM_KEY`.

    On failure the temporary file is removed, ``path`` is untouched, and the error is an OSError with
    the system's reason (``File too large``, ``No space left on device``) where there is one.
    """
    obj = {**obj, CHECKSUM_KEY: digest(obj)}
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            writer = _RecordingWriter(f)
            try:
                torch.save(obj, writer)  # type: ignore[arg-type]
                f.flush()
            except Exception as e:  # noqa: BLE001 - torch's RuntimeError hides the OSError below it
                if writer.error is not None and writer.error is not e:
                    raise writer.error from None
                raise
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable: after a crash the folder lists the new name."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _damaged_record(path: Path) -> Optional[str]:
    """Why the archive is damaged, or None (for files without a :func:`digest`): torch.save stores a
    CRC-32 of every record, which torch.load never reads, so flipped bytes inside a tensor would load
    as other weights. A record
    whose stored CRC is 0 is not checked: torch writes 0 when told not to compute them
    (``torch.utils.serialization.config.save.compute_crc32 = False``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                with archive.open(info) as record:  # reading to the end compares the CRC
                    try:
                        while record.read(1 << 24):
                            pass
                    except zipfile.BadZipFile:
                        return (f"the bytes of its record {info.filename} do not match their stored checksum: "
                                "damaged on disk or in transfer")
    except Exception:  # noqa: BLE001 - a damaged header raises anything from BadZipFile to UnicodeDecodeError
        return "a damaged torch.save archive"
    return None


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
            if state.pop(CHECKSUM_KEY) != digest(state):
                reason = "what it holds does not match the checksum written with it: damaged on disk or in transfer"
        else:
            reason = _damaged_record(path)
    if reason is not None:
        raise corrupt(path, reason, fix)
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise CLIError(f"checkpoint {path} is not a gradaccum checkpoint (missing {', '.join(missing)}); "
                       "it was left in place")
    return state
