"""The run folder (``--out``) before and after training: may this run write here, fresh or resumed?

``check_out`` refuses, in one line, an empty ``--out``, a path that is a file or lies under one, and
a folder on a read-only filesystem or without write permission. :meth:`RunFolder.decide` then
decides from the folder and the flags, still without writing (see :mod:`gradaccum.cli.lifecycle`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .. import sync
from .errors import CLIError
from .checkpoint import describe_os_error, is_temp_for, load_checkpoint, temp_name
from .config import TrainConfig
from .jsonfile import strict_json

__all__ = ["ARTIFACTS", "BASELINE", "CHECKPOINT", "SHARDED_CHECKPOINT", "EVENTS_PREFIX", "Position", "ResumePlan",
           "RunFolder", "check_out"]

CHECKPOINT = "last.pt"
SHARDED_CHECKPOINT = "last.dcp"  # a folder: --shard's torch.distributed.checkpoint
#: the files one run writes into its folder; --overwrite removes these and nothing else
ARTIFACTS = (CHECKPOINT, SHARDED_CHECKPOINT, "metrics.jsonl", "metrics.csv", "summary.json", "loss.png",
             "compare.json", "compare.png", f".{SHARDED_CHECKPOINT}.old")
#: TensorBoard's event files (one per writer: a resumed run rewrites its history into a new one)
EVENTS_PREFIX = "events.out.tfevents."
#: --compare's one-batch run: a run folder of its own inside this one
BASELINE = "baseline"


@dataclass(frozen=True)
class Position:
    """Where a run stands: the next window to run is ``window`` of ``epoch``; ``step`` steps are taken."""

    epoch: int
    window: int
    step: int

    def __str__(self) -> str:
        return f"step {self.step} (epoch {self.epoch}, window {self.window})"


@dataclass(frozen=True)
class ResumePlan:
    """What the folder and the flags decide before anything is written.

    ``kind``: ``"fresh"``, ``"resume"`` or ``"complete"``; ``position``: where training starts;
    ``remove``: the artifacts to remove first; ``note``: a line to print, if any; ``config``: the
    settings to train with (on ``--resume`` without ``--batch-size`` or ``--accum-steps``, the
    checkpoint's global batch)."""

    kind: str
    position: Position
    remove: List[str]
    note: Optional[str] = None
    has_summary: bool = False
    config: Optional[TrainConfig] = None


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
    """What one run may do in its folder: decide fresh / resume / complete, prepare the folder, and
    read and write its files (rank 0 decides; see :class:`~gradaccum.cli.lifecycle.RunLifecycle`).

    Args:
        out: the run folder (already through :func:`check_out`).
        resume, overwrite: the flags.
        sharded: the checkpoint is ``last.dcp``, a folder (``--shard``).
        say: prints one line (rank 0).
    """

    def __init__(self, out: Path, *, resume: bool, overwrite: bool, sharded: bool, say: Any) -> None:
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

    def _exists(self) -> bool:
        if self.sharded:
            from .sharding import sharded_folder

            return sharded_folder(self.checkpoint) is not None
        return self.checkpoint.exists()

    def _read(self) -> Dict[str, Any]:
        """The checkpoint (a sharded one: its gradaccum.pt; the shards load into the model later)."""
        if self.sharded:
            from .sharding import META, META_KEYS, sharded_folder

            folder = sharded_folder(self.checkpoint) or self.checkpoint
            return load_checkpoint(folder / META, required=META_KEYS)
        return load_checkpoint(self.checkpoint)

    def decide(self, cfg: TrainConfig) -> Tuple[ResumePlan, Optional[Dict[str, Any]]]:
        start = Position(0, 0, 0)
        artifacts = _artifacts_in(self.out)
        if self.overwrite:
            return ResumePlan("fresh", start, artifacts), None
        if not self.resume:
            runs = [a for a in artifacts if not any(is_temp_for(a, x) for x in ARTIFACTS)]
            if runs:
                restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
                if restart:
                    raise CLIError(f"torchrun restarted the workers (restart {restart}), but this command has no "
                                   f"--resume, so it cannot continue the run in --out {self.out}; add --resume to "
                                   "the torchrun command (with no checkpoint yet it starts fresh)")
                raise CLIError(f"--out {self.out} holds another run ({', '.join(runs)}); pass --resume to "
                               "continue it, --overwrite to replace it, or another --out")
            return ResumePlan("fresh", start, artifacts), None
        other = self.out / (CHECKPOINT if self.sharded else SHARDED_CHECKPOINT)
        if not self._exists() and other.exists():
            raise CLIError(f"--resume: {self.out} holds {other.name}, a {'non-' if self.sharded else ''}sharded "
                           f"run's checkpoint; resume it {'without' if self.sharded else 'with'} --shard")
        if not self._exists():
            return ResumePlan("fresh", start, artifacts,
                        note=f"--resume: nothing to resume in {self.out} (no {self.checkpoint.name}); "
                             "starting from step 0"), None
        state = self._read()
        try:
            saved = TrainConfig(**state["config"])
        except (TypeError, ValueError):
            raise CLIError(f"--resume: {self.checkpoint} holds settings this version cannot read; resume with "
                           "the gradaccum that wrote it, or pass another --out") from None
        if cfg.batch_size is None and cfg.accum_steps is None and cfg.window_items != saved.window_items:
            cfg = replace(cfg, batch_size=saved.window_items)  # the flags given say nothing about B: keep it
        mine, theirs = cfg.training_settings(), saved.training_settings()
        changed = [k for k in theirs if mine.get(k) != theirs[k]]
        if changed:
            was = ", ".join(f"--{k.replace('_', '-')} {theirs[k]} (now {mine.get(k)})" for k in changed)
            drop = (" and drop --accum-steps (it fixes B = M x N x ranks)" if cfg.accum_steps is not None
                    else "")
            hint = (f"; --batch-size is the global batch: on another number of ranks pass --batch-size "
                    f"{theirs['batch_size']}{drop}" if "batch_size" in changed else "")
            raise CLIError(f"--resume: {self.checkpoint} was written with other settings: {was}{hint}; resume "
                           "with the same settings (only --epochs may grow; the ranks and the micro-batch size "
                           "may change), or pass another --out")
        at = Position(int(state["epoch"]), int(state["window"]), int(state["accumulator"]["steps"]))
        epochs = int(cfg.epochs)  # type: ignore[arg-type]
        if (epochs, 0) < (at.epoch, at.window):
            done = (count(at.epoch, "epoch") + (f" and {count(at.window, 'window')}" if at.window else "")
                    + f", {count(at.step, 'step')}")
            raise CLIError(f"--resume --epochs {epochs}: {self.checkpoint} already holds {done}; pass "
                           f"--epochs {at.epoch + (1 if at.window else 0)} or more, or another --out")
        stray = [a for a in artifacts if any(is_temp_for(a, x) for x in ARTIFACTS)]  # never read: removed
        has_summary = (self.out / "summary.json").exists()
        if (epochs, 0) == (at.epoch, at.window):
            note = (f"{self.out} is complete: {count(epochs, 'epoch')}, {count(at.step, 'step')}; nothing to train"
                    + ("; summary.json left as it was" if has_summary else "; writing its missing summary.json"))
            return ResumePlan("complete", at, stray, note=note, has_summary=has_summary, config=cfg), state
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        why = f"torchrun restart {restart}: " if restart else "--resume: "
        return ResumePlan("resume", at, stray, has_summary=has_summary, config=cfg,
                    note=f"{why}continuing {self.out} from {at} of {self.checkpoint.name}"), state

    def prepare(self, plan: ResumePlan) -> None:
        """Create the folder, prove it takes a write, then remove what the plan says (rank 0; every
        rank waits). Nothing is removed if the folder cannot be written; a folder made here goes again."""
        error = None
        if self.rank0:
            try:
                self._make_writable_folder()
            except CLIError as e:
                error = str(e)
            else:
                _remove_artifacts(self.out, plan.remove)
                if plan.note:
                    self.say(plan.note)
        error = sync.broadcast_object(error)
        if error is not None:
            raise CLIError(error)

    def _make_writable_folder(self) -> None:
        made: List[Path] = []
        folder = Path(os.path.abspath(self.out))
        while not folder.exists():
            made.append(folder)
            folder = folder.parent
        probe = self.out / f".write-probe-{os.getpid()}"
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"gradaccum")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as e:
            with contextlib.suppress(OSError):
                probe.unlink()
            for folder in made:  # deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise CLIError(f"--out {self.out} cannot be written ({describe_os_error(e)}); pass a folder "
                           "you can write to with --out") from None

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
        return [r for r in rows if isinstance(r, dict) and "epoch" in r and _before(r, at)]

    def write_json(self, name: str, obj: Dict[str, Any]) -> Optional[str]:
        """``name`` in the folder, atomically, as strict JSON (rank 0); returns why it failed, or None."""
        if not self.rank0:
            return None
        path = self.out / name
        tmp = temp_name(path)
        try:
            tmp.write_text(strict_json(obj, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return describe_os_error(e)
        return None



def count(n: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _before(row: Dict[str, Any], at: Position) -> bool:
    if row.get("kind") == "eval":
        return (row["epoch"] + 1, 0) <= (at.epoch, at.window)
    return "window" in row and (row["epoch"], row["window"]) < (at.epoch, at.window)
