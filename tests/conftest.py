"""Settings every test shares, so that a comparison never depends on the machine it runs on.

* One intra-op thread, here and in every subprocess (torchrun workers, the command line): a float32
  reduction rounds differently with a different thread count, so both sides of a comparison must run
  with the same one. The variables are set before torch is imported and inherited by subprocesses.
* Every test starts from the same seeds (torch, random): nothing depends on the order tests run in.
* DeepSpeed's CPU communication op is built into this virtual environment (``TORCH_EXTENSIONS_DIR``, as
  the Makefile's install builds it): torch's default, ``~/.cache/torch_extensions``, is one folder per
  machine, where each checkout's build replaces another's and is built again inside the next one's run.
* What the tests and their subprocesses write with ``tempfile`` (a Trainer's ``output_dir``, a torchrun
  worker's folder) goes into one folder per run, removed when the run ends: the workers end with
  ``os._exit`` and leave their folders behind, tens of thousands of them in ``/tmp`` over many runs.
  pytest's own ``tmp_path`` folders stay where pytest keeps them (its last three runs, to look into).
"""
import os
import random
import signal
import sys
import threading

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"  # forced, not defaulted: the in-process side must equal the subprocesses
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.pop("GRADACCUM_DEBUG", None)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

from distributed.launch import freeze_the_living  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _same_start():
    """Seed every test, and leave the process's torch defaults as found."""
    torch.manual_seed(0)
    random.seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    assert torch.get_num_threads() == 1, "a test changed the thread count"


@pytest.fixture(autouse=True)
def _garbage_of_earlier_tests_collected_the_rest_frozen():
    """Each test starts with the process's objects frozen out of the cyclic collector's reach
    (tests/distributed/launch.py, ``freeze_the_living``): every ``Trainer.train()`` runs a full
    ``gc.collect()``, which otherwise walks every object of torch, transformers and TRL each time."""
    freeze_the_living()
    yield


