"""``gradaccum train | eval | check``: training runs, evaluation and the equivalence check, end to end.

Every user mistake ends as one line on stderr and exit code 2, never a traceback
(``GRADACCUM_DEBUG=1`` shows the traceback of an unexpected error). A Ctrl-C is one line too, at
any moment: while Python imports torch, while a run is set up, trains or writes its files (what it
does then is :mod:`gradaccum.cli.lifecycle`'s). A reader that goes away (``| head``) costs the
command its output, never its work. The flags are in :mod:`gradaccum.cli.parser`, each command in its
module (:mod:`~gradaccum.cli.train_command`, :mod:`~gradaccum.cli.evaluate`, :mod:`~gradaccum.cli.check`).

Importing this package imports no torch (``gradaccum`` imports its modules when first used), so that
``main`` is running, and catching a Ctrl-C, before torch's import begins.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import Any, Callable, Iterator, List, Optional, Sequence

__all__ = ["main"]


def _command(name: str) -> Callable[[argparse.Namespace, Sequence[str]], int]:
    if name == "train":
        from .train_command import train_command

        return train_command
    if name == "eval":
        from .evaluate import eval_command

        return eval_command
    from .check import check_command

    return check_command


def main(argv: Optional[List[str]] = None) -> int:
    """The command line: the exit code of ``gradaccum <command> ...`` (``argv``: sys.argv[1:])."""
    with _pipe_safe_output():
        try:
            return _main(list(sys.argv[1:] if argv is None else argv))
        except KeyboardInterrupt:  # before a command's own handling: importing torch, parsing
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C now would print a traceback
            if _rank() == 0:
                print("gradaccum: SIGINT: stopped before the command started; nothing was written", file=sys.stderr)
            return 130


def _main(argv: List[str]) -> int:
    from .parser import build_parser, unknown_flags_message

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:  # bare `gradaccum`: what there is to run
        parser.print_help(sys.stderr)
        return 2
    if unknown:  # named by the subcommand that refuses them, with the flag meant and where to find the others
        sub = parser.commands[args.command]
        sub.error(unknown_flags_message(sub, args.command, unknown))
    command_argv = argv[argv.index(args.command):] if args.command in argv else [args.command]
    code = _run(args, command_argv)
    from .sharding import teardown_distributed  # torch: a bad flag or --help is answered before its import

    # only now: the command's frames (and an exception's traceback) are gone, so nothing holds the
    # model, DDP's reducer, the optimizer or the Accumulator, which hold the process group; a group
    # destroyed while they live is torn down again at interpreter exit, where gloo can abort
    if teardown_distributed():
        # a worker of several ranks whose files are all written (atomically, fsynced) and whose group
        # is gone: it exits now, without the interpreter's teardown, where gloo's threads could still
        # abort a finished run ('terminate called without an active exception', exit 134: seen once in
        # a loaded suite run, docs/measurements.md)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _rank() -> int:
    from .launch import launch

    return launch().rank


def _run(args: argparse.Namespace, command_argv: Sequence[str]) -> int:
    """The command's exit code; every error as one line (rank 0 says it once)."""
    from ..sync import is_rank_zero
    from ..tasks.data import TaskError
    from .errors import CLIError
    from .signals import Stopped

    def say(line: str) -> None:
        if is_rank_zero():
            print(line, file=sys.stderr)

    try:
        return _command(args.command)(args, command_argv)
    except Stopped as e:
        say(f"gradaccum {args.command}: {e}")
        return e.exit_code
    except CLIError as e:
        say(f"gradaccum {args.command}: error: {e}")
        return getattr(e, "exit_code", 2)
    except (TaskError, ValueError, FileNotFoundError, PermissionError) as e:
        say(f"gradaccum {args.command}: error: {e}")
        return 2
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        say(f"gradaccum {args.command}: SIGINT: stopped before the command wrote anything")
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        if os.environ.get("GRADACCUM_DEBUG"):
            raise
        say(f"gradaccum {args.command}: error: {type(e).__name__}: {e} (GRADACCUM_DEBUG=1 shows the traceback)")
        return 1


class _PipeSafe:
    """``sys.stdout`` or ``sys.stderr`` while a command runs: a reader that went away (``| head``
    closed the pipe) costs the command its output, not its work. After the first broken pipe the
    stream writes nowhere, and its file descriptor points at ``/dev/null``, so that the
    interpreter's last flush at exit is quiet too."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._broken = False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._break()
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._break()

    def _break(self) -> None:
        self._broken = True
        with contextlib.suppress(Exception):  # a stream without a descriptor (pytest's capture): nothing to point
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _pipe_safe_output() -> Iterator[None]:
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PipeSafe(sys.stdout), _PipeSafe(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
