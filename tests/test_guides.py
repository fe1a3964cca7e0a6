"""Every ```python block of the guides runs as it is written (issue #40 item 6).

A guide's blocks run in order in one namespace (a block may build on the ones above it), in a
temporary directory (a block that saves ``ckpt.pt`` leaves nothing behind). A block that cannot run
here says so, and why, in an HTML comment on the line right before its fence (invisible on the site):

* ``<!-- not run: REASON -->``: a fragment (a signature, a line that needs the reader's own model),
  or a block that needs a GPU. The reason is required.
* ``<!-- run under torchrun -->``: a script for ``torchrun --nproc_per_node=2``; it runs as written on
  the 2 gloo processes of the suite's one torchrun launch, in a scenario :data:`TORCHRUN_SCENARIOS`
  names (tests/distributed/launch.py, ``run_guide_torchrun_blocks``: the group is joined already, so
  its ``init_process_group`` and ``destroy_process_group`` stand aside).
* ``<!-- run after: GUIDE.md -->``: the block uses names the first block of another guide defines
  (the Lightning recipe uses the contrastive guide's ``TwoTowers`` and ``clip_loss``); that block runs
  first, in the same namespace.
* ``<!-- run with: SETUP -->``: a fragment whose names (``model``, ``args``, ``ds``...) are the
  reader's; ``tests/guide_setups.py``'s ``SETUP(tmp_path)`` gives the smallest of each, then the block
  runs as written.

Any other comment before a fence, or ``not run`` without a reason, fails :func:`test_every_block_is_run_or_says_why`.
What a block computes is checked where it matters (the Lightning recipe below is one float64 big batch
per window); the guides' quoted numbers are checked in tests/test_examples.py and
tests/integrations/test_examples.py against what the examples print.
"""
from __future__ import annotations

import copy
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from distributed.launch import GUIDE_TORCHRUN

GUIDES = Path(__file__).resolve().parent.parent / "docs" / "guides"
# moe.md, contrastive.md and sentence-transformers.md run in their own tests (test_cached_guide.py, ...)
OWNED = ["accelerate.md", "cli.md", "hf-models.md", "hf-trainer.md", "lightning.md", "own-loop.md",
         "torchrun.md", "train.md", "trl.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!--\s*(.*?)\s*-->")
#: the scenario of the shared torchrun launch that runs a guide's torchrun blocks: (its test module, its name)
TORCHRUN_SCENARIOS = {"torchrun.md": ("tests/distributed/test_distributed.py", "torchrun_guide_runs_as_written"),
                      "pipeline.md": ("tests/distributed/test_pipeline.py", "guide_example_runs_as_written")}


@dataclass
class Block:
    guide: str
    line: int  # of the opening fence, 1-based
    code: str
    marker: Optional[str]  # the HTML comment right before the fence, if any

    @property
    def where(self) -> str:
        return f"docs/guides/{self.guide}:{self.line}"


def blocks(guide: str) -> List[Block]:
    text = (GUIDES / guide).read_text()
    found = []
    for m in FENCE.finditer(text):
        line_before = text[:m.start()].rstrip("\n").rpartition("\n")[2]
        marker = MARKER.fullmatch(line_before.strip())
        found.append(Block(guide, text.count("\n", 0, m.start()) + 1, m.group(1),
                           marker.group(1) if marker else None))
    return found


def kind(block: Block) -> str:
    """"run", "torchrun", "after" or "not run"; anything else is a mistake in the guide."""
    if block.marker is None:
        return "run"
    if block.marker == GUIDE_TORCHRUN:
        return "torchrun"
    if re.fullmatch(r"run after: [\w.-]+\.md", block.marker):
        return "after"
    if re.fullmatch(r"run with: \w+", block.marker):
        return "with"
    if re.fullmatch(r"not run: \S.{9,}", block.marker, re.S):
        return "not run"
    raise AssertionError(f"{block.where}: the comment before the block, <!-- {block.marker} -->, is not one of "
                         "'not run: <why, 10 characters or more>', 'run under torchrun', 'run after: GUIDE.md', "
                         "'run with: SETUP' (tests/test_guides.py)")


