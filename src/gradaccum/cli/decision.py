"""Fresh, resume or complete: the decision from what the run folder holds and the flags.

:class:`~gradaccum.cli.folder.RunFolder` reads the folder (rank 0) into a :class:`Found`;
:func:`decide_run` turns that and the flags into a :class:`ResumePlan` or a one-line CLIError. Nothing
here opens a path: when the folder is read and written stays the folder's, when the plan is carried
out :mod:`gradaccum.cli.run`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

from .config import TrainConfig, saved_config
from .errors import CLIError

__all__ = ["Position", "ResumePlan", "Found", "decide_run", "count"]


@dataclass(frozen=True)
class Position:
    """Where a run stands: the next window to run is ``window`` of ``epoch``; ``step`` steps are taken."""

    epoch: int
    window: int
    step: int

    def __str__(self) -> str:
        return f"step {self.step} (epoch {self.epoch}, window {self.window})"

    def follows(self, row: Dict[str, Any]) -> bool:
        """Whether the metrics ``row`` was written before this position: a training row by (epoch,
        window), not step (a skipped window repeats its step number); an epoch's evaluation row when
        that epoch is done."""
        if row.get("kind") == "eval":
            return (row["epoch"] + 1, 0) <= (self.epoch, self.window)
        return "window" in row and (row["epoch"], row["window"]) < (self.epoch, self.window)


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


@dataclass(frozen=True)
class Found:
    """What the run folder holds, as :class:`~gradaccum.cli.folder.RunFolder` read it (rank 0).

    ``artifacts``: the run's files in it, sorted, temporary files of writes included; ``stray``: those
    temporary files (never read); ``checkpoint``: this run's checkpoint path (``last.pt``, or
    ``last.dcp`` under ``sharded``) and ``has_checkpoint`` whether it is there; ``other_checkpoint``:
    the other kind's checkpoint, when only that one is there; ``state``: the checkpoint, read (only
    with ``--resume``); ``has_summary``: whether ``summary.json`` is there."""

    out: Path
    checkpoint: Path
    sharded: bool
    artifacts: List[str]
    stray: List[str]
    has_checkpoint: bool
    has_summary: bool
    other_checkpoint: Optional[str] = None
    state: Optional[Dict[str, Any]] = None


def decide_run(found: Found, cfg: TrainConfig, *, resume: bool, overwrite: bool,
               restart_count: int = 0) -> ResumePlan:
    """Fresh, resume or complete (``restart_count``: how often torchrun restarted the workers, see
    :mod:`.launch`); a one-line CLIError where the folder holds another run and the flags say neither
    ``--resume`` nor ``--overwrite``, or the checkpoint cannot be resumed with these flags."""
    start, out, checkpoint = Position(0, 0, 0), found.out, found.checkpoint
    if overwrite:
        return ResumePlan("fresh", start, found.artifacts)
    if not resume:
        runs = [a for a in found.artifacts if a not in found.stray]
        if runs:
            if restart_count:
                raise CLIError(f"torchrun restarted the workers (restart {restart_count}), but this command has "
                               f"no --resume, so it cannot continue the run in --out {out}; add --resume to "
                               "the torchrun command (with no checkpoint yet it starts fresh)")
            raise CLIError(f"--out {out} holds another run ({', '.join(runs)}); pass --resume to "
                           "continue it, --overwrite to replace it, or another --out")
        return ResumePlan("fresh", start, found.artifacts)
    if not found.has_checkpoint and found.other_checkpoint is not None:
        raise CLIError(f"--resume: {out} holds {found.other_checkpoint}, a {'non-' if found.sharded else ''}sharded "
                       f"run's checkpoint; resume it {'without' if found.sharded else 'with'} --shard")
    if not found.has_checkpoint or found.state is None:
        return ResumePlan("fresh", start, found.artifacts,
                          note=f"--resume: nothing to resume in {out} (no {checkpoint.name}); starting from step 0")
    state = found.state
    cfg = _same_settings(checkpoint, cfg, state)
    at = Position(int(state["epoch"]), int(state["window"]), int(state["accumulator"]["steps"]))
    epochs = int(cfg.epochs)  # type: ignore[arg-type]
    if (epochs, 0) < (at.epoch, at.window):
        done = (count(at.epoch, "epoch") + (f" and {count(at.window, 'window')}" if at.window else "")
                + f", {count(at.step, 'step')}")
        raise CLIError(f"--resume --epochs {epochs}: {checkpoint} already holds {done}; pass "
                       f"--epochs {at.epoch + (1 if at.window else 0)} or more, or another --out")
    if (epochs, 0) == (at.epoch, at.window):
        note = (f"{out} is complete: {count(epochs, 'epoch')}, {count(at.step, 'step')}; nothing to train"
                + ("; summary.json left as it was" if found.has_summary else "; writing its missing summary.json"))
        return ResumePlan("complete", at, found.stray, note=note, has_summary=found.has_summary, config=cfg)
    why = f"torchrun restart {restart_count}: " if restart_count else "--resume: "
    return ResumePlan("resume", at, found.stray, has_summary=found.has_summary, config=cfg,
                      note=f"{why}continuing {out} from {at} of {checkpoint.name}")


def _same_settings(checkpoint: Path, cfg: TrainConfig, state: Dict[str, Any]) -> TrainConfig:
    """The settings to resume with: the flags', with the checkpoint's global batch and epochs when they say
    nothing about them; a one-line CLIError when they would train another model."""
    saved = saved_config(state, where=f"--resume: {checkpoint}",
                         fix="resume with the gradaccum that wrote it, or pass another --out")
    if cfg.batch_size is None and cfg.accum_steps is None and cfg.window_items != saved.window_items:
        cfg = replace(cfg, batch_size=saved.window_items)  # the flags given say nothing about B: keep it
    if not cfg.epochs_given:  # the task's default is not the run's: keep the run's length
        cfg = replace(cfg, epochs=saved.epochs)
    mine, theirs = cfg.training_settings(), saved.training_settings()
    changed = [k for k in theirs if mine.get(k) != theirs[k]]
    if changed:
        was = ", ".join(_change(k, theirs[k], mine.get(k)) for k in changed)
        drop = " and drop --accum-steps (it fixes B = M x N x ranks)" if cfg.accum_steps is not None else ""
        hint = (f"; --batch-size is the global batch: on another number of ranks pass --batch-size "
                f"{theirs['batch_size']}{drop}" if "batch_size" in changed else "")
        raise CLIError(f"--resume: {checkpoint} was written with other settings: {was}{hint}; resume with the same "
                       "settings (only --epochs may grow; the ranks and the micro-batch size may change), or pass "
                       "another --out")
    return cfg


def _change(key: str, was: Any, now: Any) -> str:
    """A setting that changed, as flags: ``--lr 0.1 (now 0.2)``, ``no --max-grad-norm (now
    --max-grad-norm 1.0)``, ``--shard (now without it)``."""
    flag = f"--{key.replace('_', '-')}"

    def given(value: Any) -> bool:
        return value is not None and value is not False

    then = (f"{flag} {was}" if was is not True else flag) if given(was) else f"no {flag}"
    if not given(now):
        return f"{then} (now without it)"
    if now is True:
        return f"{then} (now with it)"
    return f"{then} (now {now})" if given(was) else f"{then} (now {flag} {now})"


def count(n: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
