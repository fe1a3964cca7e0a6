"""One run at a time in a run folder: :class:`FolderLock` (the ``flock``) and :class:`FolderClaim` (the
folder made if needed, its lock taken, both undone), the parts of
:class:`~gradaccum.cli.folder.RunFolder` that its ``with`` block enters and leaves."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import List, Optional

from .atomic import describe_os_error
from .errors import CLIError

__all__ = ["LOCK", "FolderLock", "FolderClaim"]

#: the folder's lock file (:class:`FolderLock`), not an artifact: while a run holds it, no other starts
LOCK = ".gradaccum.lock"


class FolderLock:
    """One run at a time in a folder: an exclusive ``flock`` on ``.gradaccum.lock`` inside it,
    which holds the PID and host of the process that holds it.

    The kernel drops a ``flock`` when its holder exits, however it exits (``kill -9`` included), so
    a killed run never leaves the folder locked: the file it leaves names a process that no longer
    holds it, and the next run takes it over. Released, the file goes. Not an artifact of the run
    (never listed, never removed by ``--overwrite``). On a network filesystem ``flock`` may lock on
    one machine only: two machines writing one ``--out`` are not stopped there.
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """Hold the lock and return None, or return who holds it (``PID 123 on host``)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 256, 0).decode(errors="replace").split()
                os.close(fd)
                if not holder:  # between the holder's flock and its write
                    return "a process that has not written its PID yet"
                host = holder[1] if len(holder) > 1 else "?"
                return f"PID {holder[0]}" + (" on this machine" if host == socket.gethostname() else f" on {host}")
            try:  # a holder that released it removed the file we opened: lock the one at the path
                opened, there = os.fstat(fd), os.stat(self.path)
                same = (opened.st_dev, opened.st_ino) == (there.st_dev, there.st_ino)
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            self._fd = fd
            return None

    def release(self) -> None:
        """Remove the file, then drop the lock (a run waiting to open it then opens a new one)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


class FolderClaim:
    """A run folder made if needed, with its :class:`FolderLock` held: :meth:`take` (rank 0) makes
    the folders missing on the way to ``out`` and takes the lock, or raises a one-line CLIError that
    names the process holding it; :meth:`release` drops the lock and removes the folders made here if
    they are still empty (a run refused before writing leaves no trace)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lock = FolderLock(out)
        self._made: List[Path] = []  # folders made here, deepest first

    def take(self) -> None:
        """Make the folder and take its lock (rank 0), or a one-line CLIError."""
        try:
            self._make_folder()
            holder = self.lock.acquire()
        except OSError as e:
            raise CLIError(f"--out {self.out} cannot be written ({describe_os_error(e)}); pass a folder you can "
                           "write to with --out") from None
        if holder is not None:
            raise CLIError(f"--out {self.out} is in use by another gradaccum run ({holder}, which holds "
                           f"{self.lock.path}); wait for it to end or stop it, or pass another --out")

    def release(self) -> None:
        self.lock.release()
        self.unmake()

    def unmake(self) -> None:
        """Remove the folders :meth:`take` made, deepest first; a folder with anything in it stays."""
        for folder in self._made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        self._made = []

    def _make_folder(self) -> None:
        folder = Path(os.path.abspath(self.out))
        while not folder.exists():
            self._made.append(folder)
            folder = folder.parent
        self.out.mkdir(parents=True, exist_ok=True)