def test_every_block_is_run_or_says_why():
    every = [b for g in OWNED for b in blocks(g)]
    assert len(every) >= 20, "the guides' python blocks were not found"
    for b in every:
        kind(b)  # raises, naming the block, on a comment that is none of the three


def _exec(block: Block, namespace: Dict) -> None:
    code = compile(block.code, block.where, "exec")
    exec(code, namespace)  # noqa: S102 - our own documentation


def run_guide(guide: str, tmp_path, monkeypatch) -> Dict:
    """Run the guide's blocks that run in this process, in order, in one namespace; return it."""
    monkeypatch.chdir(tmp_path)
    namespace: Dict = {"__name__": "guide"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in blocks(guide):
            k = kind(block)
            if k == "after":
                _exec(blocks(block.marker.split(": ", 1)[1])[0], namespace)
            if k == "with":
                import guide_setups

                namespace.update(getattr(guide_setups, block.marker.split(": ", 1)[1])(tmp_path))
            if k in ("run", "after", "with"):
                _exec(block, namespace)
    return namespace


@pytest.fixture
def fresh_accelerate():
    """A guide runs as in a reader's fresh interpreter: Accelerate's process-wide state, which a Trainer
    built by an earlier test of this process leaves behind (mixed_precision="bf16" from the GRPO tests made
    accelerate.md's ``Accelerator()`` refuse to start), is reset before the guide and after it."""
    def reset():
        state = sys.modules.get("accelerate.state")
        if state is not None:
            state.AcceleratorState._reset_state(reset_partial_state=True)
            state.GradientState._reset_state()
    reset()
    yield
    reset()


# the guides with a block that runs here (the Lightning guide's run in the recipe's test below), and the
# package each needs beyond torch
RUNNABLE = {"accelerate.md": "accelerate", "hf-models.md": "transformers", "hf-trainer.md": "transformers",
            "own-loop.md": None, "train.md": None}


def test_the_runnable_guides_are_listed():
    runnable = {g for g in OWNED for b in blocks(g) if kind(b) not in ("not run", "torchrun")}
    assert runnable == set(RUNNABLE) | {"lightning.md"}


def test_every_torchrun_block_is_run_by_a_scenario_of_the_shared_launch():
    """A guide's torchrun blocks run in the suite's one torchrun launch (tests/distributed/launch.py,
    ``run_guide_torchrun_blocks``), in the scenario :data:`TORCHRUN_SCENARIOS` names for the guide: the
    scenario is one its test module lists, and its worker runs that guide's blocks."""
    with_torchrun = {p.name for p in GUIDES.glob("*.md") if any(kind(b) == "torchrun" for b in blocks(p.name))}
    assert with_torchrun == set(TORCHRUN_SCENARIOS)
    root = GUIDES.parents[1]
    for guide, (module, scenario) in TORCHRUN_SCENARIOS.items():
        test_module = (root / module).read_text()
        assert f'"{scenario}"' in test_module, (guide, module, scenario)
        worker = re.search(r'^WORKER = "(.+)"', test_module, re.M).group(1)
        body = (root / worker).read_text().split(f"def {scenario}(", 1)[1].split("\ndef ", 1)[0]
        assert f'run_guide_torchrun_blocks("{guide}")' in body, (guide, worker, scenario)


@pytest.mark.parametrize("guide", sorted(RUNNABLE))
def test_guide_runs(guide, tmp_path, monkeypatch, fresh_accelerate):
    if RUNNABLE[guide]:
        pytest.importorskip(RUNNABLE[guide])
    ns = run_guide(guide, tmp_path, monkeypatch)
    if guide == "hf-trainer.md":  # the last block builds the WindowLoss trainer of one's own model: it trains
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ns["trainer"].train()
        assert ns["trainer"].state.global_step == 2


def test_the_lightning_recipe_for_a_coupled_loss_is_one_big_batch_per_window(tmp_path, monkeypatch):
    """The recipe as written (with the contrastive guide's TwoTowers and clip_loss) fitted on 3
    windows of 40 pairs in micro-batches of 16 (16, 16, 8): the float64 big batch's AdamW steps, clipped
    at 1.0, to rounding; the recipe with each micro-batch's own clip_loss (plain accumulation) is not."""
    pl = pytest.importorskip("pytorch_lightning")
    ns = run_guide("lightning.md", tmp_path, monkeypatch)
    clip_loss = ns["clip_loss"]
    g = torch.Generator().manual_seed(3)
    windows = [(torch.randn(40, 32, generator=g, dtype=torch.float64),
                torch.randn(40, 24, generator=g, dtype=torch.float64)) for _ in range(3)]

    def fit(module):
        trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, torch.utils.data.DataLoader(windows, batch_size=None))
        return trainer

    torch.manual_seed(0)
    module = ns["Contrastive"]().double()
    reference = copy.deepcopy(module.encoder)
    plain = ns["Contrastive"]().double()
    plain.encoder.load_state_dict(module.encoder.state_dict())
    plain.window_loss = lambda model, micro_batch: clip_loss(plain.encoder, model(*micro_batch))
    trainer = fit(module)
    fit(plain)

    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for images, captions in windows:
        optimizer.zero_grad()
        clip_loss(reference, reference(images, captions)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()

    def distance(a):
        return max((p - q).abs().max().item() for p, q in zip(a.parameters(), reference.parameters()))

    assert trainer.global_step == 3
    assert distance(module.encoder) < 1e-12, distance(module.encoder)
    assert distance(plain.encoder) > 1e-4, distance(plain.encoder)


if __name__ == "__main__":  # list each block and what the suite does with it
    for g in OWNED:
        for b in blocks(g):
            print(f"{b.where:40s} {kind(b)}", file=sys.stdout)


def benchmark(section: str):
    """``benchmarks/<section>.py`` as a module (its imports found beside it), and the section's record in
    docs/benchmarks.json: what a guide's table, written by ``make bench``, is held to."""
    import importlib.util
    import json

    folder = GUIDES.parent.parent / "benchmarks"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"{section}_bench", folder / f"{section}.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(folder))
    return bench, json.loads((GUIDES.parent / "benchmarks.json").read_text())[section]


def test_the_contrastive_guides_table_is_what_the_benchmark_renders():
    """docs/guides/contrastive.md's WindowLoss table, and the figures its text compares, are
    ``benchmarks/contrastive.py``'s rendering of the recorded run (docs/benchmarks.json): a ratio edited by hand,
    or a record the guide was not rewritten from, fails here."""
    bench, recorded = benchmark("contrastive")
    section = (GUIDES / "contrastive.md").read_text().split(bench.GUIDE[0])[1].split(bench.GUIDE[1])[0]
    assert section == "\n" + bench.render_guide(recorded)
    assert "| 64 | `keep_graphs=1` (the default) |" in section  # both widths, each keep setting named


def test_the_trl_guides_grpo_table_is_what_the_benchmark_renders():
    """docs/guides/trl.md's GRPO table and DDP lines are ``benchmarks/grpo.py``'s rendering of the recorded run
    (docs/benchmarks.json): a number or a scenario edited by hand, or a scenario the worker no longer runs
    left in the record, fails here."""
    import ast

    bench, recorded = benchmark("grpo")
    section = (GUIDES / "trl.md").read_text().split(bench.START)[1].split(bench.END)[0]
    assert section == "\n" + bench.render(recorded)
    # the DDP lines are the scenarios test_grpo_distributed.py asserts, no more (read from its source: importing
    # it imports TRL)
    tree = ast.parse((GUIDES.parent.parent / "tests" / "integrations" / "test_grpo_distributed.py").read_text())
    values = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id == "LOSS_TYPES"}
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.fullmatch(r"(grpo|rloo)_ddp_\w+", n.value)}
    listed = named | {f"grpo_ddp_{lt}_kl_entropy" for lt in values["LOSS_TYPES"]}
    assert {line.split(":")[0].split()[1] for line in recorded["two_processes"]} == listed
