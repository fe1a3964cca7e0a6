"""What a guide quotes of an example's output is what the example prints (issue #40 item 7).

A transcript in a guide is a fenced block whose first line is ``$ python examples/NAME.py``; every
line after it must be a line the example prints. Numbers are compared as the guide writes them: the
same digits, with one exception. A distance at float64 rounding (below ``ROUNDING``, "1.1e-16") is
the last bits of sums whose order depends on the CPU's kernels and thread count: a new user's
machine printed 2.1e-17 where this one prints 1.1e-16. Both must then be at rounding level; the
digits are not compared. A distance of the stock path ("2.3e-02") is a real difference and must be
printed to the digits quoted.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List

DOCS = Path(__file__).resolve().parent.parent / "docs"
ROUNDING = 1e-14  # float64 rounding of a distance between parameters of order 1: 1e-17 .. 1e-15
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def transcripts(guide: str, example: str) -> List[List[str]]:
    """The output lines a guide quotes under ``$ python examples/<example>``, one list per transcript."""
    text = (DOCS / "guides" / guide).read_text()
    found = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
        lines = block.rstrip("\n").split("\n")
        if lines[0].strip() == f"$ python examples/{example}":
            found.append(lines[1:])
    return found


def same_number(quoted: str, printed: str) -> bool:
    q, p = float(quoted), float(printed)
    if abs(q) < ROUNDING or abs(p) < ROUNDING:
        return abs(q) < ROUNDING and abs(p) < ROUNDING
    return quoted.lower() == printed.lower() or f"{p:.{_decimals(quoted)}e}" == _canonical(quoted)


def _decimals(s: str) -> int:
    mantissa = s.lower().split("e")[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


def _canonical(s: str) -> str:
    return f"{float(s):.{_decimals(s)}e}"


def same_line(quoted: str, printed: str) -> bool:
    """The same words, and each number the same as :func:`same_number` says."""
    if NUMBER.sub("#", quoted) != NUMBER.sub("#", printed):
        return False
    return all(same_number(q, p) for q, p in zip(NUMBER.findall(quoted), NUMBER.findall(printed)))


def assert_quoted(guide: str, example: str, output: str) -> None:
    """Every transcript of ``example`` in ``guide`` (there is one at least) is lines of ``output``."""
    found = transcripts(guide, example)
    assert found, f"docs/guides/{guide} has no transcript of examples/{example}"
    printed = output.splitlines()
    for transcript in found:
        for line in transcript:
            assert any(same_line(line, p) for p in printed), (
                f"docs/guides/{guide} quotes examples/{example} as printing\n  {line}\nwhich it does not; "
                f"it printed:\n" + "\n".join(printed[-10:]))


def assert_figure(quoted: str, printed: str, where: str) -> None:
    """One figure a guide's prose quotes against the one the example printed."""
    assert same_number(quoted, printed), f"{where} quotes {quoted}; the example prints {printed}"
