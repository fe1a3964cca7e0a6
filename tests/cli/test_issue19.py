"""A run a user can believe (issue #19): each test failed before its fix. The command line runs as a
subprocess where the process is the point (its exit code with the interpreter's own output: warnings,
tracebacks), in this process (``here``) where what it says, records and writes is."""
from __future__ import annotations

import csv
import json
import math
import textwrap

import pytest

from .test_cli import cli, train_rows

MLP = ["--model", "mlp", "--epochs", "1", "--device", "cpu"]


def strict(text: str):
    """What JSON.parse or jq accept: no NaN, Infinity or -Infinity."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def one_error_line(proc, *pieces: str) -> str:
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for piece in pieces:
        assert piece in proc.stderr, proc.stderr
    return proc.stderr


# -- 1. a diverging run ------------------------------------------------------------------------

def test_a_diverging_run_says_so_exits_3_and_writes_strict_json(tmp_path):
    """...and says it once, at the first skipped window, in the command line's words: not the
    library's UserWarning with its source line and an option the command line has no flag for (#26
    item 9)."""
    out = tmp_path / "h"
    proc = cli("train", "--lr", "1e6", *MLP, "--out", str(out))
    assert proc.returncode == 3, proc.stderr
    assert "10 of 12 windows skipped" in proc.stdout
    assert "Warning" not in proc.stderr and "nonfinite=" not in proc.stderr and ".py:" not in proc.stderr, proc.stderr
    (skip,) = [line for line in proc.stderr.splitlines() if "was skipped" in line]
    assert skip == ("gradaccum train: warning: window 3 (epoch 0, window 2) was skipped: its loss or gradient is not "
                    "finite, so no optimizer step was taken; training goes on, and the run exits 3 at its end if it "
                    "does not recover; lower --lr (now 1e+06) or clip with --max-grad-norm 1.0")
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("gradaccum train: error: the run diverged: 10 of 12 windows were skipped") and "--lr" in last
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [strict(line) for line in lines]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["window_index"] for r in train] == list(range(12))  # one row per window, never repeated
    assert sum(r["skipped"] for r in train) == 10
    assert [r["step"] for r in train if r["skipped"]] == [2] * 10  # the step count repeats on a skipped window
    summary = strict((out / "summary.json").read_text())
    assert summary["skipped"] == 10 and summary["windows"] == 12 and summary["test_loss"] is None
    assert summary["skipped_at_end"] == 10  # windows 3 to 12
    for row in csv.DictReader((out / "metrics.csv").read_text().splitlines()):
        assert row["loss"].lower() not in ("nan", "inf")


@pytest.mark.parametrize("summary, diverged", [
    ({"windows": 48, "skipped": 17, "skipped_at_end": 17, "last_loss": 1e25}, True),  # stuck at the end
    ({"windows": 48, "skipped": 3, "skipped_at_end": 3, "last_loss": 0.5}, True),
    ({"windows": 48, "skipped": 5, "skipped_at_end": 2, "last_loss": 0.5}, False),  # fp16 overflows
    ({"windows": 2, "skipped": 1, "skipped_at_end": 1, "last_loss": 0.5}, False),
    ({"windows": 2, "skipped": 2, "skipped_at_end": 2, "last_loss": 0.5}, True),
    ({"windows": 48, "skipped": 25, "skipped_at_end": 0, "last_loss": 0.5}, True),  # most skipped
    ({"windows": 48, "skipped": 0, "skipped_at_end": 0, "last_loss": None}, True),  # no loss at the end
    ({"windows": 48, "skipped_windows": 25, "skipped_at_end": 0, "last_loss": 0.5}, True),  # an older summary's key
])
def test_a_run_whose_last_windows_were_all_skipped_exits_3(summary, diverged):
    """A run that trained, then skipped every window of its end (a new user's: 17 of 48 windows, the
    last 17, losses near 1e25) ended with a dead model, though most windows stepped: exit 3. The
    rule on summary.json's numbers, checked directly (the subprocess path is the test above)."""
    from argparse import Namespace

    from gradaccum.cli.train_command import Diverged, _raise_if_diverged

    cfg = Namespace(lr=0.1, max_grad_norm=None)
    if diverged:
        with pytest.raises(Diverged, match="the run diverged"):
            _raise_if_diverged(summary, cfg, "out")
    else:
        _raise_if_diverged(summary, cfg, "out")


