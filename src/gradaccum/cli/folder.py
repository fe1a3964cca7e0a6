"""The run folder (``--out``): the one object that reads and writes it, :class:`RunFolder`.

``check_out`` refuses, in one line, an empty ``--out``, a path that is a file or lies under one, and
a folder on a read-only filesystem or without write permission. :class:`RunFolder` then takes the
folder's lock (one run at a time: :class:`~gradaccum.cli.lock.FolderLock`), decides from the folder and the flags, still
without writing (:meth:`RunFolder.decide`), prepares it, and writes and reads every file of the run:
the checkpoint, the metrics files, ``summary.json``, ``compare.json``, the plots. When each is
written is :mod:`gradaccum.cli.lifecycle`'s and :mod:`gradaccum.cli.run`'s decision.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import sync
from .atomic import describe_os_error, is_temp_for, temp_name, write_text_atomic
from .checkpoint import load_checkpoint, save_atomic
from .config import TrainConfig
from .decision import Found, Position, ResumePlan, count, decide_run
from .errors import CLIError
from .jsonfile import strict_json
from .lock import LOCK, FolderClaim, FolderLock
from .rank0 import rank0_decides
from .tracking import EVENTS_PREFIX, MetricsLog

__all__ = ["ARTIFACTS", "BASELINE", "CHECKPOINT", "SHARDED_CHECKPOINT", "LOCK", "FolderLock", "Position",
           "ResumePlan", "RunFolder", "check_out", "count"]

CHECKPOINT = "last.pt"
SHARDED_CHECKPOINT = "last.dcp"  # a folder: --shard's torch.distributed.checkpoint
#: the files one run writes into its folder; --overwrite removes these and nothing else
ARTIFACTS = (CHECKPOINT, SHARDED_CHECKPOINT, "metrics.jsonl", "metrics.csv", "summary.json", "loss.png",
             "compare.json", "compare.png", f".{SHARDED_CHECKPOINT}.old")
#: --compare's one-batch run: a run folder of its own inside this one
BASELINE = "baseline"


def check_out(text: str, flag: str = "--out") -> Path:
    """``--out`` as a folder this process may create and write, or a one-line CLIError; writes nothing."""
    if not text.strip():
        raise CLIError(f"{flag} is an empty string; pass the folder for the run's files, e.g. {flag} runs/digits")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise CLIError(f"{flag} {text} is a file, not a folder; pass a folder, e.g. {flag} {text}.run, "
                       "or move the file away")
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CLIError(f"{flag} {text}: {existing} is a file, so no folder can be made under it; "
                       f"pass another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        if _read_only(existing):
            raise CLIError(f"{flag} {text} is on a read-only filesystem ({existing}); pass a folder on a "
                           f"writable one with {flag}")
        raise CLIError(f"{flag} {text}: {existing} is not writable (permission denied); pass a folder you "
                       f"can write to with {flag}")
    return path


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _artifacts_in(folder: Path) -> List[str]:
    """This folder's run artifacts, sorted (never listing order), temporary files of writes included."""
    if not folder.is_dir():
        return []
    found = [name for name in ARTIFACTS if (folder / name).exists()]
    found += sorted(p.name for p in folder.iterdir() if p.name.startswith(EVENTS_PREFIX))
    if (folder / BASELINE).is_dir():
        found.append(BASELINE)
    found += sorted(p.name for p in folder.iterdir() if any(is_temp_for(p.name, a) for a in ARTIFACTS))
    return found


def _remove_artifacts(folder: Path, names: List[str]) -> None:
    for name in names:
        path = folder / name
        if name == BASELINE:  # the baseline's own artifacts, then the folder if nothing else is left
            _remove_artifacts(path, _artifacts_in(path))
            with contextlib.suppress(OSError):
                path.rmdir()
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # a checkpoint may become a directory (torch.distributed.checkpoint)
        elif path.exists() or path.is_symlink():
            path.unlink()


