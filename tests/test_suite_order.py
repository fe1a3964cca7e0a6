"""The suite's own plumbing (tests/conftest.py): make test starts the longest modules first, from the
times in tests/module_seconds.json, and keeps that order on its two workers."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from conftest import MODULE_SECONDS, order_by_module_seconds

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_with_a_time_exists():
    """A module renamed or removed leaves no stale time behind (the new name would count as the median)."""
    seconds = json.loads(Path(MODULE_SECONDS).read_text())
    assert seconds, "tests/module_seconds.json is empty: run make test-times"
    missing = sorted(m for m in seconds if not (ROOT / m).is_file())
    assert not missing, (f"tests/module_seconds.json names modules that are gone: {missing}; remove their lines "
                         "(a renamed module: give the new name the old one's seconds), or run make test-times")


def test_the_longest_modules_start_first_and_a_module_keeps_its_own_order():
    seconds = {"tests/test_short.py": 1.0, "tests/test_middle.py": 5.0, "tests/test_long.py": 90.0}
    modules = ["tests/test_short.py", "tests/test_new.py", "tests/test_long.py", "tests/test_middle.py"]
    items = [SimpleNamespace(nodeid=f"{m}::test_{i}") for m in modules for i in (2, 1)]
    order_by_module_seconds(items, seconds)
    # the module without a time counts as the median (5.0); of two equal ones, the one collected first
    assert [item.nodeid.split("::")[0] for item in items[::2]] == [
        "tests/test_long.py", "tests/test_new.py", "tests/test_middle.py", "tests/test_short.py"]
    assert [item.nodeid.split("::")[1] for item in items] == ["test_2", "test_1"] * 4


def test_make_test_keeps_that_order_on_its_workers():
    """pytest-xdist's loadscope sorts the modules by their number of tests unless told not to."""
    makefile = (ROOT / "Makefile").read_text()
    args = re.search(r"^TEST_ARGS\s*:?=(.*)$", makefile, re.M)
    assert args and "--dist loadscope" in args.group(1) and "--no-loadscope-reorder" in args.group(1), makefile
    assert re.search(r"^test: .*\n\t\$\(PY\) -m pytest \$\(TEST_ARGS\)$", makefile, re.M), makefile


def test_this_run_was_collected_longest_module_first(request):
    """The hook is in place: this session's own tests stand in that order (whatever ran with them)."""
    seconds = json.loads(Path(MODULE_SECONDS).read_text())
    known = sorted(seconds.values())
    median = known[len(known) // 2]
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in request.session.items))
    times = [seconds.get(m, median) for m in modules]
    assert times == sorted(times, reverse=True), list(zip(modules, times))
