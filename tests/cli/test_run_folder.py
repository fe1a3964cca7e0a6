"""The run folder (gradaccum.cli.lifecycle): reuse, --overwrite, --resume decisions, one-line errors
that change nothing on disk, a read-only --out, a full disk, and a second signal during a write."""
from __future__ import annotations

import fractions
import io
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradaccum.cli import main

from .test_cli import FAST, ROOT, cli_env, load, temp_files, train_rows

MLP = ["--model", "mlp", *FAST]  # 12 steps of 128 digits


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes and modification time: equal means untouched."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def steps_in(out: Path) -> list:
    return [r["step"] for r in train_rows(out)]


def lifecycle(out: Path, *, resume: bool = False, **kwargs):
    """A run's life over its folder, as ``gradaccum train`` makes them (the folder not locked)."""
    from gradaccum.cli.folder import RunFolder
    from gradaccum.cli.lifecycle import RunLifecycle

    folder = RunFolder(out, resume=resume, overwrite=False, sharded=False, say=print)
    return RunLifecycle(folder, **{"command": "gradaccum train --resume", **kwargs})


def assert_one_clean_line(err: str, command: str = "train") -> None:
    assert err.startswith(f"gradaccum {command}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "\x1b" not in err, err
    assert not re.search(r"\b\w*(Error|Exception)\b", err), f"a Python exception name: {err}"


def test_a_folder_holding_another_run_is_refused_untouched_and_overwrite_replaces_only_that_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *MLP]) == 0
    (out / "notes.txt").write_text("the user's own file")
    (out / "baseline").mkdir()  # what --compare leaves: the one-batch run's folder
    (out / "baseline" / "metrics.jsonl").write_text("{}\n")
    before = snapshot(out)
    capsys.readouterr()

    assert main(["train", "--out", str(out), "--model", "mlp", "--epochs", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    (events,) = [p.name for p in out.glob("events.out.tfevents.*")]
    assert_one_clean_line(err)
    assert (f"--out {out} holds another run (last.pt, metrics.jsonl, metrics.csv, summary.json, loss.png, "
            f"{events}, baseline); "
            "pass --resume to continue it, --overwrite to replace it, or another --out") in err
    assert snapshot(out) == before, "a refused run touched the folder"

    assert main(["train", "--out", str(out), "--overwrite", "--model", "mlp", "--epochs", "2", "--device", "cpu"]) == 0
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert not (out / "baseline").exists()
    assert steps_in(out) == list(range(1, 25))
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2
    assert load(out / "last.pt")["accumulator"]["steps"] == 24


def test_resume_with_nothing_to_resume_says_so_in_one_line_and_starts_fresh(tmp_path, capsys):
    out = tmp_path / "new"
    assert main(["train", "--out", str(out), "--resume", *MLP]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "/12 (" not in line]  # not progress
    assert err == [f"gradaccum train: --resume: nothing to resume in {out} (no last.pt); starting from step 0"]
    assert steps_in(out) == list(range(1, 13))


def test_resume_refuses_fewer_epochs_and_leaves_a_finished_run_as_it_was(tmp_path, capsys):
    out = tmp_path / "done"
    assert main(["train", "--out", str(out), "--model", "mlp", "--epochs", "2", "--device", "cpu"]) == 0
    before = snapshot(out)
    capsys.readouterr()

    assert main(["train", "--out", str(out), "--resume", "--model", "mlp", "--epochs", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert_one_clean_line(err)
    assert f"--resume --epochs 1: {out}/last.pt already holds 2 epochs, 24 steps; pass --epochs 2 or more" in err

    assert main(["train", "--out", str(out), "--resume", "--model", "mlp", "--epochs", "2", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"gradaccum train: {out} is complete: 2 epochs, 24 steps; nothing to train; "
                            "summary.json left as it was\n")
    assert snapshot(out) == before, "summary.json (or anything else) was rewritten"

    # a Ctrl-C that fell after summary.json and before loss.png: resuming draws it, and only it
    (out / "loss.png").unlink()
    assert main(["train", "--out", str(out), "--resume", "--model", "mlp", "--epochs", "2", "--device", "cpu"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == f"gradaccum train: drew {out}/loss.png, which was missing, from metrics.jsonl"
    assert (out / "loss.png").stat().st_size > 0
    assert {k: v for k, v in snapshot(out).items() if k != "loss.png"} == {k: v for k, v in before.items() if k != "loss.png"}
    before = snapshot(out)

    # another window (--accum-steps fixes B = M x N x W): refused, with the flags that keep it
    assert main(["train", "--out", str(out), "--resume", "--model", "mlp", "--epochs", "3", "--device", "cpu",
                 "--accum-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert_one_clean_line(err)
    assert ("--batch-size 128 (now 64); --batch-size is the global batch: on another number of ranks pass "
            "--batch-size 128 and drop --accum-steps") in err, err
    assert snapshot(out) == before

    # a setting that was not given reads as a flag, not as None (#26 item 14: "--max-grad-norm None (now 1.0)")
    assert main(["train", "--out", str(out), "--resume", "--model", "mlp", "--epochs", "3", "--device", "cpu",
                 "--max-grad-norm", "1.0"]) == 2
    err = capsys.readouterr().err
    assert_one_clean_line(err)
    assert "was written with other settings: no --max-grad-norm (now --max-grad-norm 1.0); resume with" in err, err
    assert snapshot(out) == before


def _make(tmp_path: Path, kind: str) -> Path:
    """A file for the error cases below."""
    path = tmp_path / f"{kind}.pt"
    if kind == "a_file":
        path.write_text("not a folder")
    elif kind == "garbage":
        path.write_bytes(b"PK\x03\x04 not a checkpoint")
    elif kind == "truncated":
        buffer = io.BytesIO()
        torch.save({"model": torch.zeros(1000)}, buffer)
        path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    elif kind == "flipped":  # a whole archive with one byte of a tensor changed: loads, as other weights
        buffer = io.BytesIO()
        torch.save({"model": torch.arange(1000.0)}, buffer)
        data = bytearray(buffer.getvalue())
        at = bytes(data).index(torch.arange(1000.0).numpy().tobytes()) + 2001
        data[at] ^= 0x40
        path.write_bytes(bytes(data))
    elif kind == "pickled":  # a whole archive that weights_only=True refuses (torch's text has ANSI bold)
        torch.save({"model": fractions.Fraction(1, 3)}, path)
    return path


@pytest.mark.parametrize("writer", ["gradaccum", "torch.save"])
def test_any_damaged_byte_of_a_checkpoint_is_refused_in_one_line_or_loads_the_same(tmp_path, writer):
    """Every byte of a small checkpoint flipped in turn: load_checkpoint returns the very tensors it
    saved or refuses with its one-line CLIError, never another exception (a damaged zip header raises
    anything from BadZipFile to UnicodeDecodeError and NotImplementedError). Written by gradaccum (with
    a checksum of its contents) and by a plain torch.save (an older checkpoint: the records' CRCs)."""
    from gradaccum.cli.checkpoint import load_checkpoint, save_atomic
    from gradaccum.cli.errors import CLIError

    saved = {"model": torch.arange(40.0), "step": torch.tensor(3), "config": {"lr": 0.1, "seed": 0}}
    path = tmp_path / "last.pt"
    save_atomic(saved, path) if writer == "gradaccum" else torch.save(saved, path)
    good = path.read_bytes()
    outcomes = {"refused": 0, "same": 0}
    for at in range(len(good)):
        damaged = bytearray(good)
        damaged[at] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            state = load_checkpoint(path, required=())
        except CLIError as e:
            assert "left in place" in str(e) and "\n" not in str(e), (at, e)
            outcomes["refused"] += 1
        else:  # a byte no reader looks at (zip padding, a comment): the same tensors
            outcomes["same"] += 1
            if writer == "torch.save":  # no checksum of the contents: a damaged zip directory can still
                continue  # make torch read a record from elsewhere; the CRCs catch damage inside records
            assert state.keys() == saved.keys() and torch.equal(state["model"], saved["model"]), at
            assert torch.equal(state["step"], saved["step"]) and state["config"] == saved["config"], at
        assert path.read_bytes() == bytes(damaged), "the file was changed"
    assert outcomes["refused"] > len(good) // 2, outcomes


def test_a_checkpoint_saved_without_checksums_loads():
    """torch.save under ``torch.utils.serialization.config.save.compute_crc32 = False`` stores CRC 0 for
    every record: there is nothing to compare, and the file is whole."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        pytest.skip("this torch always writes checksums")
    if not hasattr(config.save, "compute_crc32"):
        pytest.skip("this torch always writes checksums")
    from gradaccum.cli.checkpoint import load_checkpoint

    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "last.pt"
        config.save.compute_crc32 = False
        try:
            torch.save({"model": torch.arange(40.0)}, path)
        finally:
            config.save.compute_crc32 = True
        assert torch.equal(load_checkpoint(path, required=("model",))["model"], torch.arange(40.0))


@pytest.mark.parametrize("argv, message", [
    (["train", "--out", ""], "--out is an empty string; pass the folder for the run's files"),
    (["train", "--out", "{a_file}"], "--out {a_file} is a file, not a folder; pass a folder"),
    (["train", "--out", "{a_file}/run"], "--out {a_file}/run: {a_file} is a file, so no folder can be made under it"),
    (["train", "--batch-size", "256", "--accum-steps", "4", "--micro-batch-size", "32"],
     "--batch-size 256, --micro-batch-size 32 and --accum-steps 4 contradict each other: a window is micro-batch "
     "size x accum steps = 32 x 4 = 128 items, not 256; give two of the three"),
    (["train", "--micro-batch-size", "auto", "--accum-steps", "4"], "--accum-steps 4 does not apply with "
     "--micro-batch-size auto"),
    (["train", "--data-path", "{a_file}"], "--data-path {a_file} is not used by --task digits"),
    (["train", "--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
    (["eval", "--checkpoint", "{a_file}", "--device", "banana"], "--device must be one of cpu, cuda, auto, got 'banana'"),
    (["check", "--micro-batch-size", "auto"], "argument --micro-batch-size: must be an integer >= 1, got 'auto' "
     "('auto' is for train"),
    (["check", "--data-path", "{a_file}"], "--data-path {a_file} is not used by --task digits"),
    (["check", "--model", "nets"], "--model must be one of lenet5, mlp, transformer or your own MODULE:FUNCTION "
     "(e.g. mypkg.nets:build, with the colon), got 'nets'"),
    (["check", "--micro-batch-size", "100000", "--accum-steps", "2"], "--micro-batch-size 100000 on a batch of "
     "1438 items gives one micro-batch, which is only compared with itself; pass --micro-batch-size 719 or less"),
    (["check", "--micro-batch-size", "1", "--accum-steps", "1"], "--micro-batch-size 1 on a batch of 1 item gives "
     "one micro-batch, which is only compared with itself; pass --accum-steps 2 or more"),
    (["eval", "--checkpoint", "{garbage}"], "{garbage} is corrupt or unreadable (not a torch.save archive: empty, "
     "truncated or another format); it was left in place: restore a good copy, or evaluate another checkpoint\n"),
    (["eval", "--checkpoint", "{truncated}"], "{truncated} is corrupt or unreadable (not a torch.save archive"),
    (["eval", "--checkpoint", "{flipped}"], "{flipped} is corrupt or unreadable (the bytes of its record "
     "archive/data/0 do not match their stored checksum: damaged on disk or in transfer); it was left in place"),
    (["eval", "--checkpoint", "{pickled}"], "{pickled} is corrupt or unreadable (it holds objects that "
     "torch.load(weights_only=True) does not load); it was left in place"),
])
def test_user_errors_are_one_clean_line_and_change_nothing(tmp_path, capsys, monkeypatch, argv, message):
    """Exit 2, one line naming the flag, the value and the fix; no traceback, exception name or ANSI
    escape (torch's own text has them); nothing on disk changes."""
    files = {k: str(_make(tmp_path, k)) for k in ("a_file", "garbage", "truncated", "flipped", "pickled")}
    monkeypatch.chdir(tmp_path)  # the default --out runs/latest would land here
    argv = [a.format(**files) for a in argv]
    if argv[0] == "train":
        argv += ["--epochs", "1", "--device", "cpu"]
    before = snapshot(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert_one_clean_line(err, argv[0])
    assert message.format(**files) in err, err
    assert snapshot(tmp_path) == before


def _read_only_folder_command(folder: Path, args: list) -> list:
    """Run the CLI with ``folder`` on a real read-only filesystem: a read-only tmpfs mounted in a
    private mount namespace (works as root and, with user namespaces, as any user)."""
    cli = shlex.join([sys.executable, "-m", "gradaccum", *args])
    return ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro gradaccum-ro {shlex.quote(str(folder))} && exec {cli}"]


def _chmod_stops_writes(folder: Path) -> bool:
    """Does a folder without write permission stop this process? Not for root (CAP_DAC_OVERRIDE)."""
    folder.chmod(0o555)
    try:
        (folder / "probe").write_text("x")
    except PermissionError:
        return True
    finally:
        folder.chmod(0o755)
    (folder / "probe").unlink()
    return False


def test_out_on_a_read_only_filesystem_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A real read-only mount where the machine allows one (root, or user namespaces), else a folder
    without write permission (any user but root), else, for root without namespaces only, a stand-in."""
    folder = tmp_path / "ro"
    folder.mkdir()
    args = ["train", "--out", str(folder / "run"), *MLP]
    mount = f"mount -t tmpfs -o ro gradaccum-ro {shlex.quote(str(folder))}"
    if shutil.which("unshare") and subprocess.run(["unshare", "-rm", "sh", "-c", mount], capture_output=True).returncode == 0:
        proc = subprocess.run(_read_only_folder_command(folder, args), capture_output=True, text=True,
                              env=cli_env(), cwd=ROOT, timeout=300)
        code, err, words = proc.returncode, proc.stderr, "is on a read-only filesystem"
    elif _chmod_stops_writes(folder):
        folder.chmod(0o555)
        try:
            proc = subprocess.run([sys.executable, "-m", "gradaccum", *args], capture_output=True, text=True,
                                  env=cli_env(), cwd=ROOT, timeout=300)
        finally:
            folder.chmod(0o755)
        code, err, words = proc.returncode, proc.stderr, "is not writable (permission denied)"
    else:  # pragma: no cover - root without namespaces: chmod does not stop root
        from gradaccum.cli import folder

        monkeypatch.setattr(folder.os, "access", lambda *a, **k: False)
        monkeypatch.setattr(folder, "_read_only", lambda path: True)
        code, err, words = main(args), capsys.readouterr().err, "is on a read-only filesystem"
    assert code == 2
    assert_one_clean_line(err)
    assert f"--out {folder}/run" in err and words in err and "pass a folder" in err, err
    assert list(folder.iterdir()) == []


def _full_disk(limit: int):
    """In the child: files may not grow past ``limit`` bytes (EFBIG, as a full disk gives ENOSPC);
    works for root too. SIGXFSZ ignored, so the write fails instead of killing the process."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_failed_final_checkpoint_keeps_the_previous_one_and_the_summary_and_metrics(tmp_path, capsys):
    """The disk fills up at the final checkpoint: the previous checkpoint stays whole, one line says
    so (exit 1), and metrics.jsonl and summary.json of the whole run are written."""
    out = tmp_path / "full"
    assert main(["train", "--out", str(out), *MLP]) == 0  # a checkpoint at step 12 (2.4 MB)
    args = ["train", "--out", str(out), "--resume", "--model", "mlp", "--epochs", "2", "--device", "cpu",
            "--checkpoint-every", "5"]
    proc = subprocess.run([sys.executable, "-m", "gradaccum", *args], capture_output=True, text=True, env=cli_env(),
                          cwd=ROOT, timeout=300, preexec_fn=_full_disk(400_000))
    assert proc.returncode == 1, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "/24 (" not in line]  # not progress
    assert said[0] == f"gradaccum train: --resume: continuing {out} from step 12 (epoch 1, window 0) of last.pt"
    assert said[1] == (f"gradaccum train: warning: the checkpoint at step 15 (epoch 1, window 3) could not be "
                       f"written (File too large); {out}/last.pt still holds step 12 (epoch 1, window 0); "
                       "training goes on")  # once: step 20 fails too, silently
    assert len(said) == 3
    last = said[-1]
    assert last == (f"gradaccum train: error: the final checkpoint could not be written to {out}/last.pt (File too "
                    "large); it still holds step 12 (epoch 1, window 0); metrics.jsonl and summary.json were "
                    f"written; free some space in {out}, then run the same command with --resume to finish")
    assert load(out / "last.pt")["accumulator"]["steps"] == 12
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["checkpoint"]["step"] == 12
    assert summary["checkpoint"]["error"] == "File too large"
    assert steps_in(out) == list(range(1, 25))
    assert temp_files(out) == []


def test_a_failed_final_checkpoint_with_none_before_it_does_not_suggest_resume(tmp_path):
    """No checkpoint was ever written: --resume would have nothing to continue, so the line says how
    to train again instead."""
    out = tmp_path / "full"
    proc = subprocess.run([sys.executable, "-m", "gradaccum", "train", "--out", str(out), *MLP], capture_output=True,
                          text=True, env=cli_env(), cwd=ROOT, timeout=300, preexec_fn=_full_disk(400_000))
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.endswith("no checkpoint exists; metrics.jsonl and summary.json were written; free some space in "
                         f"{out}, then run the same command with --overwrite to train again (no checkpoint holds "
                         "this run)"), last
    assert not (out / "last.pt").exists() and temp_files(out) == []
    assert json.loads((out / "summary.json").read_text())["checkpoint"]["step"] is None


def test_a_second_signal_during_a_checkpoint_write_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path, capfd):
    """Real signals to this process: the first asks to stop; the second arrives half-way through the
    checkpoint that the stop writes. It leaves at once with 130, after removing the temporary file;
    last.pt is the previous one, whole. (The process exit is replaced, to keep pytest alive.)"""
    from gradaccum.cli.folder import Position

    class Left(BaseException):
        pass

    def leave(code: int) -> None:
        assert temp_files(tmp_path) == [], "the handler itself removes the half-written file"
        raise Left(code)

    life = lifecycle(tmp_path, exit=leave)
    life.save(Position(0, 1, 1), lambda: {"step": torch.tensor(1)})  # the previous checkpoint

    class SecondCtrlC:
        def __reduce__(self):  # runs while torch.save writes the temporary file
            assert temp_files(tmp_path) == [".last.pt.tmp-%d" % os.getpid()]
            os.kill(os.getpid(), signal.SIGINT)
            return (int, (0,))

    try:
        with life.handling_signals():
            asked = []
            life.on_stop_signal(lambda: asked.append(True))  # acc.request_stop in a run
            os.kill(os.getpid(), signal.SIGINT)  # the first: finish the window, then a checkpoint
            assert asked == [True]
            with pytest.raises(Left) as left:  # the window's StepResult.stop_requested carried it
                assert life.stop_here(True)
                life.stop(Position(0, 2, 2), lambda: {"step": torch.tensor(2), "half": SecondCtrlC()})
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # on its way out: a third is ignored
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert left.value.args == (130,)
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("gradaccum train: SIGINT received: finishing this window")
    assert err[1] == (f"gradaccum train: second SIGINT: stopped at once, without a new checkpoint; {tmp_path}/last.pt "
                      "is whole and holds step 1 (epoch 0, window 1); resume with: gradaccum train --resume")
    assert temp_files(tmp_path) == []
    assert load(tmp_path / "last.pt")["step"] == 1


def test_signal_handlers_are_restored_after_a_run_that_was_not_stopped(tmp_path):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with lifecycle(tmp_path).handling_signals():
        assert signal.getsignal(signal.SIGINT) not in before
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_resume_keeps_the_metrics_lines_of_the_checkpoint_and_drops_a_torn_one(tmp_path):
    """kill -9 can leave steps after the checkpoint, and a last line cut in half: neither comes back.
    Rows are kept by their (epoch, window) position: a skipped window repeats the step before it."""
    from gradaccum.cli.folder import Position

    at = [(0, 0, 1), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4)]  # (epoch, window, step): window 1 skipped
    rows = [json.dumps({"step": s, "epoch": e, "window": w, "loss": 1.0 / s}) for e, w, s in at]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 5, "lo')
    folder = lifecycle(tmp_path, resume=True).folder
    assert [r["window"] for r in folder.kept_history(Position(0, 2, 1))] == [0, 1]  # the skip kept, not step 2
    assert [r["step"] for r in folder.kept_history(Position(1, 0, 2))] == [1, 1, 2]
    assert [r["step"] for r in folder.kept_history(Position(9, 0, 9))] == [1, 1, 2, 3, 4]


def test_a_stop_is_decided_by_the_window_flag_and_names_the_signal_of_any_rank(tmp_path, monkeypatch):
    """Under torchrun a signal reaches the ranks in the window's StepResult.stop_requested (the same
    on every rank); a rank that received none stops too, and one all-reduce on that window alone
    tells it which signal stopped the run. No window without a stop pays a collective."""
    from gradaccum.cli import signals

    life = lifecycle(tmp_path / "run")
    monkeypatch.setattr(signals.sync, "is_distributed", lambda: True)
    calls = []

    def all_reduce_(tensor, op="sum", group=None):
        calls.append(op)
        tensor.fill_(int(signal.SIGTERM))  # a peer received SIGTERM; this rank none
        return tensor

    monkeypatch.setattr(signals.sync, "all_reduce_", all_reduce_)
    assert life.signals.stop_requested(False) is False and calls == []  # no stop: no collective
    assert life.signals.stop_requested(True) is True and calls == ["max"]
    assert life.signals.stopping == signal.SIGTERM
