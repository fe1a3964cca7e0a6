"""Ctrl-C (SIGINT) and SIGTERM during training: finish the window, then stop on every rank together.

The first signal is acknowledged at once and lets the current window finish; the run then writes a
checkpoint and stops (:mod:`gradaccum.cli.lifecycle`). A second signal leaves at once (``os._exit``,
exit 130 or 143), without a new checkpoint: a write in progress is abandoned and its temporary file
removed. The handler never raises (an exception raised inside torch's C++ comes out as its
RuntimeError), and after a stop both signals stay ignored. A signal the process was started
ignoring stays ignored throughout, as well-behaved Unix programs do: a shell starts a script's
background job (``gradaccum train &``) with SIGINT ignored, so a Ctrl-C meant for the script does
not stop the run, before training or during it (SIGTERM still does).

The first signal also calls ``acc.request_stop()`` (at once, or when the loop starts if it came
while the run was set up): the window's boundary carries it to every rank in the all-reduce it
makes anyway, so all ranks see ``StepResult.stop_requested`` at the same window (even when only
some got the signal) and no window pays a collective for it; on that window alone one all-reduce
tells every rank which signal it was (exit 130 or 143; 143 when the stop was asked by code rather
than a signal). A signal that came after the last window's boundary is found by
:meth:`StopSignals.received_by_any`, once, at the run's end. torchrun forwards the Ctrl-C it
receives to its workers; where a worker also gets the terminal's, the same signal again within a
second is that copy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .. import sync
from .launch import launch

__all__ = ["EXIT_CODES", "REPEAT_SECONDS", "StopSignals", "Stopped"]

#: the same signal again within this many seconds is a launcher forwarding the first (torchrun)
REPEAT_SECONDS = 1.0
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Stopped(BaseException):
    """The run stops on a signal. ``str()`` is the one line to print, ``exit_code`` 130 or 143.

    A BaseException: raised from a signal handler anywhere, no ``except Exception`` may swallow it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """The run's SIGINT and SIGTERM handlers and the stop flag the ranks agree on.

    Args:
        prefix: starts each line printed (``gradaccum train:``).
        checkpoint: the checkpoint a second signal leaves, for the line it prints.
        abandon_write: called by a second signal: removes a checkpoint write in progress (the run
            folder's :meth:`~gradaccum.cli.folder.RunFolder.abandon_checkpoint_write`) and says
            whether a whole checkpoint is there.
        command: the command that resumes the run.
        saved: what the checkpoint holds now, in words (None: nothing yet), asked when leaving.
        exit: how a second signal ends the process (``os._exit``; tests replace it).
        device: where the stop flag's all-reduce runs (NCCL needs CUDA tensors).
    """

    def __init__(self, *, prefix: str, checkpoint: Path, abandon_write: Callable[[], bool], command: str,
                 saved: Callable[[], Optional[str]], exit: Callable[[int], Any] = os._exit,
                 device: Any = "cpu") -> None:
        self.prefix = prefix
        self.checkpoint = checkpoint
        self.abandon_write = abandon_write
        self.command = command
        self.saved = saved
        self.device = device
        self.rank0 = sync.is_rank_zero()
        self._signal: Optional[int] = None         # the first SIGINT/SIGTERM received
        self._signal_at = 0.0                      # when (time.monotonic), to tell a launcher's copy
        self.stopping: Optional[int] = None        # the signal all ranks agreed to stop on
        self._leaving = False                      # a second signal was received: leaving at once
        self._exit = exit
        self._elastic = launch().elastic           # under torchrun's agent, which forwards a Ctrl-C
        #: what the first signal's line says happens next
        self.until = "finishing this window, then writing a checkpoint"
        #: called at the first signal (the run sets ``acc.request_stop``: the window's boundary then
        #: tells every rank, with no collective of its own)
        self._on_first: Callable[[], Any] = lambda: None

    def set_on_first(self, call: Callable[[], Any]) -> None:
        """Call ``call`` at the first signal; at once if it already came (while the run was set up)."""
        self._on_first = call
        if self._signal is not None:
            call()

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM, while training: the first asks to stop after the window, the second
        leaves at once. A signal the process was started ignoring (``SIG_IGN``: a shell starts a
        script's background job, ``gradaccum train &``, with SIGINT ignored) stays ignored, as it
        was from the start. On the way out the previous handlers come back, unless a signal stopped
        the run: then both stay ignored, so that one more Ctrl-C cannot turn the exit into a traceback."""
        if threading.current_thread() is not threading.main_thread():  # handlers live in the main thread
            yield
            return
        previous = {s: signal.getsignal(s) for s in EXIT_CODES}
        for s in EXIT_CODES:
            if previous[s] is not signal.SIG_IGN:
                signal.signal(s, self._on_signal)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_IGN if self._signal is not None or self.stopping else handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Never raises: an exception raised here inside torch (a hook, a checkpoint write) comes out
        as torch's RuntimeError. The first signal sets a flag; the second leaves with ``os._exit``."""
        if self._leaving:
            return
        name = signal.Signals(signum).name
        if (self._signal == signum and self._elastic
                and time.monotonic() - self._signal_at < REPEAT_SECONDS):
            return  # torchrun forwarding the Ctrl-C the terminal already sent to this worker: the same one
        if self._signal is None:
            self._signal, self._signal_at = signum, time.monotonic()
            self._on_first()
            # os.write: a print here could re-enter a print the loop is in
            self._write_line(f"{name} received: {self.until} (a second {name} stops at once, without a "
                             "new checkpoint)")
            return
        self._leaving = True
        if self.abandon_write():  # a checkpoint being written: its temporary file goes
            saved = self.saved()
            held = f" and holds {saved}" if saved is not None else ""
            where = f"{self.checkpoint} is whole{held}; resume with: {self.command}"
        else:
            where = f"no checkpoint was written; {self.command} starts the run again"
        self._write_line(f"second {name}: stopped at once, without a new checkpoint; {where}")
        self._exit(EXIT_CODES[signal.Signals(signum)])

    def _write_line(self, line: str) -> None:
        if self.rank0:
            with contextlib.suppress(OSError):  # stderr a closed pipe: the run goes on regardless
                os.write(2, f"{self.prefix} {line}\n".encode())

    def stop_requested(self, asked: bool) -> bool:
        """Stop after this window? ``asked`` is the window's ``StepResult.stop_requested``: a signal
        on some rank reached every rank in the boundary's all-reduce, at the same window, so the
        ranks decide alike and no window pays a collective for it. Only on that window one more
        all-reduce tells every rank which signal it was (the exit code: 130 or 143)."""
        if not asked:
            return False
        agreed = self._any_ranks_signal(self._signal or 0)  # 0 on a rank that received none
        self.stopping = agreed or int(signal.SIGTERM)  # the signal every rank stops with (a peer's, maybe)
        return True

    def received_by_any(self) -> Optional[int]:
        """At the run's end, on every rank: the signal any rank received (one all-reduce under
        several ranks, once per run), or None. It came after the last window's boundary, or on it."""
        agreed = self._any_ranks_signal(self.stopping or self._signal or 0)
        if agreed:
            self.stopping = agreed
        return agreed or None

    def _any_ranks_signal(self, local: int) -> int:
        """The signal number any rank holds (the largest; 0: none): the one all-reduce of this
        module, a max over the ranks' ``local`` (itself on one process)."""
        if not sync.is_distributed():
            return local
        import torch

        flag = torch.tensor([local], device=self.device)
        return int(sync.all_reduce_(flag, "max").item())
