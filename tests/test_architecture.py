"""The docs' two audiences (issue #48, item 6): docs/architecture.md's map of the modules is equal to the
tree, one line per module; the guides and the home page speak to users in public names only, the private
modules and the internal classes being the architecture page's."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import gradaccum

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "gradaccum"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
USER_PAGES = [ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
#: the Trainer drivers' glue: public modules whose names are the drivers', not the user's
GLUE = ("hf_driver", "hf_window_loss", "hf_moe", "hf_deepspeed")
#: private names that are also another library's public ones (Accelerate's ``accelerator.prepare``)
NOT_OURS = {"prepare"}


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


def private_names() -> Set[str]:
    """Classes and functions of the private modules (``_x.py``) and of the Trainer drivers' glue that nothing
    public exports: ``gradaccum``'s ``__all__``, a public core module's (``gradaccum.sync``, ``gradaccum.moe``;
    an integration's re-exports its glue's), the API reference's entries."""
    public = set(gradaccum.__all__)
    for path in PACKAGE.glob("*.py"):
        if path.name.startswith("_"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                public |= set(ast.literal_eval(node.value))
    api = (ROOT / "docs" / "api.md").read_text().split("## The maths", 1)[0]  # that section shows private maths
    public |= {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: ([\w.]+)", api, re.M)}
    found = set()
    private = [p for p in PACKAGE.glob("_*.py") if p.name not in ("__init__.py", "__main__.py")]
    for path in private + [PACKAGE / "integrations" / f"{g}.py" for g in GLUE]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                found.add(node.name)
    return found - public - NOT_OURS


def internal_mentions(text: str, private: Set[str]) -> List[str]:
    """The private names a page's code spans and blocks name: ``gradaccum._x`` and the glue modules by
    path, and the private modules' classes and functions by name."""
    found = re.findall(r"gradaccum\._\w+|integrations\.(?:%s)\b|\b_\w+\.py\b" % "|".join(GLUE), text)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # the code blocks run as tests: public by use
    for span in re.findall(r"`([^`\n]+)`", prose):
        found += [name for name in re.findall(r"[A-Za-z_]\w*", span) if name in private]
    return found


def test_the_user_pages_name_public_api_only():
    private = private_names()
    assert {"Gradients", "CachedPasses", "TrainerWindowState", "WindowWeights"} <= private
    named = {page.name: sorted(set(internal_mentions(page.read_text(), private))) for page in USER_PAGES}
    named = {page: names for page, names in named.items() if names}
    assert not named, ("the guides are for users: say it in public names, or move the internals to "
                       f"docs/architecture.md (and link it): {named}")


def test_the_check_finds_an_internal_name():
    private = private_names()
    text = "`window.weights` (`gradaccum._weights.WindowWeights`), `TrainerWindowState.hold`, `acc.step`"
    assert internal_mentions(text, private) == ["gradaccum._weights", "WindowWeights", "TrainerWindowState"]
    assert internal_mentions("`acc.window`, `ExactTrainer`, `WindowSampler`, `accelerator.prepare`", private) == []
