"""The documentation builds with warnings as errors: ``mkdocs build --strict`` (what ``make docs`` runs).

The API reference is generated from the docstrings by mkdocstrings, so a function that is renamed or
removed, a docstring parameter that is not in the signature, or a link to a page or heading that no
longer exists fails this test instead of leaving a broken page. A few seconds.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def test_docs_build_strict(tmp_path):
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers", "material") if not _installed(m)]
    if missing:
        pytest.skip(f"the docs toolchain is not installed ({', '.join(missing)}): "
                    "pip install -e '.[docs]' (make docs does)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    problems = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [proc.stderr[-4000:]])
    assert (tmp_path / "site" / "api" / "index.html").is_file()
    # each code line carries its indentation for the stylesheet's hanging indent (docs/_hooks.py, extra.css):
    # the first block of the train guide has "    inputs, targets = batch" inside loss_fn
    page = (tmp_path / "site" / "guides" / "train" / "index.html").read_text()
    line = re.search(r'<span id="__span-0-\d+" style="--indent:(\d+)">((?:(?!<span id="__span).)*?)targets</span>',
                     page, re.S)
    assert line and line.group(1) == "4", "docs/_hooks.py did not give the code lines their indentation"
    assert "--indent" in (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
