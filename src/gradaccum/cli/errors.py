"""The command line's one error type: a problem the user can fix, printed as one line."""

from __future__ import annotations

__all__ = ["CLIError"]


class CLIError(Exception):
    """A user-facing problem: the command line prints it as one line and exits non-zero (2, or the
    ``exit_code`` attribute when one is set)."""
