"""One training run of the command line: data -> windows -> Accumulator.step -> metrics.

Data order depends on the seed alone: each epoch is a seeded permutation of the training set
(``DistributedSampler``, also with one process), cut into windows of ``window_items`` items, each
window into micro-batches. The same seed and effective batch therefore give the same model however
the window is split. Under torchrun every rank takes its share of each epoch.

The run's folder, checkpoints, signals and resuming belong to :mod:`gradaccum.cli.lifecycle`: this
loop asks it what to start from and tells it after each window where the run stands.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from .. import sync
from ..accumulator import Accumulator
from ..tasks.data import Task, load_task
from ..tasks.models import build_model
from .checkpoint import CLIError
from .config import DEVICES, TrainConfig
from .lifecycle import Position, RunLifecycle
from .progress import Progress

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


def setup_distributed(device: torch.device) -> None:
    """Join the torchrun process group when launched with more than one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not sync.is_distributed():
        import torch.distributed as dist  # the CLI's one use outside the seam: joining the group

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


class MemoryMeter:
    """Peak memory of a run. CUDA: the allocator's peak. CPU: an estimate that counts what
    accumulation changes: parameters, gradients, optimizer state, plus the largest set of
    activations saved for backward by one micro-batch (via saved-tensors hooks)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_activations = 0
        self._live = 0
        self._seen: set = set()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in self._seen and not isinstance(t, nn.Parameter):
            self._seen.add(key)
            self._live += key[1]
            self.peak_activations = max(self.peak_activations, self._live)
        return t

    def wrap(self, loss_fn: Any) -> Any:
        if self.device.type == "cuda":
            return loss_fn

        def measured(model: nn.Module, batch: Any) -> Any:
            self._live, self._seen = 0, set()
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                return loss_fn(model, batch)
        return measured

    def peak(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        if self.device.type == "cuda":
            return {"peak_memory_bytes": torch.cuda.max_memory_allocated(self.device),
                    "peak_memory_source": "CUDA allocator (max_memory_allocated)"}
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                    for t in s.values() if isinstance(t, torch.Tensor))
        return {"peak_memory_bytes": 2 * params + state + self.peak_activations,
                "peak_activation_bytes": self.peak_activations,
                "peak_memory_source": "estimate: parameters + gradients + optimizer state + "
                                      "activations saved for backward by one micro-batch"}


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)  # type: ignore[arg-type]


def build(cfg: TrainConfig, task: Task, device: torch.device) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.task, **task.model_kwargs)  # type: ignore[arg-type]
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))


def window_words(cfg: TrainConfig, available: int, unit: str) -> str:
    """The window as trained, in words: ``32 x 4 = 128 images``, or the whole training set when the
    flags ask for more items than this rank has (``--micro-batch-size 100000``: 1438, not 400000)."""
    if cfg.window_items <= available:
        b, m, n = cfg.window_items, cfg.micro_batch_size, cfg.micro_batches
        if m == "auto":
            return f"{b} {unit} in auto-sized micro-batches"
        if int(m) * int(n or 0) == b:
            return f"{m} x {n} = {b} {unit}"
        return f"{b} {unit} in micro-batches of {m}"
    whole = f"{available} {unit} (all)"
    if cfg.micro_batch_size == "auto":
        return f"{whole} in auto-sized micro-batches"
    m = int(cfg.micro_batch_size)
    return f"{whole} as one micro-batch" if m >= available else f"{whole} in micro-batches of {m}"


def plot_title(cfg: TrainConfig, task: Task, available: int) -> str:
    """Task, model and window (line 1) and the rest of the recipe (line 2), for every plot of the run."""
    return (f"{cfg.task} / {cfg.model}: windows of {window_words(cfg, available, task.window_unit)}\n"
            f"{cfg.optimizer} lr {cfg.lr:g}, {cfg.precision}, {cfg.dtype}, seed {cfg.seed}")


def run_training(cfg: TrainConfig, out: Path, *, resume: bool = False, overwrite: bool = False,
                 command: str = "gradaccum train --resume", label: Optional[str] = None,
                 task: Optional[Task] = None) -> RunResult:
    """Train ``cfg`` into ``out`` (fresh, resumed or already complete: the life cycle decides)."""
    device = resolve_device(cfg.device)
    setup_distributed(device)
    rank0 = sync.is_rank_zero()
    life = RunLifecycle(out, resume=resume, overwrite=overwrite, command=command,
                        checkpoint_every=cfg.checkpoint_every)
    task = task or load_task(cfg.task, cfg.data_path)
    sampler = DistributedSampler(range(task.num_train), num_replicas=sync.world_size(), rank=sync.rank(),
                                 shuffle=True, seed=cfg.seed, drop_last=False)
    per_window = cfg.window_items
    label = label or f"accumulate {window_words(cfg, len(sampler), task.window_unit)}"
    windows_per_epoch = math.ceil(len(sampler) / per_window)
    epochs = int(cfg.epochs)  # type: ignore[arg-type]
    total_steps = windows_per_epoch * epochs
    plan, state = life.plan(cfg, total_steps)  # refuses (one line) before anything is written

    model = build(cfg, task, device)
    wrapped: nn.Module = model
    if sync.is_distributed():
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = _optimizer(cfg, model)
    acc = Accumulator(wrapped, optimizer, precision=cfg.precision, max_grad_norm=cfg.max_grad_norm)
    elapsed = 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        acc.load_state_dict(state["accumulator"])
        elapsed = float(state.get("elapsed", 0.0))
    life.prepare(plan)
    history = life.kept_history(plan.position.step) if plan.kind != "fresh" else []

    def checkpoint_state() -> Dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "accumulator": acc.state_dict(),
                "config": cfg.to_dict(), "elapsed": elapsed, "total_steps": total_steps}

    meter = MemoryMeter(device)
    loss_fn = meter.wrap(task.loss_fn)
    position = plan.position
    if plan.kind != "complete":
        progress = Progress(total_steps, position.epoch * windows_per_epoch + position.window, label=label,
                            unit=task.unit, enabled=rank0)
        with life.handling_signals(), life.metrics(history) as metrics_file:
            try:
                for epoch in range(position.epoch, epochs):
                    sampler.set_epoch(epoch)
                    order = list(sampler)
                    first = position.window if epoch == position.epoch else 0
                    for w in range(first, windows_per_epoch):
                        idx = order[w * per_window:(w + 1) * per_window]
                        t0 = time.perf_counter()
                        if cfg.micro_batch_size == "auto":
                            result = acc.step(task.gather(idx), loss_fn, micro_batch_size="auto")
                        else:
                            m = int(cfg.micro_batch_size)
                            result = acc.step([task.gather(idx[i:i + m]) for i in range(0, len(idx), m)], loss_fn)
                        dt = time.perf_counter() - t0
                        elapsed += dt
                        row = {"step": result.step, "epoch": epoch, "window": w, "loss": result.loss,
                               "lr": result.lr, "num_items": result.num_items, "grad_norm": result.grad_norm,
                               "skipped": result.skipped, "micro_batches": result.micro_batches,
                               "accum_steps": result.accum_steps,
                               "micro_batch_size": result.micro_batch_size or cfg.micro_batch_size,
                               "samples_per_second": len(idx) * sync.world_size() / dt if dt > 0 else None}
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
    if plan.kind == "complete" and plan.has_summary:  # left as it was
        summary = json.loads((out / "summary.json").read_text())
        return RunResult(summary, history, model, task.unit, already_complete=True, lifecycle=life,
                         label=label, title=plot_title(cfg, task, len(sampler)))
    summary: Dict[str, Any] = dict(task.evaluate(model, device))
    summary.update(steps=acc.steps, wall_time_seconds=elapsed, epochs=cfg.epochs,
                   window_items=min(per_window, len(sampler)),
                   world_size=sync.world_size(), device=str(device), config=cfg.to_dict(),
                   micro_batch_size=acc.auto_micro_batch_size or cfg.micro_batch_size)
    if plan.kind == "complete":
        summary.update(peak_memory_bytes=None, peak_memory_source="not measured: this summary was written by a "
                       "later --resume of the finished run")
    else:
        summary.update(meter.peak(model, optimizer))
    life.write_summary(summary)
    if rank0:
        from .report import plot_losses

        plot_losses({label: history}, out / "loss.png", title=plot_title(cfg, task, len(sampler)))
    return RunResult(summary, history, model, task.unit, already_complete=plan.kind == "complete", lifecycle=life,
                     label=label, title=plot_title(cfg, task, len(sampler)))
