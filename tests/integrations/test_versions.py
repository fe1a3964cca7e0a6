"""The frameworks' floors: what the extras declare is what make test-oldest installs (``_versions.FLOORS``), the
docs' table quotes them, and an integration imported on an older version refuses naming it and the fix.
The refusals are checked here by faking the installed version the check reads; make test-oldest runs the
integration tests on the floors themselves."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from gradaccum.integrations import _versions
from gradaccum.integrations._versions import FLOORS, release

ROOT = Path(__file__).resolve().parents[2]


def test_the_extras_declare_the_floors_and_nothing_older():
    """Every mention of a framework in pyproject.toml's extras is ``>=`` its floor, and each floor is declared."""
    extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    declared = re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9.]+)"', extras)
    seen = {name for name, _ in declared if name in FLOORS}
    assert seen == set(FLOORS)
    for name, floor in declared:
        if name in FLOORS:
            assert release(floor) == release(FLOORS[name]), (name, floor, FLOORS[name])


def test_the_docs_table_quotes_the_floors():
    """docs/index.md's "Tested versions" table names each floor as make test-oldest printed it."""
    page = (ROOT / "docs" / "index.md").read_text().split("## Tested versions")[1].split("\n## ")[0]
    rows = dict(re.findall(r"^\| `?([a-z-]+)`? \| ([0-9][0-9.]*)", page, flags=re.M))
    assert {name: rows.get(name) for name in FLOORS} == FLOORS


@pytest.fixture
def fresh_integrations():
    """The integrations imported again in this test, and put back as they were after it."""
    pkg = importlib.import_module("gradaccum.integrations")
    names = [n for n in sys.modules if n.startswith("gradaccum.integrations.") and n != _versions.__name__]
    saved = {n: sys.modules.pop(n) for n in names}
    attrs = {n.rsplit(".", 1)[1]: getattr(pkg, n.rsplit(".", 1)[1], None) for n in names}
    try:
        yield
    finally:
        for n in [n for n in sys.modules if n.startswith("gradaccum.integrations.") and n != _versions.__name__]:
            del sys.modules[n]
        sys.modules.update(saved)
        for a, v in attrs.items():
            setattr(pkg, a, v)


@pytest.mark.parametrize("module, package, old", [
    ("hf_trainer", "transformers", "4.46.3"),  # its Trainer steps across the windows ExactTrainer counted
    ("trl", "transformers", "5.18.0"),  # TRL 1.16 stands a string in for loss_is_scaled_for_ga, which SFT calls
    ("sentence_transformers", "transformers", "5.0.0"),
    ("trl", "trl", "1.15.0"),
    ("trl_rl", "trl", "1.15.0"),
    ("sentence_transformers", "sentence-transformers", "5.7.0"),  # 5.x's module layout
    ("lightning", "pytorch-lightning", "2.4.0"),  # no _Progress.increment_by
])
def test_an_integration_refuses_a_version_older_than_its_floor_naming_it_and_the_fix(
        monkeypatch, fresh_integrations, module, package, old):
    pytest.importorskip(package.replace("pytorch-", "pytorch_").replace("sentence-", "sentence_"))
    real = _versions.installed
    monkeypatch.setattr(_versions, "installed", lambda name: old if name == package else real(name))
    floor = FLOORS[package]
    with pytest.raises(ImportError, match=re.escape(f"{package} {old} is older than {floor}, the oldest tested with "
                                                    f"it; pip install '{package}>={floor}'")):
        importlib.import_module(f"gradaccum.integrations.{module}")


@pytest.mark.parametrize("version", ["5.19.0", "5.19", "5.24.0", "6.0.0.dev0"])
def test_the_floor_and_newer_are_taken(monkeypatch, version):
    monkeypatch.setattr(_versions, "installed", lambda name: version)
    _versions.require("transformers", "ExactTrainer")


def test_a_framework_not_installed_is_left_to_its_import(monkeypatch):
    monkeypatch.setattr(_versions, "installed", lambda name: None)
    _versions.require("transformers", "ExactTrainer")
