"""Where a run's metrics rows go: ``metrics.jsonl``, ``metrics.csv`` and TensorBoard event files.

One row per window (``"kind": "train"``) and one per finished epoch (``"kind": "eval"``, the test
metrics). A training row's ``step`` counts optimizer steps and so repeats on a skipped window
(``"skipped": true``); ``window_index`` counts windows across epochs and never repeats.

All three are written by rank 0 and rewritten whole from the kept rows when a run resumes (a killed
run may have written rows past its checkpoint). TensorBoard's files are written when the
``tensorboard`` package is installed (``pip install 'gradaccum[cli]'``); ``tensorboard --logdir runs``
then shows every run, ``--compare``'s baseline as a run of its own.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO

from .atomic import write_text_atomic
from .jsonfile import finite_or_none, strict_json

__all__ = ["CSV_COLUMNS", "EVENTS_PREFIX", "MetricsLog"]

#: TensorBoard's event files (one per writer: a resumed run rewrites its history into a new one)
EVENTS_PREFIX = "events.out.tfevents."

CSV_COLUMNS = ("kind", "window_index", "epoch", "window", "step", "skipped", "loss", "lr", "grad_norm", "num_items",
               "window_items", "samples_per_second", "micro_batches", "accum_steps", "micro_batch_size",
               "world_size", "test_loss", "test_accuracy", "test_bits_per_byte")
#: TensorBoard tags of a training row's values
_TRAIN_SCALARS = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
                  "samples_per_second": "train/items_per_second"}


def _events_writer(out: Path) -> Any:
    """A SummaryWriter into ``out``, or None without the tensorboard package (an optional extra)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    for old in out.glob(f"{EVENTS_PREFIX}*"):  # rewritten below from the rows kept
        old.unlink()
    return SummaryWriter(log_dir=str(out), flush_secs=10)


class MetricsLog:
    """The run's metrics files, opened with the rows kept from before (rank 0 writes; others no-op).
    Opened by :meth:`RunFolder.metrics_log <gradaccum.cli.folder.RunFolder.metrics_log>`, the owner
    of the folder. Use as a context manager; :meth:`write` adds one row to all three."""

    def __init__(self, out: Path, history: List[Dict[str, Any]], *, enabled: bool) -> None:
        self.out = out
        self.history = history
        self.enabled = enabled
        self._jsonl: Optional[TextIO] = None
        self._csv_file: Optional[TextIO] = None
        self._csv: Any = None
        self._events: Any = None

    def __enter__(self) -> "MetricsLog":
        if not self.enabled:
            return self
        path = self.out / "metrics.jsonl"  # replaced whole: a kill while rewriting cannot lose the kept lines
        write_text_atomic(path, "".join(strict_json(row) + "\n" for row in self.history))
        self._jsonl = open(path, "a")
        self._csv_file = open(self.out / "metrics.csv", "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, CSV_COLUMNS, extrasaction="ignore")
        self._csv.writeheader()
        self._events = _events_writer(self.out)
        for row in self.history:
            self._tabulate(row)
        return self

    def write(self, row: Dict[str, Any]) -> None:
        """Append ``row`` to the history, and to the files (flushed: a kill loses no finished row)."""
        self.history.append(row)
        if self._jsonl is None:
            return
        self._jsonl.write(strict_json(row) + "\n")
        self._jsonl.flush()
        self._tabulate(row)
        assert self._csv_file is not None
        self._csv_file.flush()

    def _tabulate(self, row: Dict[str, Any]) -> None:
        self._csv.writerow(finite_or_none(row))
        if self._events is None:
            return
        step = int(row.get("step") or 0)
        if row.get("kind") == "eval":
            for key, value in row.items():
                if key.startswith("test_") and _finite(value):
                    self._events.add_scalar(f"test/{key[5:]}", value, step)
            return
        if row.get("skipped"):
            return  # no step was taken: its step number belongs to the window before
        for key, tag in _TRAIN_SCALARS.items():
            if _finite(row.get(key)):
                self._events.add_scalar(tag, row[key], step)

    def __exit__(self, *exc: Any) -> None:
        for f in (self._jsonl, self._csv_file):
            if f is not None:
                f.close()
        if self._events is not None:
            self._events.close()


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