class RunFolder:
    """The one object that reads and writes a run's folder (``--out``): its lock, the decision
    fresh / resume / complete, preparing it, the checkpoint, the metrics files, ``summary.json``,
    ``compare.json``, the plots and ``--compare``'s ``baseline/``. Nothing else opens a path in it.

    Rank 0 alone inspects, reads and writes it and tells the other ranks what it found; a sharded
    checkpoint is the exception, written and read by every rank. Use it as a context manager:
    entering makes the folder if needed and takes its :class:`~gradaccum.cli.lock.FolderLock` (a folder another run
    holds is refused in one line that names the process); leaving releases the lock and removes
    the folder again if this run made it and left it empty (a run refused before writing).

    Args:
        out: the run folder (already through :func:`check_out`).
        resume, overwrite: the flags.
        sharded: the checkpoint is ``last.dcp``, a folder (``--shard``).
        say: prints one line (rank 0).
    """

    def __init__(self, out: Path, *, resume: bool, overwrite: bool, sharded: bool,
                 say: Callable[[str], None]) -> None:
        if resume and overwrite:
            raise CLIError("--resume and --overwrite contradict each other: --resume continues the run in "
                           "--out, --overwrite deletes it; pass one of them")
        self.out = out
        self.resume = resume
        self.overwrite = overwrite
        self.sharded = sharded
        self.checkpoint = out / (SHARDED_CHECKPOINT if sharded else CHECKPOINT)
        self.say = say
        self.rank0 = sync.is_rank_zero()
        self._claim = FolderClaim(out)  # the folder made if needed, and its lock
        self._write: Callable[[Dict[str, Any], Path], None] = save_atomic

    # -- the lock ---------------------------------------------------------------------------------

    def __enter__(self) -> "RunFolder":
        try:
            rank0_decides(self._claim.take)
        except CLIError:
            self._claim.unmake()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._claim.release()

    # -- the decision -----------------------------------------------------------------------------

    def _exists(self) -> bool:
        if self.sharded:
            from .sharding import sharded_folder

            return sharded_folder(self.checkpoint) is not None
        return self.checkpoint.exists()

    def _read(self) -> Dict[str, Any]:
        """The checkpoint (a sharded one: its gradaccum.pt, after its shards' checksums are
        compared; the shards load into the model later)."""
        if self.sharded:
            from .sharding import read_sharded_meta

            return read_sharded_meta(self.checkpoint)
        return load_checkpoint(self.checkpoint)

    def decide(self, cfg: TrainConfig, *, restart_count: int = 0) -> Tuple[ResumePlan, Optional[Dict[str, Any]]]:
        """Fresh, resume or complete, from the folder and the flags (:func:`.decision.decide_run`), and
        the checkpoint read on ``--resume``; writes nothing (rank 0). ``restart_count``: how often
        torchrun restarted the workers (see :mod:`.launch`)."""
        artifacts, has = _artifacts_in(self.out), self._exists()
        other = self.out / (CHECKPOINT if self.sharded else SHARDED_CHECKPOINT)
        found = Found(out=self.out, checkpoint=self.checkpoint, sharded=self.sharded, artifacts=artifacts,
                      stray=[a for a in artifacts if any(is_temp_for(a, x) for x in ARTIFACTS)],  # never read
                      has_checkpoint=has, has_summary=(self.out / "summary.json").exists(),
                      other_checkpoint=other.name if not has and other.exists() else None,
                      state=self._read() if has and self.resume and not self.overwrite else None)
        plan = decide_run(found, cfg, resume=self.resume, overwrite=self.overwrite, restart_count=restart_count)
        return plan, (found.state if plan.kind != "fresh" else None)

    def prepare(self, plan: ResumePlan) -> None:
        """Prove the folder takes a write, then remove what the plan says (rank 0; every rank
        waits). Nothing is removed if the folder cannot be written."""
        rank0_decides(lambda: self._prepare(plan))

    def _prepare(self, plan: ResumePlan) -> None:
        probe = self.out / f".write-probe-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"gradaccum")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as e:
            with contextlib.suppress(OSError):
                probe.unlink()
            raise CLIError(f"--out {self.out} cannot be written ({describe_os_error(e)}); pass a folder you can "
                           "write to with --out") from None
        _remove_artifacts(self.out, plan.remove)
        if plan.note:
            self.say(plan.note)

    # -- the checkpoint ---------------------------------------------------------------------------

    def use_writer(self, write: Callable[[Dict[str, Any], Path], None]) -> None:
        """Write checkpoints with ``write(obj, path)`` (a sharded checkpoint's, once the model exists)."""
        self._write = write

    def write_checkpoint(self, state: Dict[str, Any]) -> None:
        """The checkpoint, atomically (rank 0 for a file, every rank for a sharded one); an OSError
        when it cannot be written, the previous checkpoint then whole."""
        self._write(state, self.checkpoint)

    def abandon_checkpoint_write(self) -> bool:
        """For a process leaving at once (a second signal): remove its temporary checkpoint file, a
        write in progress, and say whether a whole checkpoint is there. A sharded write's temporary
        folder is never read; the next run in the folder removes it."""
        if not self.sharded:
            with contextlib.suppress(OSError):
                temp_name(self.checkpoint).unlink()
        return self._exists()

    def kept_history(self, at: Position) -> List[Dict[str, Any]]:
        """The metrics rows of the windows before the checkpoint's position (a killed run may have
        written more): training rows by (epoch, window), not step (a skipped window repeats its step
        number); an epoch's evaluation row when that epoch is done."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line torn by kill -9 (or blank): the checkpoint is the truth
                continue
        return [r for r in rows if isinstance(r, dict) and "epoch" in r and at.follows(r)]

    def write_json(self, name: str, obj: Dict[str, Any]) -> Optional[str]:
        """``name`` in the folder, atomically, as strict JSON (rank 0); returns why it failed, or None."""
        if not self.rank0:
            return None
        try:
            write_text_atomic(self.out / name, strict_json(obj, indent=2) + "\n")
        except OSError as e:
            return describe_os_error(e)
        return None

    def read_json(self, name: str) -> Dict[str, Any]:
        """``name`` as rank 0 reads it, on every rank (another node's copy may be missing or stale)."""
        return rank0_decides(lambda: json.loads((self.out / name).read_text()))

    def has(self, name: str) -> bool:
        """Does the folder hold ``name`` (``compare.json``, ``loss.png``)? Rank 0's answer, on every rank."""
        return rank0_decides((self.out / name).exists)

    def metrics_log(self, history: List[Dict[str, Any]]) -> MetricsLog:
        """The metrics files, rewritten from ``history`` (the rows kept) and appended to (rank 0)."""
        return MetricsLog(self.out, history, enabled=self.rank0)

    def draw(self, name: str, plot: Callable[[Path], None]) -> None:
        """``plot(path)`` draws ``name`` in the folder (rank 0; written whole or not at all)."""
        if self.rank0:
            plot(self.out / name)

    def baseline(self, *, resume: bool) -> "RunFolder":
        """``--compare``'s one-batch run: a run folder of its own, ``baseline/``, resumed with this one
        when it has a checkpoint, else started over."""
        base = self.out / BASELINE
        resume = resume and rank0_decides((base / CHECKPOINT).exists)
        return RunFolder(base, resume=resume, overwrite=not resume, sharded=False, say=self.say)
