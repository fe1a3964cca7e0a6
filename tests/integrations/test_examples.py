"""The integration examples run and print what the guides promise: the integration one big
batch to rounding, the framework's own accumulation measurably not; and the guides' transcripts of
them are what they print (tests/transcripts.py)."""
from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
import warnings
from pathlib import Path

import pytest

from transcripts import assert_quoted

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _reset_accelerate() -> None:
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def run_here(name: str) -> str:
    """examples/NAME run as ``__main__`` in this process, as from a reader's fresh interpreter: its
    printed output. What it prints is what these tests are about, not its process; a process would cost
    the imports of torch, transformers, Lightning or TRL again (5-10 CPU seconds each). The process-wide
    state these examples touch is put back after them: Accelerate's singletons (which a Trainer of an
    earlier test leaves behind, and the example's Trainer sets; reset before and after, as
    tests/test_guides.py's ``fresh_accelerate``), transformers' logging level, the warning filters. The
    seeds are every test's own (tests/conftest.py); the examples' ``torch.set_num_threads(1)`` is the
    suite's own setting."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    out = io.StringIO()
    _reset_accelerate()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        transformers.logging.set_verbosity(verbosity)
        _reset_accelerate()
    return out.getvalue()


@pytest.mark.parametrize("name, ours, theirs, guide", [
    ("lightning_gpt2.py", "ExactAccumulation", "Lightning's own accumulation", "lightning.md"),
    ("hf_trainer_gpt2.py", "ExactTrainer", "stock Trainer", "hf-trainer.md"),
])
def test_example_prints_exact_and_native_deltas_as_its_guide_quotes(name, ours, theirs, guide):
    for module in ("transformers", "pytorch_lightning" if name.startswith("lightning") else "transformers"):
        pytest.importorskip(module)
    out = run_here(name)
    found = re.search(rf"{ours} (\S+), {theirs} (\S+)$", out, re.M)
    assert found, out
    exact, native = map(float, found.groups())
    assert exact < 1e-12 and native > 1e-4, out
    assert_quoted(guide, name, out)


def test_trl_example_prints_both_trainers_near_one_big_batch():
    """examples/trl_sft_dpo.py with TRL's own fused LM head: about 1e-9 (that kernel's float32 rounding,
    docs/guides/trl.md), against the stock trainers' 1e-3."""
    pytest.importorskip("trl")
    out = run_here("trl_sft_dpo.py")
    for ours, theirs in (("ExactSFTTrainer", "stock SFTTrainer"), ("ExactDPOTrainer", "stock DPOTrainer")):
        found = re.search(rf"{ours} (\S+), {theirs} (\S+)$", out, re.M)
        assert found, out
        exact, native = map(float, found.groups())
        assert exact < 1e-7 and native > 1e-4, out
