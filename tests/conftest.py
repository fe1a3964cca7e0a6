"""Settings every test shares, so that a comparison never depends on the machine it runs on.

* One intra-op thread, here and in every subprocess (torchrun workers, the command line): a float32
  reduction rounds differently with a different thread count, so both sides of a comparison must run
  with the same one. The variables are set before torch is imported and inherited by subprocesses.
* Every test starts from the same seeds (torch, random): nothing depends on the order tests run in.
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

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

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


def pytest_runtest_logreport(report):
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import datetime

    os.makedirs(os.path.dirname(FAILURES_LOG), exist_ok=True)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(FAILURES_LOG, "a") as log:
        log.write(f"==== {when} FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-20000:]}\n\n")
