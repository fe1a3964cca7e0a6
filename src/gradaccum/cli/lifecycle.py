"""The life of one run's folder (``--out``): what may be written there, checkpoints, signals, resuming.

The training loop (:mod:`gradaccum.cli.train`) asks this module; it never touches the folder itself.

Before anything is written
    ``check_out`` refuses, in one line, an empty ``--out``, a path that is a file or lies under one,
    and a folder on a read-only filesystem or without write permission. ``RunLifecycle.plan`` then
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
    of the global windows, so it resumes on any world size. After each window the ranks all-reduce
    the stop flag, so all of them stop at the same window even when only some got the signal. torchrun
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
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, TextIO, Tuple

from .. import sync
from .checkpoint import CLIError, describe_os_error, is_temp_for, load_checkpoint, save_atomic, temp_name
from .config import TrainConfig

__all__ = ["ARTIFACTS", "BASELINE", "CHECKPOINT", "SHARDED_CHECKPOINT", "Position", "Plan", "Stopped", "WriteFailed",
           "RunLifecycle", "check_out"]

CHECKPOINT = "last.pt"
SHARDED_CHECKPOINT = "last.dcp"  # a folder: --shard's torch.distributed.checkpoint
#: the files one run writes into its folder; --overwrite removes these and nothing else
ARTIFACTS = (CHECKPOINT, SHARDED_CHECKPOINT, "metrics.jsonl", "summary.json", "loss.png", "compare.json",
             "compare.png", f".{SHARDED_CHECKPOINT}.old")
#: the same signal again within this many seconds is a launcher forwarding the first (torchrun)
REPEAT_SECONDS = 1.0
#: --compare's one-batch run: a run folder of its own inside this one
BASELINE = "baseline"
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Stopped(BaseException):
    """The run stops on a signal. ``str()`` is the one line to print, ``exit_code`` 130 or 143.

    A BaseException: raised from a signal handler anywhere, no ``except Exception`` may swallow it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class WriteFailed(CLIError):
    """Training finished but its final checkpoint could not be written: exit 1, not a usage error."""

    exit_code = 1


@dataclass(frozen=True)
class Position:
    """Where a run stands: the next window to run is ``window`` of ``epoch``; ``step`` steps are taken."""

    epoch: int
    window: int
    step: int

    def __str__(self) -> str:
        return f"step {self.step} (epoch {self.epoch}, window {self.window})"


