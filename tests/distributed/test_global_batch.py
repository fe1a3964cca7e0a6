"""The global batch is the invariant (#11), end to end through `gradaccum train` under torchrun.

The same seed and --batch-size train the same model on 1, 2 and 3 ranks; a run stopped by Ctrl-C on
W ranks continues on W' ranks; a worker killed with SIGKILL under `torchrun --max-restarts` is
restarted and the run ends as if nothing happened; --shard's DCP checkpoint resumes on another world
size. float64 throughout, so that "the same model" is asserted to 1e-9 (different world sizes add in
another order) and "the same run" to the bit (same world size).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch

from distributed.launch import kill_tree, run_cli_here, start_cli, start_torchrun, torchrun

pytestmark = pytest.mark.distributed

STEPS = 46  # digits: 1438 training images, windows of 64: 23 per epoch, 2 epochs
# the MLP, not LeNet-5: what is asserted (one global batch whatever the world size, a resume to the bit)
# is about the sharding, the weighting and the checkpoint, not the model, and the MLP trains the 46
# steps in about 40% of LeNet-5's CPU time, in each of this module's five launches
COMMON = ["train", "--model", "mlp", "--dtype", "float64", "--batch-size", "64", "--epochs", "2",
          "--optimizer", "adamw", "--lr", "0.001", "--device", "cpu"]
# a last window of one item: 1438 images in windows of 1437
LAST_WINDOW = ["train", "--model", "mlp", "--dtype", "float64", "--batch-size", "1437", "--micro-batch-size", "256",
               "--epochs", "1", "--device", "cpu"]


def train(out: Path, *extra: str, micro: int = 8) -> list:
    return [*COMMON, "--micro-batch-size", str(micro), "--out", str(out), *extra]


def module(args: list) -> list:
    return ["-m", "gradaccum", *args]


def model_of(out: Path) -> dict:
    return torch.load(out / "last.pt", weights_only=True)["model"]


def rows(out: Path) -> list:
    """The training windows' rows of metrics.jsonl (not the test metrics at each epoch's end)."""
    every = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in every if r.get("kind", "train") == "train"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def on_2_ranks(tmp_path_factory, request):
    """The 2-rank runs whose point is what they train and write, one after the other in one launch
    (distributed/cli_runs.py: each rank's ``gradaccum.cli.main``; a launch costs 3 processes' imports):
    the uninterrupted run (``ranks2``), a one-epoch run and its resume for a second epoch (``resumed``),
    a last window smaller than the ranks (``last-window``), a run of one window (``one-window``),
    ``--compare`` (``compare``), one epoch sharded by FSDP2 (``sharded``), a run stopped by Ctrl-C on 1
    rank and continued here (``grown``), and a copy of the 2-rank run stopped by Ctrl-C
    (``ctrl_c_on_2_ranks``), resumed here (``stopped``). What
    stops a run (a signal to a process or to torchrun's group) and what restarts one stays a process of
    its own, as a user's is; so does a plain launch to its exit (the 3-rank run, the restarted group of
    the max-restarts test). Each test asserts its own runs (:meth:`TwoRankRuns.ran`): a stop that went
    wrong, or a run that failed, fails the tests that read it, and says why."""
    made = tmp_path_factory.mktemp("on-2-ranks")
    runs = TwoRankRuns(made)
    commands = {"ranks2": train(made / "ranks2"),
                "resumed: first epoch": train(made / "resumed", "--epochs", "1"),  # the last --epochs counts
                "resumed: second epoch": train(made / "resumed", "--resume"),
                "last-window": [*LAST_WINDOW, "--out", str(made / "last-window")],
                "one-window": [*LAST_WINDOW, "--batch-size", "1438", "--out", str(made / "one-window")],
                "compare": ["train", "--model", "mlp", "--device", "cpu", "--epochs", "1", "--micro-batch-size", "8",
                            "--accum-steps", "4", "--compare", "--out", str(made / "compare")],
                "sharded": train(made / "sharded", "--shard", "--epochs", "1")}
    try:
        runs.grown_code, runs.grown_log = stop_on_1_rank(made / "grown")
        runs.held["grown"] = steps_held(made / "grown")
        commands["grown"] = train(made / "grown", "--resume")
    except Exception as e:  # noqa: BLE001 - the tests that read it fail with it
        runs.failed["grown"] = f"the 1-rank run was not stopped by Ctrl-C as planned: {e!r}"[:3000]
    try:
        stopped, log = request.getfixturevalue("ctrl_c_on_2_ranks")(made / "stopped")
        runs.stopped_log, runs.held["stopped"] = log.read_text(), steps_held(stopped)
        commands["stopped"] = train(stopped, "--resume")
    except Exception as e:  # noqa: BLE001 - as above
        runs.failed["stopped"] = f"the 2-rank run was not stopped by Ctrl-C as planned: {e!r}"[:3000]
    (made / "runs.json").write_text(json.dumps(commands))
    try:
        proc = torchrun([str(Path(__file__).with_name("cli_runs.py")), str(made / "runs.json")], timeout=600)
        runs.said, runs.exit_code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        runs.said, runs.exit_code = f"{e.output or ''}{e.stderr or ''}\n== killed after {e.timeout} s ==", -9
    runs.codes = dict(line[4:].rsplit(" [", 1) for line in runs.said.splitlines() if line.startswith("RAN "))
    return runs


@dataclasses.dataclass
class TwoRankRuns:
    folder: Path
    said: str = ""  # the launch's output, every rank's
    exit_code: Optional[int] = None
    codes: dict = dataclasses.field(default_factory=dict)  # run name: "0, 0]", or "rank R: CODE]" where it failed
    failed: dict = dataclasses.field(default_factory=dict)  # run name: why it was not run
    held: dict = dataclasses.field(default_factory=dict)  # each stopped run's checkpointed step, before its resume
    grown_code: Optional[int] = None  # the 1-rank run's exit code at Ctrl-C
    grown_log: str = ""
    stopped_log: str = ""  # torchrun's log of the 2-rank run stopped by Ctrl-C

    def ran(self, name: str) -> Path:
        """The folder of run ``name`` (every command ``name`` or ``name: ...``), once each exited 0 on both ranks."""
        assert name not in self.failed, self.failed[name]
        for command in [c for c in json.loads((self.folder / "runs.json").read_text()) if c.split(":")[0] == name]:
            code = self.codes.get(command)
            assert code == "0, 0]", (f"run {command!r} of the launch: {'not run' if code is None else '[' + code}; "
                                     f"the launch exited {self.exit_code}: every run's line "
                                     f"{[c + ' [' + k for c, k in self.codes.items()]}\n{self.said[-3000:]}")
        return self.folder / name


def stop_on_1_rank(out: Path) -> Tuple[int, str]:
    """``gradaccum train`` as one process, Ctrl-C after 5 steps: its exit code and its output."""
    log = out.parent / f"{out.name}.log"
    proc = start_cli(train(out), log=log)
    try:
        wait_for_rows(out, proc, 5, log)
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=120), log.read_text()
    finally:
        kill_tree(proc)


def steps_held(out: Path) -> int:
    return torch.load(out / "last.pt", weights_only=True)["accumulator"]["steps"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """The uninterrupted run on W ranks, made once per W (on 1 rank in this process: its process is not
    what a test here is about, and a process costs its imports; on 2 in the launch of ``on_2_ranks``)."""
    made = {}

    def run(world: int) -> Path:
        if world == 2:
            return request.getfixturevalue("on_2_ranks").ran("ranks2")
        if world not in made:
            out = tmp_path_factory.mktemp(f"ranks{world}")
            proc = run_cli_here(train(out)) if world == 1 else torchrun(module(train(out)), nproc=world)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
            made[world] = out
        return made[world]
    return run


@pytest.fixture
def started():
    """Processes a test starts; whatever still runs at teardown (a test that failed, a run that hung)
    is killed with every descendant (torchrun starts each worker in a session of its own)."""
    procs: list = []
    yield procs
    for proc in procs:
        kill_tree(proc)


@pytest.fixture(scope="module")
def ctrl_c_on_2_ranks(tmp_path_factory):
    """One 2-rank run stopped by Ctrl-C to torchrun's process group, as a terminal sends it (torchrun
    forwards it to its workers, which run in sessions of their own), after 6 steps: its folder and log.
    Made once, copied for each resume (on 1 rank in this process; on 2 in the launch of ``on_2_ranks``):
    each starts from the stopped run's files as they were."""
    made = tmp_path_factory.mktemp("ctrl-c")
    out, log = made / "run", made / "torchrun.log"
    proc = start_torchrun(module(train(out)), log=log)
    try:
        wait_for_rows(out, proc, 6, log)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc)

    def copy(to: Path):
        """The stopped run's folder at ``to`` (the paths it records, such as the resume command's --out,
        are its own: a test reads them from its copy's log with the folder's name replaced)."""
        shutil.copytree(out, to)
        said = log.read_text().replace(str(out), str(to))
        (to.parent / "torchrun.log").write_text(said)
        return to, to.parent / "torchrun.log"
    return copy


