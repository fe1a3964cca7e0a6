"""The examples a newcomer reads first must run and say what they claim."""
from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import pytest

from transcripts import DOCS, assert_figure

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_here(name: str) -> str:
    """examples/NAME run as ``__main__`` in this process: its printed output. For an example that
    leaves no process-wide state behind (no singleton such as Accelerate's, no logging level, no
    environment variable; the seeds are every test's own, tests/conftest.py); it saves a process's
    imports (torch and torch._dynamo: about 4 CPU seconds)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return out.getvalue()


def test_accelerate_toy_regression_reaches_2_04_both_ways():
    """Accelerate's toy regression, without Accelerate: plain torch and gradaccum, no process-wide state."""
    out = run_here("accelerate_toy_regression.py")
    assert "w/ accumulation, the final model weight is 2.04000" in out
    assert "w/o accumulation, the final model weight is 2.04000" in out


@pytest.mark.parametrize("name", ["plain_loop.py", "train_loop.py"])
def test_examples_run(name):
    assert "loss" in run_here(name)


def test_hf_causal_lm_gradaccum_is_one_big_batch_and_the_naive_loop_is_not():
    pytest.importorskip("transformers")
    out = run_here("hf_causal_lm.py")
    assert "14 micro-batches of 4, windows of 4: 8 optimizer steps" in out
    assert len(re.findall(r"^step \d+: loss \d\.\d+ over \d+ tokens$", out, re.M)) == 8
    found = re.search(r"distance from one big batch per window: gradaccum (\S+), naive loss/4 loop (\S+)$", out, re.M)
    assert found, out
    ours, naive = map(float, found.groups())
    assert ours < 1e-10 and naive > 1e-2, out


def test_contrastive_window_loss_is_one_big_batch_and_plain_accumulation_is_not():
    out = run_here("contrastive.py")
    assert len(re.findall(r"^step \d+: loss \d+\.\d+ over 64 pairs in 4 micro-batches$", out, re.M)) == 8, out
    found = re.search(r"WindowLoss (\S+), plain accumulation (\S+)$", out, re.M)
    assert found, out
    ours, plain = map(float, found.groups())
    assert ours < 1e-12 and plain > 1e-2, out
    # it learns: on pairs it never trained on, the loss falls below chance and the classes are told apart
    held = re.findall(r"^held-out pairs (?:before training|after 8 steps): loss (\S+) \(chance (\S+)\), top caption "
                      r"of the image's class (\d+)% \(chance 12.5%\)$", out, re.M)
    assert len(held) == 2, out
    (before, chance, _), (after, _, matched) = held
    assert float(after) < float(chance) < float(before) and int(matched) >= 90, out
    # the contrastive guide quotes the two distances (a rounding-level one by its order only: tests/transcripts.py)
    guide = (DOCS / "guides" / "contrastive.md").read_text()
    quote_text = guide[guide.index("`examples/contrastive.py`"):][:600]
    quoted = re.findall(r"\d(?:\.\d+)?e-\d+", quote_text)[:2]
    assert len(quoted) == 2, "docs/guides/contrastive.md no longer quotes examples/contrastive.py's two distances"
    for quote, figure in zip(quoted, found.groups()):
        assert_figure(quote, figure, "docs/guides/contrastive.md")
