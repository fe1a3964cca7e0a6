"""The integration examples run and print what the guides promise: the integration one big
batch to rounding, the framework's own accumulation measurably not; and the guides' transcripts of
them are what they print (tests/transcripts.py)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from transcripts import assert_quoted

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name, ours, theirs, guide", [
    ("lightning_gpt2.py", "ExactAccumulation", "Lightning's own accumulation", "lightning.md"),
    ("hf_trainer_gpt2.py", "ExactTrainer", "stock Trainer", "hf-trainer.md"),
])
def test_example_prints_exact_and_native_deltas_as_its_guide_quotes(name, ours, theirs, guide):
    for module in ("transformers", "pytorch_lightning" if name.startswith("lightning") else "transformers"):
        pytest.importorskip(module)
    out = subprocess.run([sys.executable, str(EXAMPLES / name)], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    found = re.search(rf"{ours} (\S+), {theirs} (\S+)$", out, re.M)
    assert found, out
    exact, native = map(float, found.groups())
    assert exact < 1e-12 and native > 1e-4, out
    assert_quoted(guide, name, out)


def test_trl_example_prints_both_trainers_near_one_big_batch():
    """examples/trl_sft_dpo.py with TRL's own fused LM head: about 1e-9 (that kernel's float32 rounding,
    docs/guides/trl.md), against the stock trainers' 1e-3."""
    pytest.importorskip("trl")
    out = subprocess.run([sys.executable, str(EXAMPLES / "trl_sft_dpo.py")], check=True, capture_output=True,
                         text=True, timeout=300).stdout
    for ours, theirs in (("ExactSFTTrainer", "stock SFTTrainer"), ("ExactDPOTrainer", "stock DPOTrainer")):
        found = re.search(rf"{ours} (\S+), {theirs} (\S+)$", out, re.M)
        assert found, out
        exact, native = map(float, found.groups())
        assert exact < 1e-7 and native > 1e-4, out
