"""One training run of the command line: data -> windows -> Accumulator.step -> metrics, checkpoints.

Data order depends on the seed alone: each epoch is a seeded permutation of the training set
(``DistributedSampler``, also with one process), cut into windows of ``window_items`` items, each
window into micro-batches. The same seed and effective batch therefore give the same model however
the window is split. Under torchrun every rank takes its share of each epoch, and only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from .. import sync
from ..accumulator import Accumulator
from ..tasks.data import Task, load_task
from ..tasks.models import build_model
from .checkpoint import CLIError, load_checkpoint, save_atomic
from .config import TrainConfig

__all__ = ["RunResult", "run_training", "resolve_device", "setup_distributed"]


@dataclass
class RunResult:
    summary: Dict[str, Any]
    history: List[Dict[str, Any]] = field(default_factory=list)
    model: Optional[nn.Module] = None


def resolve_device(name: str) -> torch.device:
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


def _progress(total: int, initial: int, label: str) -> Any:
    quiet = not sys.stderr.isatty() or not sync.is_rank_zero()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        quiet = True
    if quiet:
        return None
    return tqdm(total=total, initial=initial, desc=label, unit="step", leave=False)


def run_training(cfg: TrainConfig, out: Path, *, resume: bool = False, label: str = "train",
                 task: Optional[Task] = None) -> RunResult:
    device = resolve_device(cfg.device)
    setup_distributed(device)
    rank0 = sync.is_rank_zero()
    task = task or load_task(cfg.task, cfg.data_path)
    model = build(cfg, task, device)
    wrapped: nn.Module = model
    if sync.is_distributed():
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = _optimizer(cfg, model)
    acc = Accumulator(wrapped, optimizer, precision=cfg.precision, max_grad_norm=cfg.max_grad_norm)
    sampler = DistributedSampler(range(task.num_train), num_replicas=sync.world_size(), rank=sync.rank(),
                                 shuffle=True, seed=cfg.seed, drop_last=False)
    per_window = cfg.window_items
    windows_per_epoch = math.ceil(len(sampler) / per_window)
    total_steps = windows_per_epoch * cfg.epochs  # type: ignore[operator]
    ckpt_path, metrics_path = out / "last.pt", out / "metrics.jsonl"
    history: List[Dict[str, Any]] = []
    start_epoch, start_window, elapsed = 0, 0, 0.0

    if resume and ckpt_path.exists():
        state = load_checkpoint(ckpt_path)
        saved = TrainConfig(**state["config"])
        # data order depends on the seed and the epoch only, so a run may be extended with more epochs
        if replace(saved, out=cfg.out, checkpoint_every=cfg.checkpoint_every, epochs=cfg.epochs) != cfg:
            changed = [k for k, v in saved.to_dict().items()
                       if k not in ("out", "checkpoint_every", "epochs") and getattr(cfg, k) != v]
            raise CLIError(f"--resume: {ckpt_path} was written with other settings ({', '.join(changed)}); "
                           "resume with the same flags (only --epochs may grow), or pass another --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        acc.load_state_dict(state["accumulator"])
        start_epoch, start_window, elapsed = state["epoch"], state["window"], state.get("elapsed", 0.0)
        if metrics_path.exists():  # keep the lines of the steps the checkpoint holds
            lines = metrics_path.read_text().splitlines()
            history = [json.loads(x) for x in lines if x.strip()]
            history = [h for h in history if h["step"] <= acc.steps]
    elif rank0 and out.exists():
        for stale in (metrics_path, out / "summary.json"):
            if stale.exists():
                stale.unlink()
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)

    meter = MemoryMeter(device)
    loss_fn = meter.wrap(task.loss_fn)

    def checkpoint(epoch: int, window: int) -> None:
        if rank0:
            save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "accumulator": acc.state_dict(), "config": cfg.to_dict(), "epoch": epoch,
                         "window": window, "elapsed": elapsed, "total_steps": total_steps}, ckpt_path)
        sync.barrier()

    bar = _progress(total_steps, start_epoch * windows_per_epoch + start_window, label)
    metrics_file = open(metrics_path, "a") if rank0 else None
    try:
        for epoch in range(start_epoch, cfg.epochs):  # type: ignore[arg-type]
            sampler.set_epoch(epoch)
            order = list(sampler)
            first = start_window if epoch == start_epoch else 0
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
                row = {"step": result.step, "epoch": epoch, "window": w, "loss": result.loss, "lr": result.lr,
                       "num_items": result.num_items, "grad_norm": result.grad_norm, "skipped": result.skipped,
                       "micro_batches": result.micro_batches, "accum_steps": result.accum_steps,
                       "micro_batch_size": result.micro_batch_size or cfg.micro_batch_size,
                       "samples_per_second": len(idx) * sync.world_size() / dt if dt > 0 else None}
                history.append(row)
                if metrics_file is not None:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.loss:.4f}")
                last_window = epoch == cfg.epochs - 1 and w == windows_per_epoch - 1  # type: ignore[operator]
                if cfg.checkpoint_every and result.step % cfg.checkpoint_every == 0 and not last_window:
                    checkpoint(epoch if w + 1 < windows_per_epoch else epoch + 1,
                               (w + 1) % windows_per_epoch)
    finally:
        if metrics_file is not None:
            metrics_file.close()
        if bar is not None:
            bar.close()
    checkpoint(cfg.epochs, 0)  # type: ignore[arg-type]
    model.eval()
    summary: Dict[str, Any] = dict(task.evaluate(model, device))
    summary.update(steps=acc.steps, wall_time_seconds=elapsed, epochs=cfg.epochs, window_items=per_window,
                   world_size=sync.world_size(), device=str(device), config=cfg.to_dict(),
                   micro_batch_size=acc.auto_micro_batch_size or cfg.micro_batch_size)
    summary.update(meter.peak(model, optimizer))
    if rank0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        from .report import plot_losses

        plot_losses({label: history}, out / "loss.png")
    return RunResult(summary, history, model)
