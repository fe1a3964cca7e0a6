"""gradaccum train / eval / check, end to end on data the tests make themselves."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed.launch import run_cli_here
from gradaccum.cli import main

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--epochs", "1", "--device", "cpu"]


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def train_rows(out: Path) -> list:
    """metrics.jsonl's rows of training windows (the others hold each epoch's test metrics)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def cli_env() -> dict:
    """The environment of a user's shell, with this checkout's sources and the suite's one thread
    (tests/conftest.py sets OMP_NUM_THREADS=1 for this process too, so both sides match)."""
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradaccum", *args], capture_output=True, text=True,
                          env=cli_env(), timeout=kwargs.get("timeout", 300), cwd=kwargs.get("cwd", ROOT))


def test_train_writes_metrics_summary_checkpoint_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--model", "mlp", *FAST]) == 0
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert {"step", "epoch", "loss", "lr", "num_items", "grad_norm", "samples_per_second"} <= set(rows[0])
    summary = json.loads((out / "summary.json").read_text())
    assert {"test_accuracy", "test_loss", "steps", "wall_time_seconds", "peak_memory_bytes"} <= set(summary)
    assert summary["steps"] == len(rows) == 12  # 1438 items / 128 per window
    assert rows[-1]["num_items"] == 1438 - 11 * 128  # the short last window
    state = load(out / "last.pt")
    assert {"model", "optimizer"} <= set(state)
    assert (out / "loss.png").stat().st_size > 1000
    assert "test accuracy" in capsys.readouterr().out


def test_default_digits_run_reaches_95_percent(tmp_path):
    """The default run (LeNet-5, 32 x 4, 15 epochs) reaches at least 95% test accuracy."""
    out = tmp_path / "default"
    assert main(["train", "--out", str(out), "--device", "cpu"]) == 0
    assert json.loads((out / "summary.json").read_text())["test_accuracy"] >= 0.95


@pytest.mark.parametrize("split", [["--micro-batch-size", "32", "--accum-steps", "1"],
                                   ["--micro-batch-size", "5", "--batch-size", "32"]])
def test_same_seed_same_effective_batch_same_model(tmp_path, split):
    """8 x 4, 32 x 1 and uneven 5-item micro-batches of 32-item windows train the same model."""
    common = ["--dtype", "float64", "--model", "mlp", "--optimizer", "adamw", "--lr", "0.001", *FAST]
    assert main(["train", "--out", str(tmp_path / "a"), "--micro-batch-size", "8", "--accum-steps", "4", *common]) == 0
    assert main(["train", "--out", str(tmp_path / "b"), *split, *common]) == 0
    a, b = load(tmp_path / "a" / "last.pt"), load(tmp_path / "b" / "last.pt")
    assert a["accumulator"]["steps"] == b["accumulator"]["steps"] == 45
    assert max_diff(a["model"], b["model"]) < 1e-10


def test_compare_overlays_curves_and_reports(tmp_path, capsys):
    """LeNet-5's activations (6 x 28 x 28 per image after conv1) dwarf its 61k parameters, so the
    measured peak of 4 micro-batches of 32 is well below one batch of 128. (On a tiny MLP it is not:
    from the second micro-batch on, a backward holds a fresh gradient beside .grad while adding it.)"""
    out = tmp_path / "cmp"
    assert main(["train", "--compare", "--dtype", "float64", "--out", str(out), *FAST]) == 0
    report = json.loads((out / "compare.json").read_text())
    assert report["max_abs_param_diff"] < 1e-10
    assert report["peak_memory_source"].startswith("measured")
    assert report["accumulated"]["peak_memory_bytes"] < 0.6 * report["one_batch"]["peak_memory_bytes"]
    summary = json.loads((out / "summary.json").read_text())
    assert (report["accumulated"]["micro_batch_size"], report["accumulated"]["accum_steps"]) == \
        (summary["micro_batch_size"], summary["accum_steps"]), report  # as trained (it said null for a default)
    assert (out / "compare.png").stat().st_size > 1000
    assert "largest parameter difference" in capsys.readouterr().out


