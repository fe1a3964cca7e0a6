"""One training run of the command line: global windows -> each rank's micro-batches -> one step each.

The global batch B (``--batch-size``, or M x N x W) is the invariant: every optimizer step sees B
items across all ranks, whatever the number of ranks. Data order depends on the seed alone
(:class:`~gradaccum.WindowSampler`): each epoch is a seeded permutation cut into global windows of
B, and each rank takes its share of every window, cut into micro-batches of at most M. The same seed
and B therefore train the same model on 1, 2 or 8 ranks, and a run continues on another world size
(or micro-batch size) from its checkpoint. Under torchrun the model is wrapped in DDP, or sharded
with FSDP2 (``--shard``, see :mod:`gradaccum.cli.sharding`).

The run's folder, checkpoints, signals and resuming belong to :mod:`gradaccum.cli.lifecycle`: this
loop asks it what to start from and tells it after each window where the run stands.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from .. import sync
from ..accumulator import Accumulator
from ..memory import PeakMeter, state_bytes
from ..sampler import WindowSampler
from ..tasks.data import Task, load_task
from ..tasks.models import build_model
from .checkpoint import CLIError
from .config import DEVICES, TrainConfig
from .lifecycle import Position, RunLifecycle
from .progress import Progress
from .sharding import load_sharded, save_sharded, setup_distributed, shard_model

__all__ = ["RunResult", "run_training", "resolve_device", "setup_distributed"]


@dataclass
class RunResult:
    """What a run leaves: its summary, one metrics row per step, the model, and its folder's life
    cycle (``raise_if_unsaved`` reports a final write that failed, after the caller has printed)."""

    summary: Dict[str, Any]
    history: List[Dict[str, Any]] = field(default_factory=list)
    model: Optional[nn.Module] = None
    unit: str = "items"
    already_complete: bool = False
    lifecycle: Optional[RunLifecycle] = None
    label: str = "train"        # the run in a legend: "accumulate 32 x 4 = 128"
    title: str = ""             # task, model and window, for plots
    window_unit: str = "items"  # what the global batch counts: images, sequences


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise CLIError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available; use --device cpu")
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device(name)


class _Memory:
    """Peak memory of the run. CUDA: the allocator's peak over the whole run. CPU: the allocator's
    events of one window (the third this process runs: optimizer state exists), measured by
    :class:`~gradaccum.memory.PeakMeter`, plus the parameters and optimizer state held before it.
    Measuring never stops a run: where the profiler's entry points differ (another torch), the
    summary says it was not measured, and why."""

    def __init__(self, device: torch.device, *, sharded: bool = False) -> None:
        self.device = device
        self.window_peak: Optional[int] = None
        self.held = 0
        self.failure: Optional[str] = None
        if sharded and device.type == "cpu":  # its frees of earlier windows' buffers are unattributable
            self.failure = ("FSDP2 frees buffers of earlier windows inside each window, which the CPU "
                            "profiler cannot attribute; run without --shard to measure")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def window(self, model: nn.Module, optimizer: torch.optim.Optimizer, measure: bool) -> Iterator[None]:
        meter = None
        if measure and self.device.type == "cpu" and self.window_peak is None and self.failure is None:
            held = state_bytes(model, optimizer)
            self.held = held["parameters"] + held["optimizer_state"]
            try:
                meter = PeakMeter("cpu")
                meter.__enter__()
            except Exception as e:  # noqa: BLE001 - the profiler's private API; the run goes on
                meter, self.failure = None, f"the profiler failed ({type(e).__name__}: {e})"
        try:
            yield
        finally:
            if meter is not None:
                try:
                    meter.__exit__(None, None, None)
                    self.window_peak = meter.result.peak_bytes
                except Exception as e:  # noqa: BLE001 - as above
                    self.failure = f"the profiler failed ({type(e).__name__}: {e})"

    def summary(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        static = sum(state_bytes(model, optimizer).values())
        if self.device.type == "cuda":
            return {"peak_memory_bytes": torch.cuda.max_memory_allocated(self.device),
                    "peak_memory_source": "CUDA allocator (max_memory_allocated)", "static_memory_bytes": static}
        if self.window_peak is None:
            why = self.failure or "no window ran"
            return {"peak_memory_bytes": None, "peak_memory_source": f"not measured: {why}",
                    "static_memory_bytes": static}
        return {"peak_memory_bytes": self.held + self.window_peak,
                "peak_memory_source": "measured: the CPU allocator's events of one window (PyTorch profiler), "
                                      "plus the parameters and optimizer state held before it",
                "static_memory_bytes": static}


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)  # type: ignore[arg-type]


def build(cfg: TrainConfig, task: Task, device: torch.device) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.task, **task.model_kwargs)  # type: ignore[arg-type]
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))


def window_words(cfg: TrainConfig, available: int, unit: str) -> str:
    """The window as trained, in words: ``32 x 4 = 128 images``, ``16 x 2 x 2 ranks = 64 images``, or
    the whole training set when the flags ask for more items than there are (``--micro-batch-size
    100000``: 1438, not 400000)."""
    b, m, n, w = cfg.window_items, cfg.micro_batch_size, cfg.micro_batches, cfg.world_size
    ranks = f" x {w} ranks" if w > 1 else ""
    if b <= available:
        if m == "auto":
            return f"{b} {unit} in auto-sized micro-batches" + (f" on {w} ranks" if w > 1 else "")
        if int(m) * int(n or 0) * w == b:
            return f"{m} x {n}{ranks} = {b} {unit}"
        return f"{b} {unit} in micro-batches of {m}" + (f" on {w} ranks" if w > 1 else "")
    whole = f"{available} {unit} (all)"
    if m == "auto":
        return f"{whole} in auto-sized micro-batches"
    return f"{whole} as one micro-batch" if int(m) * w >= available else f"{whole} in micro-batches of {m}"


def plot_title(cfg: TrainConfig, task: Task, available: int) -> str:
    """Task, model and window (line 1) and the rest of the recipe (line 2), for every plot of the run."""
    return (f"{cfg.task} / {cfg.model}: windows of {window_words(cfg, available, task.window_unit)}\n"
            f"{cfg.optimizer} lr {cfg.lr:g}, {cfg.precision}, {cfg.dtype}, seed {cfg.seed}")


def _wrap(cfg: TrainConfig, model: nn.Module, device: torch.device) -> nn.Module:
    """DDP under torchrun, FSDP2 with --shard, the model itself on one process."""
    if cfg.shard:
        return shard_model(model, device)
    if sync.is_distributed():
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def run_training(cfg: TrainConfig, out: Path, *, resume: bool = False, overwrite: bool = False,
                 command: str = "gradaccum train --resume", label: Optional[str] = None,
                 task: Optional[Task] = None) -> RunResult:
    """Train ``cfg`` into ``out`` (fresh, resumed or already complete: the life cycle decides)."""
    device = resolve_device(cfg.device)
    setup_distributed(device, shard=cfg.shard)
    if cfg.world_size != sync.world_size():  # the launch decides; B = M x N x W is checked again
        cfg = replace(cfg, world_size=sync.world_size())
    rank0 = sync.is_rank_zero()
    task = task or load_task(cfg.task, cfg.data_path)
    batch = cfg.window_items
    sampler = WindowSampler(task.num_train, batch, batch if cfg.micro_batch_size == "auto" else int(cfg.micro_batch_size),
                            seed=cfg.seed, rank=sync.rank(), world_size=sync.world_size())
    # a named run (--compare's baseline) says which it is in its progress lines
    prefix = f"gradaccum train ({label}):" if label else "gradaccum train:"
    label = label or f"accumulate {window_words(cfg, task.num_train, task.window_unit)}"
    windows_per_epoch = sampler.num_windows
    epochs = int(cfg.epochs)  # type: ignore[arg-type]
    total_steps = windows_per_epoch * epochs
    parts: Dict[str, Any] = {}  # the model and optimizer, for a sharded checkpoint's writer

    def write_sharded(meta: Dict[str, Any], path: Path) -> None:
        save_sharded(parts["model"], parts["optimizer"], meta, path)

    life = RunLifecycle(out, resume=resume, overwrite=overwrite, command=command,
                        checkpoint_every=cfg.checkpoint_every, sharded=cfg.shard,
                        write=write_sharded if cfg.shard else None, device=device)
    plan, state = life.plan(cfg, total_steps)  # refuses (one line) before anything is written

    model = build(cfg, task, device)
    wrapped = _wrap(cfg, model, device)
    optimizer = _optimizer(cfg, wrapped if cfg.shard else model)
    parts.update(model=wrapped, optimizer=optimizer)
    acc = Accumulator(wrapped, optimizer, precision=cfg.precision, max_grad_norm=cfg.max_grad_norm,
                      compute_grad_norm=True)
    if sync.is_distributed():  # a fresh process resumed where its share is empty still runs a forward
        acc.set_padding(task.gather([0]))
    elapsed = 0.0
    if state is not None:
        if cfg.shard:
            load_sharded(wrapped, optimizer, life.checkpoint)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        acc.load_state_dict(state["accumulator"])
        elapsed = float(state.get("elapsed", 0.0))
    life.prepare(plan)
    history = life.kept_history(plan.position) if plan.kind != "fresh" else []

    def checkpoint_state() -> Dict[str, Any]:
        held = {} if cfg.shard else {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        return {**held, "accumulator": acc.state_dict(), "config": cfg.to_dict(), "elapsed": elapsed,
                "total_steps": total_steps}

    memory = _Memory(device, sharded=cfg.shard)
    position = plan.position
    if plan.kind != "complete":
        progress = Progress(total_steps, position.epoch * windows_per_epoch + position.window, label=label,
                            unit=task.unit, prefix=prefix, enabled=rank0)
        with life.handling_signals(), life.metrics(history) as metrics_file:
            try:
                ran = 0
                # the third window this process runs (optimizer state exists, DDP has rebuilt its
                # buckets), or the last one when fewer run
                measure_at = min(2, total_steps - (position.epoch * windows_per_epoch + position.window) - 1)
                for epoch in range(position.epoch, epochs):
                    sampler.set_epoch(epoch)
                    sampler.start_window = position.window if epoch == position.epoch else 0
                    first = sampler.start_window
                    for offset, micro_batches in enumerate(sampler.windows()):
                        w = first + offset
                        t0 = time.perf_counter()
                        with memory.window(wrapped, optimizer, measure=ran == measure_at):
                            if cfg.micro_batch_size == "auto":
                                share = [i for mb in micro_batches for i in mb]
                                result = acc.step(task.gather(share), task.loss_fn, micro_batch_size="auto",
                                                  num_items=task.count)
                            else:
                                result = acc.step([task.gather(mb) for mb in micro_batches], task.loss_fn,
                                                  num_items=task.count)
                        dt = time.perf_counter() - t0
                        ran += 1
                        elapsed += dt
                        samples = min(batch, task.num_train - w * batch)  # the global window's items
                        row = {"step": result.step, "epoch": epoch, "window": w, "loss": result.loss,
                               "lr": result.lr, "num_items": result.num_items, "window_items": samples,
                               "grad_norm": result.grad_norm, "skipped": result.skipped,
                               "micro_batches": result.micro_batches, "accum_steps": result.accum_steps,
                               "micro_batch_size": result.micro_batch_size or cfg.micro_batch_size,
                               "world_size": sync.world_size(),
                               "samples_per_second": samples / dt if dt > 0 else None}
                        history.append(row)
                        if metrics_file is not None:
                            metrics_file.write(json.dumps(row) + "\n")
                            metrics_file.flush()
                        progress.update(epoch * windows_per_epoch + w + 1, result.loss, result.num_items, dt)
                        position = (Position(epoch, w + 1, result.step) if w + 1 < windows_per_epoch
                                    else Position(epoch + 1, 0, result.step))
                        life.after_window(position, checkpoint_state, last=position.epoch == epochs)
            finally:
                progress.close()
            life.finish(position, checkpoint_state)
    model.eval()
    title = plot_title(cfg, task, task.num_train)
    if plan.kind == "complete" and plan.has_summary:  # left as it was (rank 0's copy, on every rank)
        kept = sync.broadcast_object(json.loads((out / "summary.json").read_text()) if rank0 else None)
        return RunResult(kept, history, model, task.unit, already_complete=True, lifecycle=life,
                         label=label, title=title, window_unit=task.window_unit)
    summary: Dict[str, Any] = dict(task.evaluate(wrapped if cfg.shard else model, device))
    per_step = [float(r["num_items"]) for r in history]
    summary.update(steps=acc.steps, wall_time_seconds=elapsed, epochs=cfg.epochs,
                   global_batch_size=batch, window_items=min(batch, task.num_train), world_size=sync.world_size(),
                   micro_batch_size=acc.auto_micro_batch_size or cfg.micro_batch_size,
                   accum_steps=cfg.micro_batches, sharded=cfg.shard, device=str(device), config=cfg.to_dict(),
                   threads=torch.get_num_threads())
    summary[f"{task.unit}_per_step"] = sum(per_step) / len(per_step) if per_step else None
    if plan.kind == "complete":
        summary.update(peak_memory_bytes=None, peak_memory_source="not measured: this summary was written by a "
                       "later --resume of the finished run")
    else:
        summary.update(memory.summary(wrapped, optimizer))
    life.write_summary(summary)
    if rank0:
        from .report import plot_losses

        plot_losses({label: history}, out / "loss.png", title=title)
    return RunResult(summary, history, model, task.unit, already_complete=plan.kind == "complete", lifecycle=life,
                     label=label, title=title, window_unit=task.window_unit)
