"""docs/guides/moe.md runs as written (#40 item 6): every ```python block, in order, in one namespace
(the first builds a tiny float64 Mixtral, which needs the eager experts the guide names), and what the
guide says they print is what they print. The measured section between its markers is what
``benchmarks/moe.py`` renders from the recorded run (docs/benchmarks.json), so its numbers are printed
by code, not typed."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "moe.md"


def _blocks() -> list:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def test_every_code_block_runs_and_prints_what_the_guide_says(capsys):
    text = " ".join(GUIDE.read_text().split())
    namespace = {"__name__": "guide"}
    blocks = _blocks()
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)  # noqa: S102 - our own documentation
    lines = capsys.readouterr().out.splitlines()
    # acc.train over 8 micro-batches of 2 sequences (11 targets each), accum_steps=4
    assert lines[:2] == ["4 88", "4 88"], lines
    assert "prints `4 88` twice: two windows of 4 micro-batches, 88 next-token targets each" in text
    verdict = lines[2]
    assert verdict.startswith("equivalent: max relative gradient difference "), lines
    assert float(verdict.split()[5]) < 1e-14, verdict
    assert "The first line printed starts `equivalent: max relative gradient difference` with a difference below " \
           "1e-14 in float64; the per-micro-batch mode prints `False`" in text
    assert lines[-1] == "False", lines


def test_the_float64_model_needs_the_eager_experts_the_guide_names():
    """Without ``experts_implementation="eager"`` the guide's float64 model fails as the guide says."""
    setup = _blocks()[0]
    assert 'experts_implementation="eager"' in setup
    namespace = {"__name__": "guide"}
    exec(compile(setup.replace('experts_implementation="eager"', "experts_implementation=None"),  # noqa: S102
                 str(GUIDE), "exec"), namespace)
    with pytest.raises(RuntimeError, match="Expected mat_a to be Float32, BFloat16 or Float16"):
        namespace["model"](**namespace["micro_batch"](1, 5))
    assert "Expected mat_a to be Float32, BFloat16 or Float16" in " ".join(GUIDE.read_text().split())


def test_the_measured_section_is_what_the_benchmark_renders():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("moe_bench", ROOT / "benchmarks" / "moe.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    recorded = json.loads((ROOT / "docs" / "benchmarks.json").read_text())["moe"]
    section = GUIDE.read_text().split(bench.START)[1].split(bench.END)[0]
    assert section == "\n" + bench.render(recorded)
    assert "(moe_expert_share.png)" in section and (GUIDE.parent / "moe_expert_share.png").exists()
