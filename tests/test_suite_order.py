"""The suite's own plumbing (tests/conftest.py): make test starts the longest modules first, from the
times in tests/module_seconds.json, and keeps that order on its two workers."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import (MODULE_SECONDS, TORCHRUN_SCOPE, binds_scenario_tests, order_by_module_seconds, scope_of,
                      torchrun_modules)

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
    assert re.search(r"^test: .*\n(\t.*\n)*?\t\$\(PY\) -m pytest \$\(TEST_ARGS\)$", makefile, re.M), makefile


def test_the_torchrun_scenario_modules_are_one_scope_started_by_their_summed_time():
    """Two torchrun scenario modules (one launch between them) sort as one scope of their summed
    seconds, before a single module longer than either, each the longer first inside it."""
    seconds = {"tests/test_long.py": 90.0, "tests/a/test_s1.py": 50.0, "tests/a/test_s2.py": 60.0}
    torchrun = frozenset({"tests/a/test_s1.py", "tests/a/test_s2.py"})
    modules = ["tests/a/test_s1.py", "tests/test_long.py", "tests/a/test_s2.py"]
    items = [SimpleNamespace(nodeid=f"{m}::test_{i}") for m in modules for i in (2, 1)]
    order_by_module_seconds(items, seconds, torchrun)
    assert [item.nodeid.split("::")[0] for item in items[::2]] == [
        "tests/a/test_s2.py", "tests/a/test_s1.py", "tests/test_long.py"]
    assert {scope_of(item.nodeid, torchrun) for item in items[:4]} == {TORCHRUN_SCOPE}


def test_every_module_that_launches_scenarios_is_in_the_shared_launch():
    """A scenario module is found by the call of scenario_tests at its top level (a new one joins the shared
    launch); a module that only names it (this one) is not."""
    found = torchrun_modules()
    expected = {"tests/distributed/test_distributed.py", "tests/distributed/test_cached.py",
                "tests/distributed/test_stacks.py", "tests/distributed/test_coupled_trainers.py",
                "tests/distributed/test_deepspeed.py", "tests/distributed/test_pipeline.py",
                "tests/integrations/test_distributed.py",
                "tests/integrations/test_moe_distributed.py", "tests/integrations/test_grpo_distributed.py"}
    assert found == expected, found ^ expected
    worker_files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*_worker.py")} | {
        "tests/distributed/worker.py"}
    named = {m for m in found if any(w in (ROOT / m).read_text() for w in worker_files)}
    assert named == found, "each scenario module names its worker"
    assert binds_scenario_tests('verdicts, test_scenario = scenario_tests("w.py", ["a"])\n')
    assert not binds_scenario_tests('"""calls scenario_tests(...) elsewhere"""\nX = "= scenario_tests("\n')
    assert not binds_scenario_tests('def f():\n    v = scenario_tests("w.py", [])\n')


def test_this_run_was_collected_longest_scope_first(request):
    """The hook is in place: this session's own tests stand in that order (whatever ran with them):
    scopes by their summed seconds, the modules of a scope by their own."""
    seconds = json.loads(Path(MODULE_SECONDS).read_text())
    known = sorted(seconds.values())
    median = known[len(known) // 2]
    torchrun = torchrun_modules()
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in request.session.items))
    scopes = list(dict.fromkeys(scope_of(m, torchrun) for m in modules))
    summed = [sum(seconds.get(m, median) for m in modules if scope_of(m, torchrun) == s) for s in scopes]
    assert summed == sorted(summed, reverse=True), list(zip(scopes, summed))
    for scope in scopes:
        times = [seconds.get(m, median) for m in modules if scope_of(m, torchrun) == scope]
        assert times == sorted(times, reverse=True), (scope, times)


def test_the_shared_launch_is_read_per_worker_with_its_end_marker():
    """Each worker's verdicts are the lines between its header and its footer; a worker whose footer never
    came (the launch died in it) is read as unfinished, so its tests see the launch's exit code."""
    from distributed.launch import WORKER_FOOTER, WORKER_HEADER, _section, verdict_lines

    out = "\n".join([f"{WORKER_HEADER}/a.py", "PASS one: 1e-17", "FAIL two: off", f"{WORKER_FOOTER}/a.py",
                     f"{WORKER_HEADER}/b.py", "PASS three: x: y", "noise line"])
    read = verdict_lines(out)
    assert read["/a.py"] == ({"one": ("PASS", "PASS one: 1e-17"), "two": ("FAIL", "FAIL two: off")}, True)
    assert read["/b.py"] == ({"three": ("PASS", "PASS three: x: y")}, False)
    err = f"start\n{WORKER_HEADER}/a.py\ntraceback of a\n{WORKER_FOOTER}/a.py\n{WORKER_HEADER}/b.py\nof b\n"
    assert "traceback of a" in _section(err, "/a.py") and "of b" not in _section(err, "/a.py")


def test_a_pytest_xdist_worker_knows_the_dist_mode(request):
    """Under pytest-xdist a worker's own --dist reads "no": the controller hands it the mode, without which the
    scenario modules would each launch their own worker (make test measured 6:21 with 8 launches, not one)."""
    worker = getattr(request.config, "workerinput", None)
    if worker is None:
        pytest.skip("not a pytest-xdist worker")
    argv = worker["mainargv"]
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("--dist=")), None) or next(
        (argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--dist"), None)
    assert worker.get("gradaccum_dist") == (given or "no"), (worker.get("gradaccum_dist"), argv)


def test_a_test_starts_with_the_imported_modules_out_of_the_collector_s_reach():
    """tests/conftest.py freezes what lives before each test, so that a Trainer's full gc.collect() per
    train() does not walk torch's and transformers' objects again (the torchrun scenarios do the same
    before each scenario, distributed/launch.py). The freeze collects first, so the garbage a test
    leaves is freed, not frozen; the collector stays on for what the test itself makes."""
    import gc
    import weakref

    from distributed.launch import freeze_the_living

    assert gc.get_freeze_count() > 100_000  # torch alone holds more objects than that
    assert gc.isenabled()

    class Node:
        pass

    def dropped_cycle() -> weakref.ref:
        cycle = Node()
        cycle.self = cycle
        return weakref.ref(cycle)

    left_behind = dropped_cycle()  # what an earlier test left: freed by the next freeze, not kept by it
    freeze_the_living()
    assert left_behind() is None
    made_here = dropped_cycle()
    gc.collect()
    assert made_here() is None  # a cycle the test made and dropped is still collected