KILL_ARGS = ["train", "--model", "mlp", "--epochs", "10", "--checkpoint-every", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run per dtype, made once: a subprocess, like the interrupted side."""
    made = {}

    def run(dtype: str) -> Path:
        if dtype not in made:
            out = tmp_path_factory.mktemp(f"whole-{dtype}")
            proc = cli(*KILL_ARGS, "--dtype", dtype, "--out", str(out))
            assert proc.returncode == 0, proc.stderr
            made[dtype] = out
        return made[dtype]
    return run


def wait_for(proc: subprocess.Popen, ready, what: str, log: Path) -> None:
    """Poll until ``ready()``; the deadline only bounds a hung run, no assertion depends on timing."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.005)
    assert proc.poll() is None, f"the run ended before {what}: {log.read_text()}"


def start_and_kill_mid_run(out: Path, args, sig: int, *, after_rows: int = 8, checkpoint: bool = True,
                           again: bool = False) -> subprocess.Popen:
    """Start the CLI, wait for ``after_rows`` optimizer steps (and a checkpoint, unless ``checkpoint``
    is False), then send ``sig``; with ``again``, send it a second time once the first was acknowledged."""
    log = out.parent / f"{out.name}.stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gradaccum", *args, "--out", str(out)], env=cli_env(),
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    metrics = out / "metrics.jsonl"
    wait_for(proc, lambda: ((out / "last.pt").exists() or not checkpoint) and metrics.exists()
             and len(metrics.read_text().splitlines()) >= after_rows, "it could be interrupted", log)
    proc.send_signal(sig)
    if again:
        wait_for(proc, lambda: "received" in log.read_text(), "the first signal was acknowledged", log)
        proc.send_signal(sig)
    proc.wait(timeout=120)
    return proc


def temp_files(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".write-probe-" in p.name)


def stderr_lines(out: Path) -> list:
    return (out.parent / f"{out.name}.stderr").read_text().splitlines()


