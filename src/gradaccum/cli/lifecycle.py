"""The life of one run's folder (``--out``): what may be written there, checkpoints, signals, resuming.

The training loop (:mod:`gradaccum.cli.run`) asks this module; it never touches the folder itself.
The folder's decisions are :mod:`gradaccum.cli.folder`'s, the signal handlers :mod:`gradaccum.cli.signals`'.

Before anything is written
    ``check_out`` refuses, in one line, an empty ``--out``, a path that is a file or lies under one,
    and a folder on a read-only filesystem or without write permission. ``RunLifecycle.plan`` (:meth:`RunFolder.decide <gradaccum.cli.folder.RunFolder.decide>`) then
    decides from the folder and the flags, still without writing:

    * new or empty folder (or one holding only files of no run): a fresh run;
    * another run's files (:data:`ARTIFACTS`) without ``--resume`` or ``--overwrite``: refused, untouched;
    * ``--overwrite``: a fresh run, after removing that run's artifacts (other files stay);
    * ``--resume`` and no checkpoint: one line, and a fresh run (the old artifacts removed);
    * ``--resume`` and a checkpoint: same settings (only ``--epochs`` may grow, never below what is
      done), then training continues at the checkpoint's (epoch, window);
    * ``--resume`` of a finished run: one line that it is complete; ``summary.json`` is left as it was.

Checkpoints
    ``last.pt`` is replaced atomically (:func:`~gradaccum.cli.checkpoint.save_atomic`); with ``--shard``
    it is the folder ``last.dcp`` that every rank writes (:mod:`gradaccum.cli.sharding`): every K steps
    with ``--checkpoint-every K``, at the end, and when stopped by a signal. A write that fails (disk
    full, file too large) keeps the previous checkpoint, says so in one line, and the run goes on:
    ``metrics.jsonl`` is written line by line and ``summary.json`` at the end regardless; a failed
    *final* write makes the command exit 1 after both are written.

Ctrl-C (SIGINT) and SIGTERM
    The first signal is acknowledged at once and lets the current window finish; then an atomic
    checkpoint is written, one line says where it is and the exact command that resumes it, and the
    command exits 130 (SIGINT) or 143 (SIGTERM). A second signal leaves at once (``os._exit``, same
    exit codes), without a new checkpoint: a write in progress is abandoned and its temporary file
    removed, so ``last.pt`` is the previous whole one. The handler never raises (an exception raised
    inside torch's C++ comes out as its RuntimeError), and after a stop both signals stay ignored.
    After ``kill -9`` the last checkpoint is whole too; a temporary file left by a write in progress
    is never read, and the next run in the folder removes it.

Distributed
    Rank 0 alone inspects, reads and writes the folder and broadcasts what it found (the decision,
    the checkpoint itself), so other nodes need no copy of ``--out``; every rank waits at a barrier
    after each write. A sharded checkpoint is written and read by every rank: ``--shard`` needs
    ``--out`` on a filesystem all nodes share. A checkpoint's position is (epoch, window)
    of the global windows, so it resumes on any world size. A signal reaches every rank in the
    window's boundary all-reduce (``StepResult.stop_requested``, see :mod:`gradaccum.cli.signals`),
    so all of them stop at the same window even when only some got the signal. torchrun
    forwards the Ctrl-C it receives to its workers; where a worker also gets the terminal's (a launcher
    that keeps workers in its process group), the same signal again within a second under torchrun is
    that copy, not a second Ctrl-C.

Elastic restarts (``torchrun --max-restarts=K``)
    A restarted worker group runs the same command again: with ``--resume`` it continues from the
    last checkpoint (and with none yet it starts fresh and says so). Without ``--resume`` the folder
    holds this run's files and is refused, with one line that says to add ``--resume`` to the command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import sync
from .errors import CLIError
from .checkpoint import describe_os_error, save_atomic
from .config import TrainConfig
from .folder import (ARTIFACTS, BASELINE, CHECKPOINT, SHARDED_CHECKPOINT, Position, ResumePlan, RunFolder,
                     check_out)
from .signals import EXIT_CODES, StopSignals, Stopped

__all__ = ["ARTIFACTS", "BASELINE", "CHECKPOINT", "SHARDED_CHECKPOINT", "Position", "ResumePlan", "Stopped",
           "WriteFailed", "RunLifecycle", "check_out"]


class WriteFailed(CLIError):
    """Training finished but its final checkpoint could not be written: exit 1, not a usage error."""

    exit_code = 1


class RunLifecycle:
    """One run's folder from the first check to the last write. See the module docstring.

    Args:
        out: the run folder (already through :func:`check_out`).
        resume, overwrite: the flags.
        command: the exact command line that resumes this run (printed when stopped).
        checkpoint_every: K of ``--checkpoint-every`` (0: only at the end and when stopped).
        name: the subcommand, for the lines this prints (``gradaccum train: ...``).
        exit: how a second signal ends the process (``os._exit``: at once, no unwinding through torch).
        sharded: the checkpoint is ``last.dcp``, a folder every rank writes (``--shard``).
        write: how a checkpoint is written, ``write(obj, path)``: rank 0 alone for a file, every rank
            for a sharded one (default: :func:`~gradaccum.cli.checkpoint.save_atomic`).
        device: where the stop flag's all-reduce runs (NCCL needs CUDA tensors).
    """

    def __init__(self, out: Path, *, resume: bool, overwrite: bool, command: str, checkpoint_every: int = 0,
                 name: str = "train", exit: Callable[[int], Any] = os._exit, sharded: bool = False,
                 write: Optional[Callable[[Dict[str, Any], Path], None]] = None, device: Any = "cpu") -> None:
        self.prefix = f"gradaccum {name}:"
        self.folder = RunFolder(out, resume=resume, overwrite=overwrite, sharded=sharded, say=self.say)
        self.out = out
        self.command = command
        self.checkpoint_every = checkpoint_every
        self.sharded = sharded
        self.checkpoint = self.folder.checkpoint
        self._write = write or save_atomic
        self.rank0 = sync.is_rank_zero()
        self.total_steps = 0
        self.saved: Optional[Position] = None      # what the checkpoint holds
        self.write_error: Optional[str] = None     # why the latest checkpoint write failed, if it did
        self.summary_error: Optional[str] = None   # why summary.json could not be written, if it could not
        self.final: Optional[Position] = None      # where training ended, once it has
        self.signals = StopSignals(prefix=self.prefix, checkpoint=self.checkpoint, command=command, exit=exit,
                                   saved=lambda: None if self.saved is None else str(self.saved), device=device)

    def use_writer(self, write: Callable[[Dict[str, Any], Path], None]) -> None:
        """Write checkpoints with ``write(obj, path)`` (a sharded checkpoint's, once the model exists)."""
        self._write = write

    # -- before anything is written -------------------------------------------------------------

    def plan(self, cfg: TrainConfig) -> Tuple[ResumePlan, Optional[Dict[str, Any]]]:
        """Decide fresh / resume / complete from the folder and the flags (rank 0, told to every rank);
        returns the plan (its ``config`` the settings to train with) and the checkpoint to load (None
        when fresh). Raises a one-line CLIError; writes nothing."""
        outcome: Any = None
        state = None
        if self.rank0:
            try:
                plan, state = self.folder.decide(cfg)
                outcome = ("plan", plan if plan.config is not None else replace(plan, config=cfg))
            except CLIError as e:
                outcome = ("error", str(e))
        outcome = sync.broadcast_object(outcome)
        if outcome[0] == "error":
            raise CLIError(outcome[1])
        plan = outcome[1]
        if plan.kind != "fresh":
            # rank 0's checkpoint on every rank: another node's --out may hold no file, or a stale one
            # (DDP broadcasts parameters only at construction, so a stale load would drift silently)
            state = sync.broadcast_object(state)
            self.saved = plan.position
        return plan, state

    def prepare(self, plan: ResumePlan) -> None:
        """Create the folder and remove what the plan says (see :meth:`RunFolder.prepare`)."""
        self.folder.prepare(plan)

    def kept_history(self, at: Position) -> List[Dict[str, Any]]:
        return self.folder.kept_history(at)

    # -- while training -------------------------------------------------------------------------

    def handling_signals(self) -> contextlib.AbstractContextManager:
        return self.signals.handling_signals()

    def on_stop_signal(self, request_stop: Callable[[], Any], *, loss_every: int = 1) -> None:
        """What a first SIGINT/SIGTERM calls: ``acc.request_stop``, which the next boundary that
        exchanges carries (under several ranks with ``--loss-every K``, the next K-th window)."""
        self.signals.on_first = request_stop
        if loss_every > 1 and sync.world_size() > 1:
            self.signals.until = f"finishing the windows up to the next whose loss the ranks exchange (--loss-every {loss_every})"

    def after_window(self, position: Position, state: Callable[[], Dict[str, Any]], *, last: bool,
                     stop: bool = False) -> None:
        """Called after each window with its ``StepResult.stop_requested``: stop if a signal asked to
        (raises :class:`Stopped`), else write the periodic checkpoint when it is due (the last
        window's is written by :meth:`finish`)."""
        if self.signals.stop_requested(stop):
            self._stop(position, state)
        if self.checkpoint_every and position.step % self.checkpoint_every == 0 and not last:
            self.save(position, state)

    def _stop(self, position: Position, state: Callable[[], Dict[str, Any]]) -> None:
        signum = signal.Signals(self.signals.stopping)  # type: ignore[arg-type]
        done = f"{signum.name}: stopped after step {position.step} of {self.total_steps}"
        if self.save(position, state, quiet=True):
            message = f"{done}; checkpoint {self.checkpoint} ({position}); resume with: {self.command}"
        elif self.saved is not None:
            message = (f"{done}; the checkpoint could not be written ({self.write_error}), {self.checkpoint} "
                       f"still holds {self.saved}; resume with: {self.command}")
        else:
            message = (f"{done}; the checkpoint could not be written ({self.write_error}) and none exists; "
                       f"{self.command} starts the run again")
        raise Stopped(message, EXIT_CODES[signum])

    def save(self, position: Position, state: Callable[[], Dict[str, Any]], *, quiet: bool = False) -> bool:
        """Write the checkpoint at ``position`` atomically (rank 0); every rank waits for it and learns
        how it went. A failed write keeps the previous checkpoint and prints one line (once per run of
        failures)."""
        error = None
        if self.rank0 or self.sharded:  # a sharded checkpoint is written by every rank
            try:
                self._write({**state(), "epoch": position.epoch, "window": position.window}, self.checkpoint)
            except OSError as e:
                error = describe_os_error(e)
        error = sync.broadcast_object(error)  # the barrier: no rank runs ahead of the write
        if error is None:
            self.saved, self.write_error = position, None
            return True
        first, self.write_error = self.write_error is None, error
        if first and not quiet:
            kept = f"{self.checkpoint} still holds {self.saved}" if self.saved is not None else "no checkpoint exists yet"
            self.say(f"warning: the checkpoint at {position} could not be written ({error}); {kept}; training goes on")
        return False

    # -- the end ----------------------------------------------------------------------------------

    def finish(self, position: Position, state: Callable[[], Dict[str, Any]]) -> None:
        """The final checkpoint. A failure is reported by :meth:`raise_if_unsaved`, after the summary."""
        self.final = position
        self.save(position, state, quiet=True)

    def write_summary(self, summary: Dict[str, Any]) -> None:
        """``summary.json``, atomically (rank 0). A failure is reported by :meth:`raise_if_unsaved`."""
        self.summary_error = self.folder.write_json("summary.json", {**summary, "checkpoint": self._checkpoint_note()})

    def _checkpoint_note(self) -> Dict[str, Any]:
        held = self.saved
        return {"path": str(self.checkpoint), "step": held.step if held else None,
                "epoch": held.epoch if held else None, "window": held.window if held else None,
                "error": self.write_error}

    def raise_if_unsaved(self) -> None:
        """Exit 1 (one line) when the final checkpoint or the summary could not be written."""
        problems = []
        if self.final is not None and self.saved != self.final:
            kept = f"it still holds {self.saved}" if self.saved is not None else "no checkpoint exists"
            problems.append(f"the final checkpoint could not be written to {self.checkpoint} "
                            f"({self.write_error}); {kept}")
        summary_error = self.summary_error
        if summary_error is not None:
            problems.append(f"summary.json could not be written ({summary_error})")
        if problems:
            wrote = "metrics.jsonl was" if summary_error else "metrics.jsonl and summary.json were"
            then = ("run the same command with --resume to finish" if self.saved is not None else
                    "run the same command with --overwrite to train again (no checkpoint holds this run)")
            raise WriteFailed(f"{'; '.join(problems)}; {wrote} written; free some space in {self.out}, then {then}")

    def say(self, line: str) -> None:
        """One line on stderr, from rank 0."""
        if sync.is_rank_zero():
            print(f"{self.prefix} {line}", file=sys.stderr, flush=True)
