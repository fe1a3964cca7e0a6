"""No silent misuse left (issue #26): two runs in one folder, Ctrl-C at the run's end and during
torch's import, a closed pipe, bad data, outputs that agree, and the messages a new user read. Each
test failed before its fix. The command line runs as a subprocess where the process itself is
the point (signals, locks, pipes, exit codes); messages are read in-process."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradaccum.cli import main

from .conftest import write_idx
from .test_cli import FAST, ROOT, cli_env, load, train_rows, wait_for

MLP = ["--model", "mlp", *FAST]


def start(args: list, log: Path, **kwargs) -> subprocess.Popen:
    """``python -m gradaccum ...`` in the background, stderr to ``log``."""
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "gradaccum", *args], env=kwargs.pop("env", cli_env()), cwd=ROOT,
                                stdout=kwargs.pop("stdout", subprocess.DEVNULL), stderr=err, text=True, **kwargs)


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- 3. two runs into one --out ---------------------------------------------------------------

def test_a_folder_in_use_is_refused_naming_its_process_and_a_killed_run_leaves_it_free(tmp_path, here):
    """A run trains in --out; a second run into it (--overwrite, another --lr) is refused in one line
    that names the first's PID, and the first run's files are untouched (before: both exit 0, the
    second deleting the first's files and the metrics of both mixed in one metrics.jsonl). kill -9 of
    the first leaves its lock file behind but not the lock: the next run takes it."""

    out, log = tmp_path / "race", tmp_path / "first.log"
    first = start(["train", "--model", "mlp", "--epochs", "50", "--micro-batch-size", "1", "--batch-size", "64",
                   "--device", "cpu", "--out", str(out)], log)
    try:
        metrics = out / "metrics.jsonl"
        wait_for(first, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, "its first rows", log)
        second = here("train", *MLP, "--lr", "0.5", "--overwrite", "--out", str(out))  # this process: another one
        assert second.returncode == 2, second.stderr
        err = one_line(second.stderr)
        assert err.startswith(f"gradaccum train: error: --out {out} is in use by another gradaccum run (PID "
                              f"{first.pid} on this machine, which holds {out}/.gradaccum.lock); wait for it to end or "
                              "stop it, or pass another --out"), err
        assert first.poll() is None, "the first run was stopped"
        rows = train_rows(out)
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and {r["lr"] for r in rows} == {0.02}
    finally:
        first.kill()  # SIGKILL: no handler runs, the kernel drops the lock
        first.wait()
    assert (out / ".gradaccum.lock").read_text().split()[0] == str(first.pid)  # left behind, not held
    from gradaccum.cli.folder import FolderLock

    lock = FolderLock(out)
    assert lock.acquire() is None, "the killed run's lock is stuck"
    lock.release()
    assert not (out / ".gradaccum.lock").exists()  # released, the file goes


# -- 5. Ctrl-C at the run's end -----------------------------------------------------------------

def test_ctrl_c_at_the_runs_end_finishes_its_files_and_says_it_is_complete(tmp_path, here):
    """SIGINT once the last window's row is written lands in the run's end (the epoch's test metrics,
    the final checkpoint, summary.json, loss.png): they are finished, the usual line is printed, and
    one more says the run is complete, with nothing to resume; exit 130. (Before: a bare
    "interrupted" and no loss.png, or, at the last step, a promise to stop and exit 0.) A later
    --resume says it is complete and prints the run's line again."""
    out, log = tmp_path / "end", tmp_path / "end.log"
    proc = start(["train", *MLP, "--out", str(out)], log, stdout=subprocess.PIPE)
    metrics = out / "metrics.jsonl"
    wait_for(proc, lambda: metrics.exists() and len(train_rows(out)) == 12, "its last window", log)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    said = log.read_text().splitlines()
    assert proc.returncode == 130, said
    assert said[-2].startswith("gradaccum train: SIGINT received: "), said
    assert said[-1] == (f"gradaccum train: SIGINT: received at the run's end, which it finished first: {out} is "
                        "complete (last.pt holds step 12 (epoch 1, window 0); summary.json and loss.png are "
                        "written); nothing to resume"), said
    assert stdout.startswith("digits/mlp: 12 steps of 128 images (1 shorter), test accuracy ")
    assert load(out / "last.pt")["accumulator"]["steps"] == 12
    assert json.loads((out / "summary.json").read_text())["steps"] == 12 and (out / "loss.png").stat().st_size > 0
    again = here("train", *MLP, "--resume", "--out", str(out))
    assert again.returncode == 0 and again.stdout == stdout, again.stderr
    assert again.stderr == f"gradaccum train: {out} is complete: 1 epoch, 12 steps; nothing to train; summary.json left as it was\n"


# -- 6. Ctrl-C while Python imports torch -------------------------------------------------------

SLOW_TORCH = """
import os, sys, time

class SlowTorch:
    '''Holds `import torch` until a signal: marks it began, then waits (a real import takes ~1.3 s).'''
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            open(os.environ["TORCH_IMPORT_BEGAN"], "w").close()
            while True:
                time.sleep(0.01)
        return None

sys.meta_path.insert(0, SlowTorch())
"""


def test_ctrl_c_while_torch_is_imported_is_one_line(tmp_path):
    """A Ctrl-C in the first second lands in `import torch`. It was a 15-line KeyboardInterrupt
    traceback: the package imported torch before the command could catch anything. A
    sitecustomize holds the import until the signal, so the test does not race the clock."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(SLOW_TORCH))
    began = tmp_path / "began"
    env = dict(cli_env(), PYTHONPATH=f"{tmp_path}{os.pathsep}{cli_env()['PYTHONPATH']}", TORCH_IMPORT_BEGAN=str(began))
    log = tmp_path / "import.log"
    proc = start(["train", *MLP, "--out", str(tmp_path / "never")], log, env=env)
    wait_for(proc, began.exists, "torch's import began", log)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130
    assert one_line(log.read_text()) == "gradaccum: SIGINT: stopped before the command started; nothing was written\n"
    assert not (tmp_path / "never").exists()


# -- 11. a closed pipe ----------------------------------------------------------------------------

@pytest.mark.parametrize("closed", ["stdout", "stdout and stderr"])
def test_a_closed_pipe_costs_the_output_not_the_run(tmp_path, closed):
    """`gradaccum train ... | head` (and `2>&1 | head`): the reader is gone before the run writes. The
    run trains to its end, writes its files and exits 0 (before: "error: BrokenPipeError", exit 1,
    and with stderr in the pipe a run cut short at its first progress line)."""
    read, write = os.pipe()
    os.close(read)  # what head leaves behind once it has its lines
    out = tmp_path / "piped"
    err_to = write if closed == "stdout and stderr" else subprocess.PIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "gradaccum", "train", *MLP, "--out", str(out)], stdout=write,
                              stderr=err_to, env=cli_env(), cwd=ROOT, timeout=300)
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr is None or b"Error" not in proc.stderr, proc.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 12
    assert load(out / "last.pt")["accumulator"]["steps"] == 12


# -- 10. bad data ------------------------------------------------------------------------------

def test_labels_out_of_range_are_refused_before_any_folder_is_made(tmp_path, mnist_dir, capsys, monkeypatch):
    """A label 12 among MNIST's 0-9 ended as an IndexError deep in training (exit 1) and left a
    half-started folder the next run refused: now one line names the file and the label, exit 2, and
    no folder is made (runs/version_K included)."""
    import torch

    bad = tmp_path / "mnist"
    shutil.copytree(mnist_dir, bad)
    labels = torch.randint(0, 10, (96,), generator=torch.Generator().manual_seed(0))
    labels[40] = 12
    (bad / "train" / "train-labels-idx1-ubyte.gz").unlink()
    write_idx(bad / "train" / "train-labels-idx1-ubyte", labels, 2049, gz=True)
    monkeypatch.chdir(tmp_path)
    for out in (["--out", str(tmp_path / "run")], []):
        assert main(["train", "--task", "mnist", "--data-path", str(bad), *out, *FAST]) == 2
        err = one_line(capsys.readouterr().err)
        assert (f"MNIST file {bad}/train/train-labels-idx1-ubyte.gz: MNIST train label 40 is 12, not a class 0 to 9 "
                "(1 of 96 labels are out of range); fix or replace the file") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnist"]


# -- 9. a diverging run: see test_issue19.test_a_diverging_run_says_so_exits_3_and_writes_strict_json

# -- 12. outputs that agree ---------------------------------------------------------------------

def test_loss_png_after_a_resume_on_another_split_says_where_each_held(tmp_path, figures):
    """loss.png named only the last split; a run resumed with another micro-batch size says both."""
    out = tmp_path / "r"
    assert main(["train", *MLP, "--out", str(out)]) == 0
    figures.clear()
    assert main(["train", "--model", "mlp", "--epochs", "2", "--device", "cpu", "--micro-batch-size", "16",
                 "--resume", "--out", str(out)]) == 0
    (loss,) = figures
    title = loss.axes[0].get_title()
    assert title.startswith("digits / mlp: windows of 128 images: micro-batches of 32 (steps 1-12), then "
                            "micro-batches of 16 (steps 13-24)\n"), title


def test_the_text_tasks_compare_png_is_token_weighted_like_its_loss_png(tmp_path, text_file, figures):
    assert main(["train", "--task", "text", "--data-path", str(text_file), "--micro-batch-size", "8",
                 "--accum-steps", "2", "--compare", "--out", str(tmp_path / "t"), *FAST]) == 0
    loss, _, compare = figures
    assert "token-weighted" in loss.axes[0].get_ylabel() and "token-weighted" in compare.axes[0].get_ylabel()


# -- 14. messages ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["train", "--seed", "-1"], "got -1; pass one in that range, e.g. --seed 1"),
    (["train", "--epoch", "2"], "unrecognized arguments: --epoch 2; did you mean --epochs? (gradaccum train --help"),
    (["check", "--model", "mypkg.nets", "--batch", "mypkg.nets:sample", "--loss", "mypkg.nets:loss_fn"],
     "got 'mypkg.nets' (your --batch and --loss name functions as MODULE:FUNCTION: so must --model, e.g. "
     "mypkg.nets:build)"),
])
def test_messages_say_what_was_meant(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own
        code = e.code
    assert code == 2
    assert message in one_line(capsys.readouterr().err)


def test_bare_gradaccum_prints_its_usage_and_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gradaccum ") and "train" in err and "gradaccum <command> --help" in err, err


def test_eval_after_the_data_moved_names_the_saved_path(tmp_path, mnist_dir, capsys):
    """The saved data path is gone: eval said "--data-path ...: no such directory", a flag the user
    never passed; now it says where the model was trained and which flag gives the new place."""
    data, out = tmp_path / "mnist", tmp_path / "m"
    shutil.copytree(mnist_dir, data)
    assert main(["train", "--task", "mnist", "--data-path", str(data), "--micro-batch-size", "16", "--out", str(out),
                 *FAST]) == 0
    data.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err == (f"gradaccum eval: error: {out}/last.pt was trained on {data}, which no longer exists; pass "
                   "--data-path with where that folder is now\n"), err
    assert main(["eval", "--checkpoint", str(out), "--data-path", str(tmp_path / "moved")]) == 0


def test_counts_of_one_are_singular(tmp_path, capsys):
    from gradaccum.cli.train_command import steps_phrase

    assert steps_phrase([{"num_items": 1, "window_items": 1}], "images", "images") == "1 step of 1 image"
    assert steps_phrase([{"num_items": 3, "window_items": 1}], "tokens", "sequences") == \
        "1 step of 1 sequence, 3 tokens per step (all ranks)"
    one = tmp_path / "one.txt"
    one.write_text("just one line of text\n")
    assert main(["train", "--task", "text", "--data-path", str(one), "--out", str(tmp_path / "x"), *FAST]) == 2
    assert "too little text (1 usable line of 2 bytes or more; need 10)" in one_line(capsys.readouterr().err)
