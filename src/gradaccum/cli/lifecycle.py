"""The life of one run's folder (``--out``): what is written when, checkpoints, signals, resuming.

Every file goes through :class:`~gradaccum.cli.folder.RunFolder`, the one object that reads and
writes the folder; this module decides *when*, and what a signal does (the handlers are
:mod:`gradaccum.cli.signals`'). The training loop (:func:`gradaccum.cli.run.run_loop`) asks it.

Before anything is written
    ``check_out`` refuses, in one line, an empty ``--out``, a path that is a file or lies under one,
    and a folder on a read-only filesystem or without write permission. The data is loaded and
    checked next (a label out of range is refused here, not at the window that meets it). Then the
    folder's lock: a folder another run holds is refused, with the process that holds it (a lock a
    killed run held is free again: the kernel drops it). ``RunLifecycle.plan``
    (:meth:`RunFolder.decide <gradaccum.cli.folder.RunFolder.decide>`) decides from the folder and
    the flags, still without writing:

    * new or empty folder (or one holding only files of no run): a fresh run;
    * another run's files (:data:`~gradaccum.cli.folder.ARTIFACTS`) without ``--resume`` or
      ``--overwrite``: refused, untouched;
    * ``--overwrite``: a fresh run, after removing that run's artifacts (other files stay);
    * ``--resume`` and no checkpoint: one line, and a fresh run (the old artifacts removed);
    * ``--resume`` and a checkpoint: same settings (only ``--epochs`` may grow, never below what is
      done), then training continues at the checkpoint's (epoch, window);
    * ``--resume`` of a finished run: one line that it is complete; ``summary.json`` is left as it was.

Checkpoints
    ``last.pt`` is replaced atomically (:func:`~gradaccum.cli.checkpoint.save_atomic`); with ``--shard``
    it is the folder ``last.dcp`` that every rank writes (:mod:`gradaccum.cli.sharding`): every K steps
    with ``--checkpoint-every K``, after the last window, and when stopped by a signal. A write that
    fails (disk full, file too large) keeps the previous checkpoint, says so in one line, and the run
    goes on: ``metrics.jsonl`` is written line by line and ``summary.json`` at the end regardless; a
    failed *final* write makes the command exit 1 after both are written.

Ctrl-C (SIGINT) and SIGTERM
    From the folder's preparation to the run's last file the first signal is acknowledged at once
    and lets the current window finish; then an atomic checkpoint is written, one line says where it
    is and the exact command that resumes it, and the command exits 130 (SIGINT) or 143 (SIGTERM).
    A signal that lands in the last window or while the run writes its final files (checkpoint,
    ``summary.json``, ``loss.png``) lets them finish: the run is complete, and one line says so
    (nothing to resume), exit 130 or 143. A second signal leaves at once (``os._exit``, same exit
    codes), without a new checkpoint: a write in progress is abandoned and its temporary file
    removed, so ``last.pt`` is the previous whole one, and the line says what it holds. The handler
    never raises (an exception raised inside torch's C++ comes out as its RuntimeError), and after a
    stop both signals stay ignored. Before the folder is prepared, or after the run's files are
    written, a signal stops the command at once with one line saying what is on disk. After
    ``kill -9`` the last checkpoint is whole too; a temporary file left by a write in progress is
    never read, and the next run in the folder removes it.

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
import signal
import sys
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple

from .. import sync
from .config import TrainConfig
from .errors import CLIError
from .atomic import describe_os_error
from .folder import Position, ResumePlan, RunFolder
from .launch import launch
from .rank0 import rank0_decides
from .signals import EXIT_CODES, StopSignals, Stopped

__all__ = ["WriteFailed", "RunLifecycle"]


class WriteFailed(CLIError):
    """Training finished but its final checkpoint could not be written: exit 1, not a usage error."""

    exit_code = 1


class RunLifecycle:
    """One run from the decision to the last write: when the folder is written, and what a signal
    does. See the module docstring. Every file goes through ``folder``.

    Args:
        folder: the run's folder, entered (locked).
        command: the exact command line that resumes this run (printed when stopped).
        checkpoint_every: K of ``--checkpoint-every`` (0: only at the end and when stopped).
        name: the subcommand, for the lines this prints (``gradaccum train: ...``).
        exit: how a second signal ends the process (``os._exit``: at once, no unwinding through torch).
        device: where the stop flag's all-reduce runs (NCCL needs CUDA tensors).
    """

    def __init__(self, folder: RunFolder, *, command: str, checkpoint_every: int = 0, name: str = "train",
                 exit: Optional[Callable[[int], Any]] = None, device: Any = "cpu") -> None:
        self.prefix = f"gradaccum {name}:"
        self.folder = folder
        self.command = command
        self.checkpoint_every = checkpoint_every
        self.checkpoint = folder.checkpoint
        self.rank0 = sync.is_rank_zero()
        self.total_steps = 0
        self.saved: Optional[Position] = None      # what the checkpoint holds
        self.write_error: Optional[str] = None     # why the latest checkpoint write failed, if it did
        self.summary_error: Optional[str] = None   # why summary.json could not be written, if it could not
        self.final: Optional[Position] = None      # where training ended, once it has
        extra = {} if exit is None else {"exit": exit}
        self.signals = StopSignals(prefix=self.prefix, checkpoint=self.checkpoint, command=command, device=device,
                                   abandon_write=folder.abandon_checkpoint_write,
                                   saved=lambda: None if self.saved is None else str(self.saved), **extra)

    # -- before anything is written -------------------------------------------------------------

    def plan(self, cfg: TrainConfig) -> Tuple[ResumePlan, Optional[Dict[str, Any]]]:
        """Decide fresh / resume / complete from the folder and the flags (rank 0, told to every rank);
        returns the plan (its ``config`` the settings to train with) and the checkpoint to load (None
        when fresh). Raises a one-line CLIError; writes nothing."""
        def decide() -> Tuple[ResumePlan, Optional[Dict[str, Any]]]:
            plan, state = self.folder.decide(cfg, restart_count=launch().restart_count)
            return (plan if plan.config is not None else replace(plan, config=cfg)), state

        # rank 0's checkpoint on every rank, with the plan: another node's --out may hold no file, or a
        # stale one (DDP broadcasts parameters only at construction, so a stale load would drift silently)
        plan, state = rank0_decides(decide)
        if plan.kind != "fresh":
            self.saved = plan.position
        return plan, state

    # -- while training -------------------------------------------------------------------------

    def handling_signals(self) -> contextlib.AbstractContextManager:
        """SIGINT and SIGTERM handled from the folder's preparation to the run's last file."""
        return self.signals.handling_signals()

    def on_stop_signal(self, request_stop: Callable[[], Any]) -> None:
        """What a first SIGINT/SIGTERM calls: ``acc.request_stop``, which the next window's boundary
        carries to every rank. A signal that came before (while the run was set up) is passed on now."""
        self.signals.set_on_first(request_stop)

    def stop_here(self, asked: bool) -> bool:
        """After a window: its ``StepResult.stop_requested`` (a signal on some rank, carried to all)."""
        return self.signals.stop_requested(asked)

    def checkpoint_due(self, position: Position) -> bool:
        """A periodic checkpoint is due after this window (``--checkpoint-every K``)."""
        return bool(self.checkpoint_every) and position.step % self.checkpoint_every == 0

    def stop(self, position: Position, state: Callable[[], Dict[str, Any]]) -> None:
        """Write the checkpoint at ``position`` and raise :class:`Stopped` with the line to print."""
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
        """Write the checkpoint at ``position`` atomically (rank 0; every rank for a sharded one);
        every rank waits for it and learns how it went. A failed write keeps the previous
        checkpoint and prints one line (once per run of failures)."""
        error = None
        if self.rank0 or self.folder.sharded:
            try:
                self.folder.write_checkpoint({**state(), "epoch": position.epoch, "window": position.window})
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
        """The final checkpoint, after the last window. A failure is reported by
        :meth:`raise_if_unsaved`, after the summary. From here a first signal lets the run's files
        finish (:meth:`signal_at_end` then tells)."""
        self.signals.until = (f"the run is at its end: finishing its checkpoint, summary.json and loss.png "
                              f"in {self.folder.out}, then stopping")
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

    def signal_at_end(self) -> Optional[int]:
        """The signal that came while the run finished its last window or its files, agreed by every
        rank (one all-reduce, once per run), or None: the run is complete, and it stops there."""
        return self.signals.received_by_any()

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
            raise WriteFailed(f"{'; '.join(problems)}; {wrote} written; free some space in {self.folder.out}, "
                              f"then {then}")

    def say(self, line: str) -> None:
        """One line on stderr, from rank 0."""
        if self.rank0:
            print(f"{self.prefix} {line}", file=sys.stderr, flush=True)
