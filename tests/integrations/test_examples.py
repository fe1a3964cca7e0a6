"""The two integration examples run and print what the guides promise: the integration one big
batch to rounding, the framework's own accumulation measurably not."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name, ours, theirs", [
    ("lightning_gpt2.py", "ExactAccumulation", "Lightning's own accumulation"),
    ("hf_trainer_gpt2.py", "ExactTrainer", "stock Trainer"),
])
def test_example_prints_exact_and_native_deltas(name, ours, theirs):
    for module in ("transformers", "pytorch_lightning" if name.startswith("lightning") else "transformers"):
        pytest.importorskip(module)
    out = subprocess.run([sys.executable, str(EXAMPLES / name)], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    found = re.search(rf"{ours} (\S+), {theirs} (\S+)$", out, re.M)
    assert found, out
    exact, native = map(float, found.groups())
    assert exact < 1e-12 and native > 1e-4, out
