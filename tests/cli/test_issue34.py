"""Issue #34 (items 7, 9, 10): what the command line says, records and draws, where it was wrong.
Each test failed before its fix. Signals are real signals to a real process; messages and plots
are read in-process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from gradaccum.cli import main

from .test_cli import FAST, ROOT, cli_env, load, train_rows, wait_for


def _code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own
        return e.code


# -- #34 item 7: a usage error under torchrun is said once ----------------------------------------

@pytest.mark.distributed
def test_a_usage_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """argparse's refusals (an unknown flag, a value of the wrong type) were printed by every worker;
    the guide says rank 0 alone prints the line. Every worker still exits 2. The parser answers before
    torch is imported: a worker other than rank 0 waits for torchrun to stop it, or rank 0, stopped once
    that worker exited, would lose the line now and then (it did, in a run of the suite)."""
    from distributed.launch import torchrun

    late = tmp_path / "rank_0_late.py"  # rank 0 starts 2 s after the others, as on a loaded machine
    late.write_text("import os, runpy, sys, time\nif os.environ['RANK'] == '0':\n    time.sleep(2)\n"
                    f"sys.argv = ['gradaccum', 'train', '--epoch', '2', '--out', {str(tmp_path / 'x')!r}]\n"
                    "runpy.run_module('gradaccum', run_name='__main__')\n")
    proc = torchrun([str(late)], timeout=300)
    said = proc.stdout + proc.stderr
    lines = [line for line in said.splitlines() if line.startswith("gradaccum train: error:")]
    assert lines == ["gradaccum train: error: unrecognized arguments: --epoch 2; did you mean --epochs? (gradaccum "
                     "train --help lists its flags)"], said[-3000:]
    assert "exitcode  : 2" in said, said[-3000:]  # the usage error's code, not a crash


def test_argparse_says_nothing_on_a_rank_other_than_0(monkeypatch, capsys):
    """The same rule in-process, for every message argparse prints (an error, --help)."""
    monkeypatch.setenv("RANK", "1")
    assert _code(["train", "--accum-steps", "x"]) == 2
    assert _code(["eval", "--help"]) == 0
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    assert _code(["train", "--accum-steps", "x"]) == 2
    assert "argument --accum-steps: invalid int value: 'x'" in capsys.readouterr().err


# -- #34 item 9: what ran, drawn and recorded ---------------------------------------------------

def test_a_window_larger_than_the_dataset_records_the_micro_batch_that_ran(tmp_path, capsys):
    """--micro-batch-size 5000 on the 1438 training images runs one micro-batch of 1438: summary.json
    and every metrics row said 5000, the flag, not what ran."""
    out = tmp_path / "big"
    assert main(["train", "--micro-batch-size", "5000", "--model", "mlp", *FAST, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["global_batch_size"], summary["micro_batch_size"], summary["accum_steps"]) == (1438, 1438, 1)
    assert summary["config"]["micro_batch_size"] == 5000  # what was asked stays in the settings
    assert [(r["micro_batch_size"], r["num_items"]) for r in train_rows(out)] == [(1438, 1438)]


def _diverged_rows(epochs: int = 2, per_epoch: int = 12, stepped: int = 2) -> list:
    """A run like --lr 1e6's: two steps, then every window skipped; test loss not finite."""
    rows = []
    for i in range(epochs * per_epoch):
        skipped = i >= stepped
        rows.append({"kind": "train", "window_index": i, "epoch": i // per_epoch, "window": i % per_epoch,
                     "step": min(i + 1, stepped), "skipped": skipped, "loss": None if skipped else 2.0 + 10.0 ** i,
                     "lr": 1e6, "grad_norm": None if skipped else 1.0 + i})
        if i % per_epoch == per_epoch - 1:
            rows.append({"kind": "eval", "epoch": i // per_epoch, "window_index": i, "step": stepped,
                         "test_loss": None, "test_accuracy": 0.1})
    return rows