def test_every_json_file_of_a_compare_run_parses_strictly(tmp_path, here):
    out = tmp_path / "c"
    proc = here("train", "--compare", "--lr", "1e6", *MLP, "--out", str(out))
    assert proc.returncode == 3, proc.stderr
    files = list(out.rglob("*.json")) + list(out.rglob("*.jsonl"))
    assert {p.name for p in files} >= {"summary.json", "compare.json", "metrics.jsonl"}
    for path in files:
        for line in ([path.read_text()] if path.suffix == ".json" else path.read_text().splitlines()):
            strict(line)


# -- 2. any two of B, M, N give the third -----------------------------------------------------

@pytest.mark.parametrize("flags, window", [
    ({"--batch-size": 96}, (96, 32, 3)),
    ({"--micro-batch-size": 16}, (64, 16, 4)),
    ({"--accum-steps": 2}, (64, 32, 2)),
    ({"--batch-size": 96, "--micro-batch-size": 32}, (96, 32, 3)),
    ({"--batch-size": 96, "--accum-steps": 4}, (96, 24, 4)),  # refused before: M defaulted to 32 as if given
    ({"--micro-batch-size": 16, "--accum-steps": 2}, (32, 16, 2)),
    ({"--batch-size": 96, "--micro-batch-size": 24, "--accum-steps": 4}, (96, 24, 4)),
    ({"--batch-size": 96, "--micro-batch-size": 32, "--accum-steps": 4}, "contradict each other"),
    ({"--batch-size": 100, "--accum-steps": 3}, "does not split into --accum-steps 3 equal micro-batches"),
])
def test_the_documented_window_table(tmp_path, here, flags, window):
    out = tmp_path / "w"
    args = [str(x) for kv in flags.items() for x in kv]
    proc = here("train", *args, *MLP, "--out", str(out))
    if isinstance(window, str):
        assert proc.returncode == 2
        one_error_line(proc, window)
        return
    assert proc.returncode == 0, proc.stderr
    s = strict((out / "summary.json").read_text())
    assert (s["global_batch_size"], s["micro_batch_size"], s["accum_steps"]) == window