@pytest.fixture(autouse=True)
def _ctrl_c_as_at_a_terminal():
    """SIGINT as a command typed at a terminal gets it: Python's KeyboardInterrupt handler here, and
    (a handler is reset to the default on exec) the default in every subprocess a test starts. A
    suite started in the background (``make test &``, a script) inherits SIGINT ignored, which
    gradaccum rightly keeps ignoring; the tests that send SIGINT are about a run started at a terminal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


# Property-based tests (tests/test_properties.py): "ci" is the default, fixed-seed and small, so a run
# is the same on every machine; HYPOTHESIS_PROFILE=dev draws many more windows when hunting a bug.
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # only test_properties.py needs it (the `test` extra installs it)
    pass
else:
    _common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", max_examples=25, derandomize=True, database=None, **_common)
    settings.register_profile("dev", max_examples=500, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# A failed test is written down where a lost console cannot take it with it: a suite run once ended
# '1 failed, 695 passed' and the log was not kept, so which test failed was never known (#40 item 11).
# Each failure (the test, when, its whole report: for a torchrun test the failed ranks and their error
# lines, tests/distributed/launch.py) is appended to .pytest_cache/gradaccum-failures.log (ignored by
# git), by the process that prints the summary (under pytest-xdist the controller, not the workers).
FAILURES_LOG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                            "gradaccum-failures.log")


def pytest_configure(config):
    """One scratch folder for the run's temporary files (see the module's docstring), made by the process
    that starts the run and inherited by every process below it. Then refuse to start where a build of DeepSpeed's op was killed part-way: torch's build waits, without a
    timeout, for the lock file it left, and every DeepSpeed test with it."""
    import tempfile
    import time

    if not os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get(SCRATCH):
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())  # tmp_path: where pytest keeps it
        os.environ[SCRATCH] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="gradaccum-tests-")
        tempfile.tempdir = None  # read TMPDIR again
        config.stash[_MADE] = os.environ[SCRATCH]
    lock = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "deepspeed_shm_comm", "lock")
    if os.environ.get("PYTEST_XDIST_WORKER") or not os.path.exists(lock):
        return
    minutes = (time.time() - os.path.getmtime(lock)) / 60
    if minutes > STALE_BUILD_MINUTES:
        raise pytest.UsageError(f"{lock} is {minutes:.0f} minutes old: a build of DeepSpeed's CPU op was stopped "
                                f"part-way and the DeepSpeed tests would wait on it for ever; remove it (rm {lock})")


def pytest_unconfigure(config):
    if _MADE in config.stash:  # this process made it (not a pytest that a test started below the run)
        import shutil

        shutil.rmtree(config.stash[_MADE], ignore_errors=True)


#: names the run's scratch folder, the ``TMPDIR`` of every process of the run (set by the process that starts it)
SCRATCH = "GRADACCUM_TESTS_TMPDIR"
_MADE = pytest.StashKey[str]()
#: a build of the op takes a minute on 2 idle cores; a lock older than this was left by a build that was stopped
STALE_BUILD_MINUTES = 10


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _record_time(report)
    if not report.failed:
        return
    import datetime

    os.makedirs(os.path.dirname(FAILURES_LOG), exist_ok=True)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(FAILURES_LOG, "a") as log:
        log.write(f"==== {when} FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-20000:]}\n\n")


# The order the modules start in (make test: 2 pytest-xdist workers, --dist loadscope, each module on
# one worker). Two workers end together only when the longest modules start first and the short ones
# fill in at the end (longest processing time first): a module of a few long tests (torchrun launches,
# command-line subprocesses) that starts last keeps one worker busy while the other waits (the modules
# sorted by their number of tests started test_global_batch.py, 8 tests and a sixth of the suite's time,
# last; one worker then idled for about 2 of a loaded run's 17 minutes). tests/module_seconds.json holds each module's
# measured seconds (setup, call and teardown of its tests, summed); a module not in it counts as the
# median. The Makefile passes --no-loadscope-reorder, so that xdist keeps this order instead of sorting
# the modules by their number of tests. GRADACCUM_MODULE_SECONDS=write rewrites the file with the times
# of the modules that ran in full (make test-times).
MODULE_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# The torchrun scenario modules (those that call distributed.launch.scenario_tests) share one torchrun
# launch that runs all their workers (tests/distributed/launch.py, shared_verdicts): torch, transformers,
# Lightning, sentence-transformers and DeepSpeed then import once per rank instead of once per module
# (about 70 CPU seconds of the suite's 750). Their tests therefore form one scope, on one pytest-xdist
# worker: TORCHRUN_SCOPE.
TORCHRUN_SCOPE = "torchrun scenarios"
TESTS = os.path.dirname(os.path.abspath(__file__))


def torchrun_modules() -> frozenset:
    """The test modules (node ids, from the repository's root) whose top level binds ``scenario_tests(...)``."""
    found = set()
    root = os.path.dirname(TESTS)
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    if binds_scenario_tests(f.read()):
                        found.add(os.path.relpath(path, root).replace(os.sep, "/"))
    return frozenset(found)


def binds_scenario_tests(source: str) -> bool:
    """Whether a module's top level assigns the result of a ``scenario_tests(...)`` call (not a mention)."""
    import ast

    return "scenario_tests(" in source and any(
        isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "scenario_tests" for node in ast.parse(source).body)


def scope_of(nodeid: str, torchrun: frozenset) -> str:
    """A test's scope under make test: its module, or TORCHRUN_SCOPE for the torchrun scenario modules."""
    module = _module_of(nodeid)
    return TORCHRUN_SCOPE if module in torchrun else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with the torchrun scenario modules in one scope (so their one launch is made once)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    torchrun = torchrun_modules()

    class OneTorchrunLaunch(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return TORCHRUN_SCOPE if _module_of(nodeid) in torchrun else super()._split_scope(nodeid)

    return OneTorchrunLaunch(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tell each pytest-xdist worker the --dist mode (a worker's own option reads "no"), so that the shared
    torchrun launch knows whether its scenario modules were kept together (distributed.launch.shared_verdicts)."""
    node.workerinput["gradaccum_dist"] = node.config.getoption("dist")


def pytest_collection_modifyitems(config, items):
    import json

    try:
        with open(MODULE_SECONDS) as f:
            seconds = json.load(f)
    except FileNotFoundError:
        return
    order_by_module_seconds(items, seconds, torchrun_modules())


def order_by_module_seconds(items, seconds: dict, torchrun: frozenset = frozenset()) -> None:
    """Sort ``items`` in place by scope (:func:`scope_of`), the longest first (a scope's seconds: its
    modules' in ``seconds``, a module not in it counting as the median), and within a scope by module,
    the longest first; a module's own tests keep their order."""
    known = sorted(seconds.values())
    default = known[len(known) // 2] if known else 0.0
    first: dict = {}
    scope_seconds: dict = {}
    for i, item in enumerate(items):
        module = _module_of(item.nodeid)
        if module not in first:
            first[module] = i
            scope = scope_of(item.nodeid, torchrun)
            scope_seconds[scope] = scope_seconds.get(scope, 0.0) + seconds.get(module, default)
            first.setdefault(scope, i)

    def key(item):
        module = _module_of(item.nodeid)
        scope = scope_of(item.nodeid, torchrun)
        return -scope_seconds[scope], first[scope], -seconds.get(module, default), first[module]

    items.sort(key=key)


_ran: dict = {}  # module: [seconds, tests reported]
_collected: set = set()  # under xdist the controller learns the test ids from its workers


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _collected.update(ids)


def _record_time(report) -> None:
    spent = _ran.setdefault(_module_of(report.nodeid), [0.0, set()])
    spent[0] += report.duration
    spent[1].add(report.nodeid)


def pytest_sessionfinish(session):
    if os.environ.get("GRADACCUM_MODULE_SECONDS") != "write" or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    option = session.config.option
    if option.keyword or option.markexpr or any("::" in arg for arg in session.config.args):
        return  # some modules ran in part: their times are not a whole module's
    import json

    collected: dict = {}
    for nodeid in _collected or {item.nodeid for item in session.items}:
        collected.setdefault(_module_of(nodeid), set()).add(nodeid)
    try:
        with open(MODULE_SECONDS) as f:
            seconds = json.load(f)
    except FileNotFoundError:
        seconds = {}
    for module, (spent, tests) in _ran.items():
        if tests >= collected.get(module, {None}):  # every test of the module reported
            seconds[module] = round(spent, 1)
    with open(MODULE_SECONDS, "w") as f:
        json.dump(dict(sorted(seconds.items(), key=lambda kv: -kv[1])), f, indent=1)
        f.write("\n")
