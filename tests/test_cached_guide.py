"""Issue #34 (b): the contrastive guide's first snippet runs as it is written (every name defined)."""
from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "contrastive.md"


def test_the_guide_s_first_snippet_runs_as_written(capsys):
    snippet = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    exec(compile(snippet, str(GUIDE), "exec"), {"__name__": "guide"})  # noqa: S102 - our own documentation
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["2"]  # one window of 4 micro-batches, after the step() above
    assert lines[0].split()[2] == "64"
