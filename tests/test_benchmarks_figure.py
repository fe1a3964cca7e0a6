"""docs/benchmarks.png is drawn so that it does not mislead (issue #40 item 9): redrawn here from
docs/benchmarks.json by the code that draws it (benchmarks/report.py, ``python benchmarks/report.py``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def figure(tmp_path_factory):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    results = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    fig = report.plot(results, tmp_path_factory.mktemp("figure") / "benchmarks.png")
    yield fig
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_speed_axis_starts_at_0(figure):
    speed = figure.axes[2]
    assert "speed" in speed.get_title()
    assert speed.get_ylim()[0] == 0  # a 20 % difference looked like 10x on an axis from 31,600


def test_every_panel_says_what_n_is_and_the_distance_panel_says_float32(figure):
    assert all("N" in ax.get_xlabel() and "micro-batches" in ax.get_xlabel() for ax in figure.axes)
    assert "float32" in figure.axes[3].get_title()


def test_no_pale_lines_and_no_two_methods_on_one_point(figure):
    distance = figure.axes[3]
    assert all(line.get_alpha() in (None, 1.0) for ax in figure.axes for line in ax.get_lines())
    first_x = [line.get_xdata()[0] for line in distance.get_lines()]
    per_model = len(first_x) // 2
    assert len(set(first_x[:per_model])) == per_model  # at N = 1 every method is one batch: moved apart


def test_no_benchmark_launches_through_the_tests_distributed_package():
    """Under benchmarks/run.py the module name ``distributed`` is benchmarks/distributed.py, so a section
    that imported the tests' ``distributed.launch`` stopped make bench there (grpo and precision did):
    the sections launch torchrun through benchmarks/common.py's ``torchrun``."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    offenders = [p.name for p in sorted(bench.glob("*.py"))
                 if "from distributed.launch import" in p.read_text() or "import distributed.launch" in p.read_text()]
    assert not offenders, offenders
