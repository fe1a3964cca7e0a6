"""``gradaccum train --compare``: the same model trained with the whole window as one batch, compared."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import sync
from .errors import CLIError
from .folder import BASELINE, CHECKPOINT
from .parser import FLOAT64_AGREEMENT
from .report import plot_compare
from .run import run_training

__all__ = ["run_compare", "COMPARE_FILES"]

#: what --compare adds to the run folder
COMPARE_FILES = ("compare.json", "compare.png", BASELINE)


def run_compare(cfg: Any, out: Path, accumulated: Any, *, resume: bool, command: str) -> None:
    """Train the same model with the whole window as one batch from the same seed; compare."""
    window = int(accumulated.summary["window_items"])  # as trained: at most the training set
    ranks = int(accumulated.summary.get("world_size", 1))
    # one micro-batch per rank: each rank's whole share of the global window at once
    base_cfg = replace(cfg, micro_batch_size=-(-window // ranks), accum_steps=None, batch_size=window,
                       out=str(out / BASELINE), checkpoint_every=0)
    # the baseline is this run's own sub-run: resumed with it, else started over
    base_resume = resume and sync.broadcast_object((out / BASELINE / CHECKPOINT).exists() if sync.is_rank_zero()
                                                   else None)
    baseline = run_training(base_cfg, out / BASELINE, resume=base_resume, overwrite=not base_resume,
                            command=command, label=f"one batch of {window}")
    assert accumulated.model is not None and baseline.model is not None
    diff = max((a - b).abs().max().item() for a, b in
               zip(accumulated.model.state_dict().values(), baseline.model.state_dict().values()))
    a, b = accumulated.summary, baseline.summary
    report = {"max_abs_param_diff": diff,
              "accumulated": {"micro_batch_size": a.get("micro_batch_size", cfg.micro_batch_size),  # as trained
                              "accum_steps": a.get("accum_steps", cfg.accum_steps_per_rank),
                              "peak_memory_bytes": a.get("peak_memory_bytes"), "test_loss": a["test_loss"],
                              "test_accuracy": a.get("test_accuracy"), "wall_time_seconds": a["wall_time_seconds"]},
              "one_batch": {"micro_batch_size": window, "accum_steps": 1,
                            "peak_memory_bytes": b.get("peak_memory_bytes"), "test_loss": b["test_loss"],
                            "test_accuracy": b.get("test_accuracy"), "wall_time_seconds": b["wall_time_seconds"]},
              "peak_memory_source": a.get("peak_memory_source")}
    if sync.is_rank_zero():
        error = accumulated.lifecycle.folder.write_json("compare.json", report)
        if error is not None:
            raise CLIError(f"compare.json could not be written to {out} ({error}); free some space, then run the "
                           "same command with --resume")
        plot_compare(accumulated.history, baseline.history, (accumulated.label, baseline.label),
                     out / "compare.png", title=accumulated.title, max_param_diff=diff, dtype=cfg.dtype,
                     float64_agreement=FLOAT64_AGREEMENT)
        mib = 2 ** 20
        memory = ""
        if a.get("peak_memory_bytes") is not None and b.get("peak_memory_bytes") is not None:
            memory = (f"; peak memory {a['peak_memory_bytes'] / mib:.2f} MiB accumulated vs "
                      f"{b['peak_memory_bytes'] / mib:.2f} MiB one batch ({a['peak_memory_source'].split(':')[0]})")
        print(f"compare: largest parameter difference {diff:.3e}{memory} -> {out / 'compare.png'}")
        if cfg.dtype == "float32":
            print("compare: in float32 the two runs round differently and the difference compounds over "
                  f"training; --dtype float64 shows them equal to {FLOAT64_AGREEMENT}")
    assert baseline.lifecycle is not None
    baseline.lifecycle.raise_if_unsaved()