def test_a_diverged_runs_loss_png_draws_its_epoch_ends_and_no_loss_for_a_skipped_window(tmp_path, figures):
    """loss.png's label promised dotted epoch ends, drawn only where the test loss was finite (never
    in a diverged run), and put each skipped window at y=1 on the loss axis, a loss it never had.
    Now the epoch ends come from the windows, and skipped windows are shaded, at no loss value."""
    from matplotlib.patches import Rectangle

    from gradaccum.cli.report import plot_losses

    rows = _diverged_rows()
    plot_losses({"train": rows}, tmp_path / "loss.png", title="t")
    (fig,) = figures
    loss_ax = fig.axes[0]
    skipped = {r["window_index"] + 1 for r in rows if r.get("skipped")}
    for line in loss_ax.get_lines():  # every point on the loss axis is a loss a window had
        xs = [x for x in line.get_xdata() if line.get_linestyle() != ":" and x in skipped]
        assert not xs, f"{line.get_label()} draws skipped windows {xs} at a loss"
    shaded = [p for p in loss_ax.patches if isinstance(p, Rectangle)]
    covered = {x for x in skipped if any(p.get_x() <= x <= p.get_x() + p.get_width() for p in shaded)}
    assert covered == skipped
    labels = loss_ax.get_legend_handles_labels()[1]
    assert "skipped: 22 of 24 windows (non-finite, no step)" in labels, labels
    for ax in fig.axes:  # the epoch end between windows 12 and 13, in every panel
        assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"] == [12.5]
    assert fig.axes[-1].get_xlabel().endswith("dotted: epoch ends")

    figures.clear()
    plot_losses({"train": _diverged_rows(epochs=1)}, tmp_path / "one.png")
    (one,) = figures  # one epoch: no epoch end to draw, and the label promises none
    assert "epoch ends" not in one.axes[-1].get_xlabel()
    assert not [line for ax in one.axes for line in ax.get_lines() if line.get_linestyle() == ":"]


BATCHNORM = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

def sample():
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(16, 4, generator=g), "y": torch.randn(16, 1, generator=g)}

def loss_fn(model, batch):
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])
"""


def test_checks_batchnorm_verdict_names_the_fix(tmp_path, monkeypatch, capsys):
    """The verdict named the BatchNorm module, not what to do; the library's warning does (eval(),
    GroupNorm, LayerNorm)."""
    (tmp_path / "bn_issue34.py").write_text(textwrap.dedent(BATCHNORM))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "--model", "bn_issue34:build", "--batch", "bn_issue34:sample", "--loss",
                 "bn_issue34:loss_fn", "--micro-batch-size", "4"]) == 1
    out = capsys.readouterr().out
    assert "NOT equivalent" in out and "suspect module '1': BatchNorm1d in training mode" in out, out
    assert out.rstrip().splitlines()[-1] == (
        "  fix: put the BatchNorm layers in eval mode (model.eval(), or .eval() on each of them: they then normalize "
        "with their running statistics, the same for every split), or replace them with GroupNorm or LayerNorm, "
        "which normalize each item on its own"), out


# -- #34 item 10: the seed's range, eval's exit codes, an inherited "ignore Ctrl-C" ---------------

def test_the_seeds_range_is_said_in_a_clean_bound(capsys):
    """It read "0 to 9223372036853727232"; torch takes seeds up to 2**64-1, so seed + epoch has room
    below it for every seed up to 2**63-1."""
    from gradaccum.cli.parser import build_parser

    assert build_parser().parse_args(["train", "--seed", str(2**63 - 1)]).seed == 2**63 - 1
    assert _code(["train", "--seed", str(2**63)]) == 2
    err = capsys.readouterr().err
    assert "argument --seed: must be an integer from 0 to 2**63-1, got 9223372036854775808" in err, err
    help_text = " ".join(build_parser().commands["train"].format_help().split())
    assert "the data order, 0 to 2**63-1 (default: 0)" in help_text
    assert "9223372036853727232" not in err + help_text
    g = torch.Generator().manual_seed(2**63 - 1 + 1000)  # the last seed's 1000th epoch: torch takes it
    assert torch.randperm(3, generator=g).sort().values.tolist() == [0, 1, 2]


def test_eval_help_lists_every_exit_code():
    from gradaccum.cli.parser import build_parser

    text = " ".join(build_parser().commands["eval"].format_help().split())
    assert "exit codes: 0 done, 1 an unexpected error (its one line names it), 2 a usage error (one line)" in text


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it(tmp_path):
    """A script's background job (`gradaccum train &`) starts with SIGINT ignored (SIG_IGN, set by the
    shell). It ignored Ctrl-C while it started, then installed its own handler and stopped at the
    next one. Now an inherited SIG_IGN is kept: a real SIGINT mid-run changes nothing, the run ends
    whole (exit 0); SIGTERM still stops such a run."""
    out, log = tmp_path / "bg", tmp_path / "bg.log"

    def start(name: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "w") as err:
            return subprocess.Popen([sys.executable, "-m", "gradaccum", "train", "--model", "mlp", "--epochs", "1",
                                     "--micro-batch-size", "8", "--device", "cpu", "--out", str(tmp_path / name)],
                                    env=cli_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))

    proc = start("bg")
    metrics = out / "metrics.jsonl"
    wait_for(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, "its first rows", log)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert "SIGINT" not in log.read_text()
    assert load(out / "last.pt")["accumulator"]["steps"] == 45 and len(train_rows(out)) == 45  # windows of 32

    term, term_log = start("term"), tmp_path / "term.log"
    metrics = tmp_path / "term" / "metrics.jsonl"
    wait_for(term, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, "its first rows", term_log)
    term.send_signal(signal.SIGTERM)
    assert term.wait(timeout=300) == 143, term_log.read_text()
