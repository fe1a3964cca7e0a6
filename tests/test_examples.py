"""The examples a newcomer reads first must run and say what they claim."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str) -> str:
    return subprocess.run([sys.executable, str(EXAMPLES / name)], check=True, capture_output=True,
                          text=True, timeout=120).stdout


def test_accelerate_toy_regression_reaches_2_04_both_ways():
    out = run("accelerate_toy_regression.py")
    assert "w/ accumulation, the final model weight is 2.04000" in out
    assert "w/o accumulation, the final model weight is 2.04000" in out


@pytest.mark.parametrize("name", ["plain_loop.py", "train_loop.py"])
def test_examples_run(name):
    assert "loss" in run(name)
