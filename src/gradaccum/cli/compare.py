"""``gradaccum train --compare``: the same model trained with the whole window as one batch, compared."""

from __future__ import annotations

import signal
import sys
from dataclasses import replace
from typing import Any, Dict

from .. import sync
from .._maths import ceil_div
from .errors import CLIError
from .folder import RunFolder
from .parser import FLOAT64_AGREEMENT
from .report import plot_compare
from .run import RunResult, run_training
from .signals import EXIT_CODES, Stopped

__all__ = ["run_compare"]


def _as_trained(summary: Dict[str, Any]) -> Dict[str, Any]:
    """One run's side of ``compare.json``: its window as trained, per rank and across them, and
    what it cost. Both sides carry the same keys, read from their own ``summary.json``."""
    return {"global_batch_size": summary.get("global_batch_size"), "world_size": summary.get("world_size", 1),
            "micro_batch_size": summary.get("micro_batch_size"), "accum_steps": summary.get("accum_steps"),
            "peak_memory_bytes": summary.get("peak_memory_bytes"), "test_loss": summary.get("test_loss"),
            "test_accuracy": summary.get("test_accuracy"), "wall_time_seconds": summary.get("wall_time_seconds")}


def run_compare(cfg: Any, folder: RunFolder, accumulated: RunResult, task: Any, *, resume: bool, command: str) -> None:
    """Train the same model with the whole window as one batch from the same seed, in ``baseline/``
    (resumed with this run when it has a checkpoint, else started over); compare."""
    window = int(accumulated.summary["window_items"])  # as trained: at most the training set
    ranks = int(accumulated.summary.get("world_size", 1))
    with folder.baseline(resume=resume) as base_folder:
        # one micro-batch per rank: each rank's whole share of the global window at once
        base_cfg = replace(cfg, micro_batch_size=ceil_div(window, ranks), accum_steps=None, batch_size=window,
                           out=str(base_folder.out), checkpoint_every=0)
        baseline = run_training(base_cfg, base_folder, task, command=command, label=f"one batch of {window}")
    assert accumulated.model is not None and baseline.model is not None
    diff = max((a - b).abs().max().item() for a, b in
               zip(accumulated.model.state_dict().values(), baseline.model.state_dict().values()))
    a, b = accumulated.summary, baseline.summary
    report = {"max_abs_param_diff": diff, "accumulated": _as_trained(a), "one_batch": _as_trained(b),
              "peak_memory_source": a.get("peak_memory_source")}
    error = folder.write_json("compare.json", report)
    if error is not None:
        raise CLIError(f"compare.json could not be written to {folder.out} ({error}); free some space, then run the "
                       "same command with --resume")
    folder.draw("compare.png", lambda path: plot_compare(
        accumulated.history, baseline.history, (accumulated.label, baseline.label), path, title=accumulated.title,
        max_param_diff=diff, dtype=cfg.dtype, float64_agreement=FLOAT64_AGREEMENT, unit=accumulated.unit))
    if sync.is_rank_zero():
        mib = 2 ** 20
        memory = ""
        if a.get("peak_memory_bytes") is not None and b.get("peak_memory_bytes") is not None:
            memory = (f"; peak memory {a['peak_memory_bytes'] / mib:.2f} MiB accumulated vs "
                      f"{b['peak_memory_bytes'] / mib:.2f} MiB one batch ({a['peak_memory_source'].split(':')[0]})")
        if a.get("test_accuracy") is not None and b.get("test_accuracy") is not None:
            print(f"compare: test accuracy {a['test_accuracy']:.4f} accumulated, {b['test_accuracy']:.4f} one batch")
        print(f"compare: largest parameter difference {diff:.3e}{memory} -> {folder.out / 'compare.png'}")
        if cfg.dtype == "float32":
            print("compare: in float32 the two runs round differently and the difference compounds over "
                  f"training; --dtype float64 shows them equal to {FLOAT64_AGREEMENT}")
        sys.stdout.flush()
    assert baseline.lifecycle is not None
    baseline.lifecycle.raise_if_unsaved()
    if baseline.stopped_by is not None:  # a signal at the baseline's end: both runs and the comparison are whole
        name = signal.Signals(baseline.stopped_by)
        raise Stopped(f"{name.name}: received at the end of --compare's baseline, which it finished first: "
                      f"{folder.out} and its comparison are complete; nothing to resume", EXIT_CODES.get(name, 143))
