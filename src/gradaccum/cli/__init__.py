"""``gradaccum train | eval | check``: training runs, evaluation and the equivalence check, end to end.

Every user mistake ends as one line on stderr and exit code 2, never a traceback
(``GRADACCUM_DEBUG=1`` shows the traceback of an unexpected error). The flags are in
:mod:`gradaccum.cli.parser`, each command in its module (:mod:`~gradaccum.cli.train_command`,
:mod:`~gradaccum.cli.evaluate`, :mod:`~gradaccum.cli.check`); what happens to the run folder, on
Ctrl-C and on ``--resume`` is in :mod:`gradaccum.cli.lifecycle`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Sequence

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
    from .parser import build_parser
    from .sharding import teardown_distributed

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand that refuses them, with where to find its flags
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)} (gradaccum {args.command} "
                                     "--help lists its flags)")
    command_argv = argv[argv.index(args.command):] if args.command in argv else [args.command]
    code = _run(args, command_argv)
    # only now: the command's frames (and an exception's traceback) are gone, so nothing holds the
    # model, DDP's reducer, the optimizer or the Accumulator, which hold the process group; a group
    # destroyed while they live is torn down again at interpreter exit, where gloo can abort
    teardown_distributed()
    return code


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
        print(f"gradaccum {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        if os.environ.get("GRADACCUM_DEBUG"):
            raise
        print(f"gradaccum {args.command}: error: {type(e).__name__}: {e} (GRADACCUM_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1
