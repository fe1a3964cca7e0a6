"""docs/architecture.md's map of the modules is equal to the tree, one line per module (issue #48, item 6)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "gradaccum"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def map_entries(text: str) -> Dict[str, str]:
    """The map's modules, ``{"src/gradaccum/_window.py": "Window: ..."}``: the code block under "## The map",
    where a line ending in ``/`` opens a folder and a deeper indented line names a file in it."""
    block = text.split("## The map", 1)[1].split("```", 2)[1]
    entries: Dict[str, str] = {}
    folders: List[tuple] = []  # (indent, path) of the open folders
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        name, _, job = line.strip().partition(" ")
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = "".join(p for _, p in folders) + name
        if name.endswith("/"):
            folders.append((indent, name))
        else:
            entries[path] = job.strip()
    return entries


def test_the_map_names_every_module_once_each_with_its_job():
    entries = map_entries(ARCHITECTURE.read_text())
    mapped = {p for p in entries if p.startswith("src/gradaccum/") and p.endswith(".py")}
    tree = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}
    assert not tree - mapped, f"docs/architecture.md's map lacks {sorted(tree - mapped)}: add one line each, its job"
    assert not mapped - tree, f"docs/architecture.md's map names modules that are gone: {sorted(mapped - tree)}"
    assert all(entries[p] for p in mapped), [p for p in mapped if not entries[p]]


def test_the_map_parser_sees_folders_and_a_missing_line():
    text = "## The map\n\n```\nsrc/x/\n  a.py   one job\n  sub/\n    b.py  another\n  c.py  a third\ntests/  t\n```\n"
    assert map_entries(text) == {"src/x/a.py": "one job", "src/x/sub/b.py": "another", "src/x/c.py": "a third"}
