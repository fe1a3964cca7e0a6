"""cli/decision.py: fresh, resume or complete, decided from what the run folder holds (a Found) and the
flags alone; the folder's files are RunFolder's (test_run_folder.py runs the same decisions end to end)."""
from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest

from gradaccum.cli.config import TrainConfig
from gradaccum.cli.decision import Found, Position, decide_run
from gradaccum.cli.errors import CLIError

OUT = Path("/nowhere/run")  # never opened: the decision reads only the Found
CFG = TrainConfig(model="mlp", micro_batch_size=4, accum_steps=2, epochs=3)


def found(*artifacts: str, stray=(), state=None, other=None, summary=False, sharded=False) -> Found:
    checkpoint = OUT / ("last.dcp" if sharded else "last.pt")
    return Found(out=OUT, checkpoint=checkpoint, sharded=sharded, artifacts=[*artifacts, *stray], stray=list(stray),
                 has_checkpoint=state is not None, has_summary=summary, other_checkpoint=other, state=state)


def saved(epoch: int, window: int, steps: int, cfg: TrainConfig = CFG) -> dict:
    return {"epoch": epoch, "window": window, "accumulator": {"steps": steps}, "config": asdict(cfg)}


def test_without_resume_a_folder_with_only_torn_writes_starts_fresh_and_one_with_a_run_is_refused():
    plan = decide_run(found(stray=[".last.pt.tmp1"]), CFG, resume=False, overwrite=False)
    assert (plan.kind, plan.position, plan.remove, plan.note) == ("fresh", Position(0, 0, 0), [".last.pt.tmp1"], None)
    with pytest.raises(CLIError, match=r"holds another run \(last\.pt, metrics\.jsonl\); pass --resume"):
        decide_run(found("last.pt", "metrics.jsonl", stray=[".x.tmp"]), CFG, resume=False, overwrite=False)
    with pytest.raises(CLIError, match=r"torchrun restarted the workers \(restart 2\).*add --resume"):
        decide_run(found("last.pt"), CFG, resume=False, overwrite=False, restart_count=2)
    plan = decide_run(found("last.pt", "metrics.jsonl", state=saved(1, 0, 4)), CFG, resume=False, overwrite=True)
    assert (plan.kind, plan.remove) == ("fresh", ["last.pt", "metrics.jsonl"])


def test_resume_without_a_checkpoint_starts_fresh_unless_the_other_kind_is_there():
    plan = decide_run(found("metrics.jsonl"), CFG, resume=True, overwrite=False)
    assert plan.kind == "fresh" and plan.note == f"--resume: nothing to resume in {OUT} (no last.pt); starting from step 0"
    with pytest.raises(CLIError, match=r"holds last\.dcp, a sharded run's checkpoint; resume it with --shard"):
        decide_run(found(other="last.dcp"), CFG, resume=True, overwrite=False)
    with pytest.raises(CLIError, match=r"holds last\.pt, a non-sharded run's checkpoint; resume it without --shard"):
        decide_run(found(other="last.pt", sharded=True), CFG, resume=True, overwrite=False)


def test_resume_continues_completes_or_refuses_by_the_checkpoints_position():
    plan = decide_run(found("last.pt", stray=[".t"], state=saved(1, 2, 7)), CFG, resume=True, overwrite=False,
                      restart_count=1)
    assert (plan.kind, plan.position, plan.remove) == ("resume", Position(1, 2, 7), [".t"])
    assert plan.note == f"torchrun restart 1: continuing {OUT} from step 7 (epoch 1, window 2) of last.pt"
    plan = decide_run(found("last.pt", stray=[".u"], state=saved(3, 0, 12), summary=True), CFG, resume=True,
                      overwrite=False)
    assert (plan.kind, plan.position, plan.remove, plan.has_summary) == ("complete", Position(3, 0, 12), [".u"], True)
    assert plan.note.endswith("is complete: 3 epochs, 12 steps; nothing to train; summary.json left as it was")
    with pytest.raises(CLIError, match=r"already holds 3 epochs and 1 window, 13 steps; pass --epochs 4 or more"):
        decide_run(found("last.pt", state=saved(3, 1, 13)), CFG, resume=True, overwrite=False)


def test_resume_without_epochs_keeps_the_runs_length_and_a_given_one_grows_it():
    """A probe resumed a 20-epoch run without --epochs: the task's default (15) ended it 5 epochs early, in
    silence; 25 epochs stopped at 21 were refused naming an --epochs 15 the user never passed."""
    then = TrainConfig(model="mlp", micro_batch_size=4, accum_steps=2, epochs=20)
    flags = TrainConfig(model="mlp", micro_batch_size=4, accum_steps=2, epochs_given=False)  # the default: 15
    plan = decide_run(found("last.pt", state=saved(12, 3, 40, then)), flags, resume=True, overwrite=False)
    assert flags.epochs == 15 and plan.kind == "resume" and plan.config.epochs == 20
    plan = decide_run(found("last.pt", state=saved(21, 0, 70, replace(then, epochs=25))), flags, resume=True,
                      overwrite=False)
    assert plan.kind == "resume" and plan.config.epochs == 25
    grown = decide_run(found("last.pt", state=saved(12, 3, 40, then)), replace(flags, epochs=30, epochs_given=True),
                       resume=True, overwrite=False)
    assert grown.config.epochs == 30 and "epochs_given" not in grown.config.to_dict()


def test_resume_keeps_the_checkpoints_global_batch_and_refuses_other_settings():
    flags = TrainConfig(model="mlp", micro_batch_size=2, epochs=3)  # says nothing about the global batch (8)
    then = TrainConfig(model="mlp", batch_size=32, epochs=3)
    plan = decide_run(found("last.pt", state=saved(1, 0, 4, then)), flags, resume=True, overwrite=False)
    assert flags.window_items == 8 and plan.config is not None and plan.config.window_items == 32
    with pytest.raises(CLIError, match=r"--batch-size 32 \(now 8\).*on another number of ranks pass --batch-size 32"):
        decide_run(found("last.pt", state=saved(1, 0, 4, then)), replace(flags, batch_size=8), resume=True,
                   overwrite=False)
    with pytest.raises(CLIError, match=r"written with other settings: --lr 0\.02 \(now 0\.5\); resume with the same"):
        decide_run(found("last.pt", state=saved(1, 0, 4)), replace(CFG, lr=0.5), resume=True, overwrite=False)