def test_ctrl_c_then_kill_9_then_resume_is_bit_identical(tmp_path, uninterrupted):
    """With the default --checkpoint-every 0, Ctrl-C finishes the window, writes an atomic checkpoint,
    prints where it is and the command that resumes it, and exits 130. That run resumed and killed
    with kill -9 keeps its last periodic checkpoint whole; the printed command then ends with exactly
    the uninterrupted model (both sides are subprocesses with one thread, so float32 agrees to the
    bit), and its progress (stderr is a pipe) is a plain line every tenth of the run. float32, the
    default and the dtype whose rounding a difference between the two sides would show; a float64
    resume is held to the bit under torchrun (tests/distributed/test_global_batch.py)."""
    dtype = "float32"
    args = [a for a in KILL_ARGS if a not in ("--checkpoint-every", "2")] + ["--dtype", dtype]
    out = tmp_path / "ctrl-c"
    proc = start_and_kill_mid_run(out, args, signal.SIGINT, checkpoint=False)
    assert proc.returncode == 130
    last = stderr_lines(out)[-1]
    assert last.startswith("gradaccum train: SIGINT: stopped after step ") and f"checkpoint {out}/last.pt" in last
    assert not (out / "summary.json").exists() and temp_files(out) == []
    step = load(out / "last.pt")["accumulator"]["steps"]
    assert f"step {step} of 120" in last and 8 <= step < 120
    rows = [r["step"] for r in train_rows(out)]
    assert rows == list(range(1, step + 1)), "a metrics line for every step the checkpoint holds, no more"
    command = shlex.split(last.split("resume with: ", 1)[1])
    assert command[-1] == "--resume"

    # resumed with a checkpoint every 2 steps (a setting that may change) and killed with SIGKILL
    proc = start_and_kill_mid_run(out, [*KILL_ARGS, "--dtype", dtype, "--resume"], signal.SIGKILL,
                                  after_rows=step + 8)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists(), "the kill did not land mid-run"
    killed_at = load(out / "last.pt")["accumulator"]["steps"]
    assert step < killed_at < 120
    # what kill -9 during a checkpoint write leaves: a temporary file that is never read, and goes
    (out / ".last.pt.tmp-99999999").write_bytes(b"half a checkpoint")

    resumed = subprocess.run(command, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole, after = load(uninterrupted(dtype) / "last.pt"), load(out / "last.pt")
    assert after["accumulator"]["steps"] == 120
    assert all(torch.equal(whole["model"][k], after["model"][k]) for k in whole["model"])
    rows = [r["step"] for r in train_rows(out)]
    assert rows == list(range(1, 121)), "duplicate or missing metric lines"
    assert temp_files(out) == []

    progress = [line for line in resumed.stderr.splitlines() if "/120 (" in line]
    shown = {int(line.split("step ", 1)[1].split("/", 1)[0]) for line in progress}
    assert {s for s in range(12, 121, 12) if s > killed_at} <= shown and 120 in shown  # every 12 steps, and the last
    assert all(" images/s, ETA " in line and ", loss " in line for line in progress)


def test_sigterm_writes_a_checkpoint_and_exits_143(tmp_path):
    """SIGTERM (a scheduler, `kill`) is a Ctrl-C with exit code 143."""
    out = tmp_path / "term"
    proc = start_and_kill_mid_run(out, [*KILL_ARGS, "--dtype", "float32"], signal.SIGTERM)
    assert proc.returncode == 143
    last = stderr_lines(out)[-1]
    saved = load(out / "last.pt")
    step = saved["accumulator"]["steps"]
    assert last.startswith(f"gradaccum train: SIGTERM: stopped after step {step} of 120; checkpoint {out}/last.pt")
    assert "resume with: " in last and last.endswith(" --resume")
    assert (saved["epoch"], saved["window"]) == divmod(step, 12)  # the next window: 12 per epoch
    assert temp_files(out) == []


def test_second_ctrl_c_stops_at_once_without_a_half_checkpoint(tmp_path):
    """Ctrl-C twice: the command leaves at once with 130; whatever the second one interrupted (a
    window, or the checkpoint write) last.pt is whole and no temporary file is left."""
    out = tmp_path / "twice"
    args = ["train", "--model", "mlp", "--epochs", "3", "--device", "cpu", "--checkpoint-every", "1",
            "--micro-batch-size", "1", "--batch-size", "512"]  # long windows: the second lands in one
    proc = start_and_kill_mid_run(out, args, signal.SIGINT, after_rows=1, again=True)
    assert proc.returncode == 130
    lines = stderr_lines(out)
    assert "SIGINT received: finishing this window" in lines[-2]
    assert lines[-1].startswith("gradaccum train: second SIGINT: stopped at once, without a new checkpoint; "
                                f"{out}/last.pt is whole and holds step ") and lines[-1].endswith(" --resume")
    assert temp_files(out) == []
    saved = load(out / "last.pt")  # whole
    assert saved["accumulator"]["steps"] >= 1


def test_corrupt_checkpoint_is_refused_and_left_in_place(tmp_path):
    out = tmp_path / "bad"
    out.mkdir()
    (out / "last.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    before = (out / "last.pt").read_bytes()
    proc = run_cli_here(["train", "--out", str(out), "--resume", *FAST])  # what it says: this process will do
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "is corrupt or unreadable" in proc.stderr and "left in place: restore a good copy, or start over with --overwrite" in proc.stderr
    assert (out / "last.pt").read_bytes() == before


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A write that dies half-way leaves the previous checkpoint whole and no temporary file."""
    from gradaccum.cli import checkpoint

    path = tmp_path / "last.pt"
    checkpoint.save_atomic({"x": torch.ones(3)}, path)

    def dying_save(obj, f):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(OSError):
        checkpoint.save_atomic({"x": torch.zeros(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_eval_prints_the_test_metrics_of_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "e"
    assert main(["train", "--out", str(out), "--model", "mlp", *FAST]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out / "last.pt"), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "summary.json").read_text())
    assert printed["test_accuracy"] == pytest.approx(summary["test_accuracy"])


def test_mnist_idx_plain_and_gzip_in_the_seed_layout(tmp_path, mnist_dir, capsys):
    out = tmp_path / "m"
    assert main(["train", "--task", "mnist", "--data-path", str(mnist_dir), "--micro-batch-size", "16",
                 "--out", str(out), *FAST]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 <= summary["test_accuracy"] <= 1  # 96 items, windows of 64


def test_mnist_truncated_file_is_named(tmp_path, mnist_dir, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(mnist_dir, broken)
    f = broken / "train" / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:1000])
    assert main(["train", "--task", "mnist", "--data-path", str(broken), "--out", str(tmp_path / "o"), *FAST]) == 2
    err = capsys.readouterr().err
    assert "train-images-idx3-ubyte is truncated" in err and err.count("\n") == 1


def test_text_task_weights_tokens(tmp_path, text_file):
    out = tmp_path / "t"
    assert main(["train", "--task", "text", "--data-path", str(text_file), "--micro-batch-size", "8",
                 "--accum-steps", "2", "--out", str(out), *FAST]) == 0
    rows = train_rows(out)
    assert all(r["num_items"] > 16 for r in rows)  # items are next-token targets, not sequences
    assert len({r["num_items"] for r in rows}) > 1  # variable lengths
    assert "test_loss" in json.loads((out / "summary.json").read_text())


def test_check_command_passes_the_default_model(capsys):
    assert main(["check", "--micro-batch-size", "4", "--accum-steps", "4"]) == 0
    assert "equivalent" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--accum-steps", "0"], "--accum-steps must be an integer >= 1, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be an integer >= 1 or 'auto', got 0"),
    (["--micro-batch-size", "lots"], "must be an integer >= 1 or 'auto', got 'lots'"),
    (["--accum-steps", "x"], "argument --accum-steps: invalid int value: 'x'"),
    (["--task", "cifar"], "--task must be one of digits, mnist5k, mnist, text, got 'cifar'"),
    (["--model", "resnet"], "--model must be one of lenet5, mlp, transformer, got 'resnet'"),
    (["--model", "transformer"], "--model transformer does not fit --task digits"),
    (["--precision", "fp8"], "--precision must be one of fp32, bf16, fp16, got 'fp8'"),
    (["--task", "mnist", "--data-path", "/nonexistent/mnist"], "--data-path /nonexistent/mnist: no such directory"),
    (["--task", "mnist"], "--task mnist needs --data-path"),
    (["--task", "text", "--data-path", "/nonexistent.txt"], "--data-path /nonexistent.txt: no such file"),
    (["--epochs", "0"], "--epochs must be an integer >= 1, got 0"),
    (["--bogus", "1"], "gradaccum train: error: unrecognized arguments: --bogus 1 (gradaccum train --help lists"),
])
def test_errors_are_one_line_with_the_argument_and_value(tmp_path, capsys, args, message):
    code = None
    try:
        code = main(["train", "--out", str(tmp_path / "x"), *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x" / "last.pt").exists()


def test_an_older_checkpoints_loss_every_is_dropped_on_resume():
    """--loss-every went (issue 48 item 4); it never changed the trained model, so a checkpoint written
    with it still gives its settings (the flag is dropped), rather than "settings this version cannot read"."""
    from gradaccum.cli.config import TrainConfig, saved_config

    config = TrainConfig(task="digits")
    assert saved_config({"config": {**config.to_dict(), "loss_every": 3}}, where="last.pt", fix="-") == config


def test_errors_as_a_subprocess_print_no_traceback(tmp_path):
    proc = cli("train", "--accum-steps", "-1", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "gradaccum train: error: --accum-steps must be an integer >= 1, got -1"
    proc = cli("eval", "--checkpoint", "/nonexistent/last.pt", cwd=tmp_path)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_version():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("gradaccum ")


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["check", "--help"], ["--version"],
                                  ["train", "--epoch", "2"], ["check", "--micro-batch-size", "auto"], []])
def test_help_version_and_a_mistyped_flag_answer_without_importing_torch(argv):
    """What the parser answers alone (help, the version, a flag it refuses) imports no torch: a few
    hundredths of a second, not the seconds torch's import takes."""
    code = ("import sys\nfrom gradaccum.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)" % argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert proc.stderr.rstrip().endswith("no torch"), proc.stderr[-2000:]


def test_the_command_lines_precisions_are_mixed_precisions():
    from gradaccum.cli.config import PRECISIONS
    from gradaccum.precision import PRECISIONS as LIBRARY

    assert PRECISIONS == LIBRARY


def test_auto_micro_batch_size_from_the_command_line(tmp_path):
    out = tmp_path / "auto"
    assert main(["train", "--micro-batch-size", "auto", "--batch-size", "64", "--model", "mlp",
                 "--out", str(out), *FAST]) == 0
    rows = train_rows(out)
    assert rows[0]["micro_batch_size"] == 64 and rows[0]["num_items"] == 64
    assert json.loads((out / "summary.json").read_text())["micro_batch_size"] == 64