def test_resume_with_another_micro_batch_size_keeps_the_global_batch(tmp_path, here):
    out = tmp_path / "r"
    assert here("train", *MLP, "--out", str(out)).returncode == 0
    proc = here("train", "--model", "mlp", "--epochs", "2", "--device", "cpu", "--micro-batch-size", "16",
               "--resume", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    s = strict((out / "summary.json").read_text())
    assert (s["global_batch_size"], s["micro_batch_size"], s["steps"]) == (128, 16, 24)


# -- 3. eval of a run folder ------------------------------------------------------------------

def test_eval_takes_a_run_folder(tmp_path, here):
    out = tmp_path / "u2"
    assert here("train", *MLP, "--out", str(out)).returncode == 0
    proc = here("eval", "--checkpoint", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert strict(proc.stdout)["checkpoint"] == str(out / "last.pt")
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = here("eval", "--checkpoint", str(empty))
    assert proc.returncode == 2
    one_error_line(proc, f"--checkpoint {empty} is a folder without last.pt or last.dcp")


# -- 4. check: a split of one micro-batch, and the user's own model ---------------------------

def test_check_refuses_a_split_of_one_micro_batch_and_says_the_real_count(here):
    proc = here("check", "--micro-batch-size", "2000", "--accum-steps", "2")
    assert proc.returncode == 2
    one_error_line(proc, "--micro-batch-size 2000 on a batch of 1438 items gives one micro-batch")
    proc = here("check", "--micro-batch-size", "4", "--accum-steps", "4")
    assert proc.returncode == 0 and "16 items in 4 micro-batches of at most 4: equivalent" in proc.stdout


USER_MODULE = """
import torch
from torch import nn

def batchnorm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

def plain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).double()

def sample():
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(16, 4, generator=g), "y": torch.randn(16, 1, generator=g)}

def dropout():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double()

def loss_fn(model, batch):
    p = next(model.parameters())
    return nn.functional.mse_loss(model(batch["x"].to(p.dtype)), batch["y"].to(p.dtype))

def summed(model, batch):
    p = next(model.parameters())
    return nn.functional.mse_loss(model(batch["x"].to(p.dtype)), batch["y"].to(p.dtype), reduction="sum")
"""


def test_check_runs_on_the_users_own_model(tmp_path, here, monkeypatch, request):
    import sys

    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.setattr(sys, "path", list(sys.path))  # check puts "" in front, as `python -m` has it
    monkeypatch.syspath_prepend(str(tmp_path))  # as PYTHONPATH would
    request.addfinalizer(lambda: [sys.modules.pop(name, None) for name in ("mypkg", "mypkg.nets")])  # forgotten after

    def check(*args):
        return here("check", *args)

    bn = check("--model", "mypkg.nets:batchnorm", "--batch", "mypkg.nets:sample", "--loss", "mypkg.nets:loss_fn",
               "--micro-batch-size", "4")
    assert bn.returncode == 1, bn.stderr
    assert "NOT equivalent" in bn.stdout and "BatchNorm" in bn.stdout
    # 16 items in micro-batches of 5 leave one of 1 item: BatchNorm and the size are named, not the loss (#26 item 8)
    one = check("--model", "mypkg.nets:batchnorm", "--batch", "mypkg.nets:sample", "--loss", "mypkg.nets:loss_fn",
                "--micro-batch-size", "5")
    assert one.returncode == 2
    one_error_line(one, "gradaccum check: error: --micro-batch-size 5 on a batch of 16 items leaves micro-batch 4 of 4 "
                        "with 1 item, which BatchNorm in training mode (module '1') cannot normalize",
                   "pass --micro-batch-size 4, which leaves 2 or more in each")
    assert "--loss" not in one.stderr
    # dropout: NOT equivalent, as the docs say, with why this split's gradients matched (#26 item 7)
    drop = check("--model", "mypkg.nets:dropout", "--batch", "mypkg.nets:sample", "--loss", "mypkg.nets:loss_fn")
    assert drop.returncode == 1, drop.stderr
    assert drop.stdout.startswith("mypkg.nets:dropout, 16 items in 2 micro-batches of at most 8: NOT equivalent")
    assert "matched on this split by chance" in drop.stdout
    summed = check("--model", "mypkg.nets:plain", "--batch", "mypkg.nets:sample", "--loss", "mypkg.nets:summed")
    assert summed.returncode == 1 and "hint: the full batch's loss is 2 times" in summed.stdout, summed.stdout
    ok = check("--model", "mypkg.nets:plain", "--batch", "mypkg.nets:sample", "--loss", "mypkg.nets:loss_fn")
    assert ok.returncode == 0, ok.stderr
    assert "16 items in 2 micro-batches of at most 8: equivalent" in ok.stdout
    missing = check("--model", "mypkg.nets:plain")
    assert missing.returncode == 2
    one_error_line(missing, "give --batch and --loss too")
    wrong = check("--model", "mypkg.nets:nothing", "--batch", "mypkg.nets:sample", "--loss", "mypkg.nets:loss_fn")
    assert wrong.returncode == 2
    one_error_line(wrong, "--model mypkg.nets:nothing: mypkg.nets has no 'nothing'")


# -- 5. a --compare run resumed without --compare --------------------------------------------

def test_resuming_a_compare_run_without_compare_says_its_comparison_is_stale(tmp_path, here):
    out = tmp_path / "cmp"
    assert here("train", "--compare", *MLP, "--out", str(out)).returncode == 0
    proc = here("train", "--model", "mlp", "--epochs", "2", "--device", "cpu", "--resume", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert ("gradaccum train: note: compare.json, compare.png and baseline/ are from before this --resume"
            in proc.stderr)


# -- 6. messages ------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["train", "--seed", "99999999999999999999"], "argument --seed: must be an integer from 0 to "),
    (["train", "--task", "mnist", "--data-path", "README.md"], "/README.md is a file; --task mnist reads a folder"),
])
def test_messages_name_the_flag_and_the_fix(tmp_path, here, args, message):
    proc = here(*args, "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    one_error_line(proc, message)


def test_eval_data_path_on_a_digits_model_says_to_drop_it(tmp_path, here):
    out = tmp_path / "d"
    assert here("train", *MLP, "--out", str(out)).returncode == 0
    proc = here("eval", "--checkpoint", str(out), "--data-path", "README.md")
    assert proc.returncode == 2
    err = one_error_line(proc, "--data-path README.md is not used", "drop --data-path")
    assert "--task" not in err  # eval takes no --task


# -- 7. a window larger than the dataset -----------------------------------------------------

def test_a_window_larger_than_the_dataset_warns_once_and_records_the_real_batch(tmp_path, here):
    out = tmp_path / "big"
    proc = here("train", "--micro-batch-size", "5000", *MLP, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    # in the flags' terms: the 20000 is theirs, multiplied out (#47 item 5: "a window of 20000 images" said a number
    # the user never typed)
    assert warnings == ["gradaccum train: warning: --micro-batch-size 5000 x --accum-steps 4 (the default) = 20000 "
                        "images is more than the 1438 images of the training set: each step takes all 1438 "
                        "(summary.json records global_batch_size 1438); pass --batch-size 1438 or less to say so"], warnings
    s = strict((out / "summary.json").read_text())
    assert s["global_batch_size"] == 1438 and s["requested_global_batch_size"] == 20000
    # the split as trained, as the rows say it (it recorded the flags' 4 micro-batches of the 20000; #26 item 12),
    # and the micro-batch that ran: all 1438, not the flag's 5000 (#34 item 9)
    assert s["micro_batch_size"] == 1438 == train_rows(out)[0]["micro_batch_size"]
    assert s["accum_steps"] == 1 == train_rows(out)[0]["accum_steps"]


@pytest.mark.parametrize("flags, said", [
    ({"micro_batch_size": 5000}, "--micro-batch-size 5000 x --accum-steps 4 (the default) = 20000"),
    ({"accum_steps": 700}, "--micro-batch-size 32 (the default) x --accum-steps 700 = 22400"),
    ({"micro_batch_size": 600, "accum_steps": 2, "world_size": 2},
     "--micro-batch-size 600 x --accum-steps 2 x 2 ranks = 2400"),
    ({"batch_size": 5000, "micro_batch_size": 100}, "--batch-size 5000"),
    ({"micro_batch_size": "auto"}, "--batch-size 128 (the default with --micro-batch-size auto)")])
def test_the_window_is_said_in_the_flags_given(flags, said):
    from gradaccum.cli.config import TrainConfig
    from gradaccum.cli.run import window_flags

    assert window_flags(TrainConfig(**flags)) == said


# -- 8. the default run folder ---------------------------------------------------------------

def test_plain_runs_each_get_a_new_numbered_folder(tmp_path, here):
    paths = []
    for k in range(2):
        proc = here("train", *MLP, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.rstrip().endswith(f"-> runs/version_{k}")
        paths.append(tmp_path / "runs" / f"version_{k}")
    assert all((p / "last.pt").is_file() for p in paths)
    explicit = here("train", *MLP, "--out", "runs/version_0", cwd=tmp_path)
    assert explicit.returncode == 2  # an explicit --out keeps its refusal
    one_error_line(explicit, "--out runs/version_0 holds another run")
    proc = here("train", *MLP, "--resume", cwd=tmp_path)
    assert proc.returncode == 2
    one_error_line(proc, "--resume needs --out")


# -- 10 and 11. TensorBoard, CSV, evaluation during training ---------------------------------

def test_tensorboard_events_csv_and_test_metrics_at_every_epoch_end(tmp_path, here):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    proc = here("train", "--model", "mlp", "--epochs", "2", "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = [strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [(r["epoch"], r["step"]) for r in evals] == [(0, 12), (1, 24)]
    assert all(0 <= r["test_accuracy"] <= 1 for r in evals)
    assert evals[-1]["test_accuracy"] == strict((out / "summary.json").read_text())["test_accuracy"]
    table = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    assert len(table) == len(rows) and [r["kind"] for r in table].count("eval") == 2
    events = EventAccumulator(str(out))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/items_per_second", "test/loss",
            "test/accuracy"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 25))
    assert [e.step for e in events.Scalars("test/accuracy")] == [12, 24]
    assert math.isclose(events.Scalars("train/loss")[-1].value, train_rows(out)[-1]["loss"], rel_tol=1e-6)