def wait_for_rows(out: Path, proc, n: int, log: Path, *, checkpoint: bool = False) -> None:
    """Wait until ``n`` steps are in metrics.jsonl (and, with ``checkpoint``, last.pt exists)."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n and (
                not checkpoint or (out / "last.pt").exists()):
            return
        time.sleep(0.005)
    raise AssertionError(f"no {n} steps before the run ended or 180 s passed:\n{log.read_text()[-3000:]}")


def test_the_same_seed_and_global_batch_train_the_same_model_on_1_2_and_3_ranks(runs):
    one = runs(1)
    counts = [r["num_items"] for r in rows(one)]
    assert len(counts) == STEPS and counts[0] == 64 and counts[22] == 1438 - 22 * 64
    for world in (2, 3):
        out = runs(world)
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["world_size"], summary["global_batch_size"], summary["steps"]) == (world, 64, STEPS)
        assert summary["accum_steps"] == -(-64 // (8 * world))  # per rank: 4 on 2 ranks, 3 on 3 (shares of 21, 21 and 22: uneven)
        assert [r["num_items"] for r in rows(out)] == counts  # every step saw the same global items
        assert max_diff(model_of(one), model_of(out)) < 1e-9


def test_on_2_ranks_rank_0_writes_and_a_resume_for_a_second_epoch_is_the_two_epoch_run(runs, on_2_ranks):
    """`gradaccum train` on 2 ranks: one writer (rank 0's files, one event file), an eval row at each
    epoch's end, and a one-epoch run resumed for a second epoch equals the uninterrupted two-epoch run,
    to the bit. No rank of any run in the launch prints the profiler's C++ warning about memory allocated
    before it started (the memory meter's own noise)."""
    whole, out = runs(2), on_2_ranks.ran("resumed")
    assert "Memory block of unknown size" not in on_2_ranks.said, on_2_ranks.said[-3000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    every = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in every if r.get("kind") == "eval"] == [0, 1]
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1)), "duplicate or missing metric lines"
    a, b = model_of(whole), model_of(out)
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run changed the training"
    assert summary["last_loss"] == rows(whole)[-1]["loss"]
    names = sorted(p.name for p in whole.iterdir() if not p.name.startswith("events.out.tfevents"))
    assert names == ["last.pt", "loss.png", "metrics.csv", "metrics.jsonl", "summary.json"], names
    assert sum(p.name.startswith("events.out.tfevents") for p in whole.iterdir()) == 1  # rank 0's