@dataclass(frozen=True)
class Plan:
    """What the folder and the flags decide before anything is written.

    ``kind``: ``"fresh"``, ``"resume"`` or ``"complete"``; ``position``: where training starts;
    ``remove``: the artifacts to remove first; ``note``: a line to print, if any."""

    kind: str
    position: Position
    remove: List[str]
    note: Optional[str] = None
    has_summary: bool = False


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
        if resume and overwrite:
            raise CLIError("--resume and --overwrite contradict each other: --resume continues the run in "
                           "--out, --overwrite deletes it; pass one of them")
        self.out = out
        self.resume = resume
        self.overwrite = overwrite
        self.command = command
        self.checkpoint_every = checkpoint_every
        self.prefix = f"gradaccum {name}:"
        self.sharded = sharded
        self.checkpoint = out / (SHARDED_CHECKPOINT if sharded else CHECKPOINT)
        self._write = write or save_atomic
        self.device = device
        self.rank0 = sync.is_rank_zero()
        self.total_steps = 0
        self.saved: Optional[Position] = None      # what last.pt holds
        self.write_error: Optional[str] = None     # why the latest checkpoint write failed, if it did
        self.summary_error: Optional[str] = None   # why summary.json could not be written, if it could not
        self.final: Optional[Position] = None      # where training ended, once it has
        self._signal: Optional[int] = None         # the first SIGINT/SIGTERM received
        self._signal_at = 0.0                      # when (time.monotonic), to tell a launcher's copy
        self._stopping: Optional[int] = None       # the signal all ranks agreed to stop on
        self._leaving = False                      # a second signal was received: leaving at once
        self._exit = exit                          # how the second signal leaves (tests replace it)

    # -- before anything is written -------------------------------------------------------------

    def plan(self, cfg: TrainConfig, total_steps: int) -> Tuple[Plan, Optional[Dict[str, Any]]]:
        """Decide fresh / resume / complete from the folder and the flags; returns the plan and the
        checkpoint to load (None when fresh). Raises a one-line CLIError; writes nothing."""
        self.total_steps = total_steps
        outcome: Any = None
        state = None
        if self.rank0:
            try:
                plan, state = self._decide(cfg)
                outcome = ("plan", plan)
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
        if plan.kind != "fresh":
            self.saved = plan.position
        return plan, state

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

    def _decide(self, cfg: TrainConfig) -> Tuple[Plan, Optional[Dict[str, Any]]]:
        start = Position(0, 0, 0)
        artifacts = _artifacts_in(self.out)
        if self.overwrite:
            return Plan("fresh", start, artifacts), None
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
            return Plan("fresh", start, artifacts), None
        other = self.out / (CHECKPOINT if self.sharded else SHARDED_CHECKPOINT)
        if not self._exists() and other.exists():
            raise CLIError(f"--resume: {self.out} holds {other.name}, a {'non-' if self.sharded else ''}sharded "
                           f"run's checkpoint; resume it {'without' if self.sharded else 'with'} --shard")
        if not self._exists():
            return Plan("fresh", start, artifacts,
                        note=f"--resume: nothing to resume in {self.out} (no {self.checkpoint.name}); "
                             "starting from step 0"), None
        state = self._read()
        try:
            saved = TrainConfig(**state["config"])
        except (TypeError, ValueError):
            raise CLIError(f"--resume: {self.checkpoint} holds settings this version cannot read; resume with "
                           "the gradaccum that wrote it, or pass another --out") from None
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
            done = f"{at.epoch} epochs" + (f" and {at.window} windows" if at.window else "") + f", {at.step} steps"
            raise CLIError(f"--resume --epochs {epochs}: {self.checkpoint} already holds {done}; pass "
                           f"--epochs {at.epoch + (1 if at.window else 0)} or more, or another --out")
        stray = [a for a in artifacts if any(is_temp_for(a, x) for x in ARTIFACTS)]  # never read: removed
        has_summary = (self.out / "summary.json").exists()
        if (epochs, 0) == (at.epoch, at.window):
            note = (f"{self.out} is complete: {epochs} epochs, {at.step} steps; nothing to train"
                    + ("; summary.json left as it was" if has_summary else "; writing its missing summary.json"))
            return Plan("complete", at, stray, note=note, has_summary=has_summary), state
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        why = f"torchrun restart {restart}: " if restart else "--resume: "
        return Plan("resume", at, stray, has_summary=has_summary,
                    note=f"{why}continuing {self.out} from {at} of {self.checkpoint.name}"), state

    # -- the folder -------------------------------------------------------------------------------

    def prepare(self, plan: Plan) -> None:
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
        """The metrics lines of the windows before the checkpoint's position (a killed run may have
        written more). By (epoch, window), not step: a skipped window repeats its step number."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line torn by kill -9 (or blank): the checkpoint is the truth
                continue
        return [r for r in rows if isinstance(r, dict) and "epoch" in r and "window" in r
                and (r["epoch"], r["window"]) < (at.epoch, at.window)]

    @contextlib.contextmanager
    def metrics(self, history: List[Dict[str, Any]]) -> Iterator[Optional[TextIO]]:
        """``metrics.jsonl`` rewritten with ``history``, open to append one line per step (rank 0)."""
        if not self.rank0:
            yield None
            return
        path = self.out / "metrics.jsonl"
        tmp = temp_name(path)  # replaced whole: a kill while rewriting cannot lose the kept lines
        with open(tmp, "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)
        os.replace(tmp, path)
        with open(path, "a") as f:
            yield f

    # -- while training -------------------------------------------------------------------------

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM, while training: the first asks to stop after the window, the second
        leaves at once. On the way out the previous handlers come back, unless a signal stopped the
        run: then both stay ignored, so that one more Ctrl-C cannot turn the exit into a traceback."""
        if threading.current_thread() is not threading.main_thread():  # handlers live in the main thread
            yield
            return
        previous = {s: signal.getsignal(s) for s in EXIT_CODES}
        for s in EXIT_CODES:
            signal.signal(s, self._on_signal)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_IGN if self._signal is not None or self._stopping else handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Never raises: an exception raised here inside torch (a hook, a checkpoint write) comes out
        as torch's RuntimeError. The first signal sets a flag; the second leaves with ``os._exit``."""
        if self._leaving:
            return
        name = signal.Signals(signum).name
        if (self._signal == signum and "TORCHELASTIC_RUN_ID" in os.environ
                and time.monotonic() - self._signal_at < REPEAT_SECONDS):
            return  # torchrun forwarding the Ctrl-C the terminal already sent to this worker: the same one
        if self._signal is None:
            self._signal, self._signal_at = signum, time.monotonic()
            # os.write: a print here could re-enter a print the loop is in
            self._write_line(f"{name} received: finishing this window, then writing a checkpoint (a second "
                             f"{name} stops at once, without one)")
            return
        self._leaving = True
        with contextlib.suppress(OSError):  # a checkpoint being written: its temporary file goes
            temp_name(self.checkpoint).unlink()
        if self.checkpoint.exists():
            held = f" and holds {self.saved}" if self.saved is not None else ""
            where = f"{self.checkpoint} is whole{held}; resume with: {self.command}"
        else:
            where = f"no checkpoint was written; {self.command} starts the run again"
        self._write_line(f"second {name}: stopped at once, without a new checkpoint; {where}")
        self._exit(EXIT_CODES[signal.Signals(signum)])

    def _write_line(self, line: str) -> None:
        if self.rank0:
            os.write(2, f"{self.prefix} {line}\n".encode())

    def stop_requested(self) -> bool:
        """Did a signal ask to stop, here or on any rank? Under torchrun an all-reduce per window, and
        the answer is the all-reduced flag alone: a signal whose handler runs after the collective
        returned (Python runs handlers between bytecodes) waits for the next window's all-reduce,
        else this rank would stop while its peers go on into the next window and wait forever."""
        local = self._signal or 0  # read once, before the collective
        if sync.is_distributed():
            import torch

            flag = torch.tensor([local], device=self.device)
            agreed = int(sync.all_reduce_(flag, "max").item())
        else:
            agreed = local
        if agreed:
            self._stopping = agreed  # the signal every rank stops with (a peer's, maybe)
        return bool(agreed)

    def after_window(self, position: Position, state: Callable[[], Dict[str, Any]], *, last: bool) -> None:
        """Called after each window: stop if a signal asked to (raises :class:`Stopped`), else write
        the periodic checkpoint when it is due (the last window's is written by :meth:`finish`)."""
        if self.stop_requested():
            self._stop(position, state)
        if self.checkpoint_every and position.step % self.checkpoint_every == 0 and not last:
            self.save(position, state)

    def _stop(self, position: Position, state: Callable[[], Dict[str, Any]]) -> None:
        signum = signal.Signals(self._stopping)  # type: ignore[arg-type]
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
        if not self.rank0:
            return
        path = self.out / "summary.json"
        tmp = temp_name(path)
        try:
            tmp.write_text(json.dumps({**summary, "checkpoint": self._checkpoint_note()}, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.summary_error = describe_os_error(e)

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
        if self.rank0:
            print(f"{self.prefix} {line}", file=sys.stderr, flush=True)

