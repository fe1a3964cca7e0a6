"""The one atomic write of the command line: a temporary file beside the target, fsync, rename.

Every file a run writes whole (``last.pt``, a sharded checkpoint's ``gradaccum.pt``, ``summary.json``,
``compare.json``, the rewritten ``metrics.jsonl``, the plots) goes through :func:`write_atomic`, so
a reader, a Ctrl-C or a ``kill -9`` sees the old file or the new one, never half of one. A write
that fails leaves the target untouched and no temporary file behind, and raises the system's
OSError (``File too large``, ``No space left on device``) even where the writer (``torch.save``)
wraps it in an exception of its own. A temporary file a killed process left is never read: it is
hidden (``.last.pt.tmp-<pid>``) and the next run in the folder removes it.

A sharded checkpoint is a folder, which no single rename replaces:
:mod:`gradaccum.cli.sharding` swaps it in with two renames, each made durable here
(:func:`fsync_dir`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

__all__ = ["describe_os_error", "fsync_dir", "is_temp_for", "temp_name", "write_atomic", "write_text_atomic"]


def temp_name(path: Path) -> Path:
    """Where :func:`write_atomic` writes before the rename: hidden, beside ``path``, per process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def is_temp_for(name: str, target: str) -> bool:
    """Is ``name`` a temporary file (or folder) of an atomic write of ``target``, by any process?"""
    return name.startswith(f".{target}.tmp-")


def describe_os_error(error: BaseException) -> str:
    """``File too large`` / ``No space left on device``: the system's words, no class name."""
    if isinstance(error, OSError) and error.errno is not None:
        return os.strerror(error.errno)
    return "the write failed"


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable: after a crash the folder lists the new name."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _RecordingWriter:
    """The temporary file as the writer sees it, keeping the OSError of a failed write: torch.save
    turns it into its own RuntimeError, whose text names neither the cause nor the fix."""

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

    def __getattr__(self, name: str) -> Any:  # tell, seek, fileno: what a writer may ask a file
        return getattr(self.f, name)


def write_atomic(path: Path, write: Callable[[Any], Any]) -> None:
    """``write(f)`` fills a binary file that becomes ``path`` whole, or not at all.

    The file is flushed and fsynced before the rename, and the folder after it. On any failure
    (an exception in ``write``, a full disk, a signal's exception) the temporary file is removed,
    ``path`` is as it was, and the error raised is the OSError underneath where there is one."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            writer = _RecordingWriter(f)
            try:
                write(writer)
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


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` (UTF-8) as the whole of ``path``: :func:`write_atomic`."""
    write_atomic(path, lambda f: f.write(text.encode()))