def test_stopped_on_2_ranks_by_ctrl_c_continues_on_1_rank(runs, ctrl_c_on_2_ranks, tmp_path):
    """Ctrl-C to torchrun's process group, as a terminal sends it (torchrun forwards it to its workers,
    which run in sessions of their own): they agree to stop after the same window and write one
    checkpoint, mid-epoch; one process then finishes the run, with another micro-batch size too, and
    ends with the model of the uninterrupted runs."""
    out, log = ctrl_c_on_2_ranks(tmp_path / "moved")
    held = torch.load(out / "last.pt", weights_only=True)
    assert 5 <= held["accumulator"]["steps"] < STEPS, log.read_text()[-3000:]
    said = log.read_text()
    assert said.count("SIGINT: stopped after step") == 1  # one line, from rank 0
    assert "second SIGINT: stopped at once" not in said  # torchrun's forwarded copy is not a second Ctrl-C
    # the same launcher, runnable as printed: this Python's torchrun (after `make demo` none is on PATH)
    assert " --standalone --nproc_per_node=2 -m gradaccum train " in said, said[-2000:]
    launcher = shlex.split(said.split("resume with: ")[1].split(" --standalone")[0])[0]
    ours = Path(sys.executable).parent / "torchrun"
    if ours.exists():
        assert Path(shutil.which(launcher) or launcher).resolve() == ours.resolve(), launcher
    resumed = run_cli_here(train(out, "--resume", micro=4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing {out} from step {held['accumulator']['steps']}" in resumed.stderr
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    assert max_diff(model_of(runs(1)), model_of(out)) < 1e-9


def test_ctrl_c_on_2_ranks_resumes_on_2_ranks_to_the_bit(runs, on_2_ranks):
    """Ctrl-C on 2 ranks: the stop request rides in the next window's boundary (the first line says
    so); the run resumed on 2 ranks ends with the model of the uninterrupted run, to the bit."""
    out = on_2_ranks.ran("stopped")
    said, held = on_2_ranks.stopped_log, on_2_ranks.held["stopped"]
    assert "SIGINT received: finishing this window, then writing a checkpoint" in said, said[-3000:]
    assert 5 <= held < STEPS, (held, said[-3000:])
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    whole, after = model_of(runs(2)), model_of(out)
    assert all(torch.equal(whole[k], after[k]) for k in whole)


def test_a_signal_to_one_worker_stops_every_rank_after_the_same_window(tmp_path, started):
    """SIGTERM to rank 1's worker alone (a scheduler preempting one process): the ranks all-reduce the
    stop flag after each window, so rank 0 stops with it after the same window instead of waiting for
    it forever; one checkpoint, one line."""
    psutil = pytest.importorskip("psutil")
    out, log = tmp_path / "one", tmp_path / "torchrun.log"
    proc = start_torchrun(module(train(out)), log=log)
    started.append(proc)
    wait_for_rows(out, proc, 5, log)
    workers = {p.environ().get("RANK"): p for p in psutil.Process(proc.pid).children(recursive=True)
               if p.environ().get("RANK") is not None}
    workers["1"].send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    said = log.read_text()
    held = torch.load(out / "last.pt", weights_only=True)["accumulator"]["steps"]
    assert 5 <= held < STEPS, said[-3000:]
    assert said.count(f"SIGTERM: stopped after step {held} of {STEPS}") == 1, said[-3000:]


def test_stopped_on_1_rank_continues_on_2_ranks(runs, on_2_ranks):
    """Ctrl-C to one process: it exits 130 after a checkpoint, mid-epoch; continued on 2 ranks, the run
    ends with the model of the uninterrupted runs."""
    out = on_2_ranks.ran("grown")
    assert on_2_ranks.grown_code == 130, on_2_ranks.grown_log[-3000:]
    assert 5 <= on_2_ranks.held["grown"] < STEPS, on_2_ranks.grown_log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    assert max_diff(model_of(runs(1)), model_of(out)) < 1e-9


def test_a_worker_killed_under_max_restarts_is_restarted_and_the_run_ends_as_the_uninterrupted_one(runs, tmp_path,
                                                                                                  started):
    """`torchrun --max-restarts=1 ... train --resume --checkpoint-every 5`: the first start has nothing
    to resume and says so; SIGKILL to rank 1's worker mid-run makes torchrun restart the group, which
    continues from the last checkpoint. Same world size: the model equals the uninterrupted one to the bit,
    and each step is in the metrics exactly once."""
    psutil = pytest.importorskip("psutil")
    out, log = tmp_path / "elastic", tmp_path / "elastic.log"
    proc = start_torchrun(module(train(out, "--resume", "--checkpoint-every", "5")), log=log,
                          extra=["--max-restarts=1"])
    started.append(proc)
    wait_for_rows(out, proc, 12, log, checkpoint=True)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if p.environ().get("RANK") == "1" and p.environ().get("TORCHELASTIC_RESTART_COUNT") == "0"]
    assert len(workers) == 1, workers
    workers[0].send_signal(signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    said = log.read_text()
    assert said.count("--resume: nothing to resume") == 1  # rank 0 of the first start, one line
    assert "torchrun restart 1: continuing" in said
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    whole, after = model_of(runs(2)), model_of(out)
    assert all(torch.equal(whole[k], after[k]) for k in whole)


def test_sharded_on_2_ranks_resumes_on_1_rank_from_its_dcp_checkpoint(runs, on_2_ranks, tmp_path):
    """--shard: FSDP2 over 2 ranks, the checkpoint a torch.distributed.checkpoint folder. A crash that
    fell between its two renames (previous folder set aside, a half-written one beside it) still
    resumes from the complete one, on 1 rank; the result is the model of the unsharded runs."""
    out = tmp_path / "sharded"
    shutil.copytree(on_2_ranks.ran("sharded"), out)
    assert (out / "last.dcp" / "gradaccum.pt").is_file() and not (out / "last.pt").exists()
    os.replace(out / "last.dcp", out / ".last.dcp.old")
    (out / ".last.dcp.tmp-dcp").mkdir()
    (out / ".last.dcp.tmp-dcp" / "__0_0.distcp").write_bytes(b"half written")
    resumed = run_cli_here(train(out, "--shard", "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing {out} from step 23 (epoch 1, window 0) of last.dcp" in resumed.stderr
    assert not (out / ".last.dcp.tmp-dcp").exists() and not (out / ".last.dcp.old").exists()
    shown = run_cli_here(["eval", "--checkpoint", str(out / "last.dcp"), "--device", "cpu"])
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["step"] == STEPS
    import torch.distributed.checkpoint as dcp

    like = {k: torch.zeros_like(v) for k, v in model_of(runs(1)).items()}
    state = {"model": like}
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):
        dcp.load(state, checkpoint_id=str(out / "last.dcp"), no_dist=True)
    assert max_diff(model_of(runs(1)), state["model"]) < 1e-9


def test_a_last_window_smaller_than_the_ranks_leaves_one_rank_without_data_and_nothing_hangs(tmp_path, on_2_ranks):
    """1438 images in windows of 1437: the last window holds one item, on rank 1 alone. Rank 0 still
    runs a zero-weight forward (DDP's forward collectives), both ranks step, and the model is the
    one-process model."""
    one, two = tmp_path / "one", on_2_ranks.ran("last-window")
    proc = run_cli_here([*LAST_WINDOW, "--out", str(one)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["num_items"] for r in rows(two)] == [r["num_items"] for r in rows(one)] == [1437, 1]
    assert max_diff(model_of(one), model_of(two)) < 1e-9
    assert json.loads((one / "summary.json").read_text())["peak_memory_bytes"] > 0  # one process: its last window


def test_a_run_of_fewer_than_3_windows_on_2_ranks_says_why_its_peak_memory_is_not_measured(on_2_ranks):
    """The CPU profiler measures one window; under DDP a process's first two free blocks allocated before
    them, which it cannot attribute (it said so in a C++ warning, which test_on_2_ranks_rank_0_writes_...
    looks for in the launch's output). A run of 2 windows, or of 1, says why its summary holds no peak."""
    for name in ("last-window", "one-window"):
        summary = json.loads((on_2_ranks.ran(name) / "summary.json").read_text())
        assert summary["steps"] == {"last-window": 2, "one-window": 1}[name]
        assert summary["peak_memory_bytes"] is None, summary
        assert "under DDP a process's first two windows free blocks" in summary["peak_memory_source"], summary


def test_compare_on_2_ranks_records_each_runs_window_as_its_summary_does(on_2_ranks):
    """compare.json gave the one-batch run's micro-batch size as 64 (the global batch), the
    accumulated run's as 8 (per rank) and baseline/summary.json as 32: each side now carries the
    global batch, the ranks and the per-rank split, read from its own summary.json (issue #26)."""
    out = on_2_ranks.ran("compare")
    report = json.loads((out / "compare.json").read_text())
    keys = ("global_batch_size", "world_size", "micro_batch_size", "accum_steps")
    for side, summary in (("accumulated", out / "summary.json"), ("one_batch", out / "baseline" / "summary.json")):
        summary = json.loads(summary.read_text())
        for key in keys:
            assert report[side].get(key) == summary[key], (side, key, report[side], summary)
    assert [report["accumulated"][k] for k in keys] == [64, 2, 8, 4]
    assert [report["one_batch"][k] for k in keys] == [64, 2, 32, 1]
