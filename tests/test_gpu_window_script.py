"""benchmarks/gpu_window.py, the GPU check issue 48 asks a session with a GPU to run, runs end to end on a
tiny GPT-2 on the CPU (its figures mean nothing here): the script a GPU session starts is known to work."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_every_loop_on_a_tiny_model(capsys):
    pytest.importorskip("transformers")
    saved = list(sys.path)  # the script puts benchmarks/ first, whose distributed.py would shadow tests/distributed
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_window
    finally:
        sys.path[:] = saved
    results = gpu_window.main(["--device", "cpu", "--tiny", "--windows", "2"])
    assert list(results) == ["hand loop", "acc.step", "Trainer, GA 4", "ExactTrainer, GA 4"]
    for r in results.values():
        assert r["device_syncs"] is None and r["host_reads"] == 0 and r["seconds"] > 0  # a CPU tensor's reads are free
    table = capsys.readouterr().out.splitlines()[-4:]
    assert [row.split(" | ")[0] for row in table] == [f"| {name}" for name in results]
