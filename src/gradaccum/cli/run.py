"""One training run of the command line: global windows -> each rank's micro-batches -> one step each.

The global batch B (``--batch-size``, or M x N x W) is the invariant: every optimizer step sees B
items across all ranks, whatever the number of ranks. Data order depends on the seed alone
(:class:`~gradaccum.WindowSampler`): each epoch is a seeded permutation cut into global windows of
B, and each rank takes its share of every window, cut into micro-batches of at most M. The same seed
and B therefore train the same model on 1, 2 or 8 ranks, and a run continues on another world size
(or micro-batch size) from its checkpoint. Under torchrun the model is wrapped in DDP, or sharded
with FSDP2 (``--shard``, see :mod:`gradaccum.cli.sharding`).

Training itself is the library's loop, ``Accumulator.train``, over the WindowSampler's micro-batches:
resuming at (epoch, window) is the sampler's position, loaded from the checkpoint. This module adds
what a run does after each window (:class:`WindowHooks`): a metrics row, progress, the test metrics
at each epoch's end, and the run folder's checkpoints and stop requests, which belong to
:mod:`gradaccum.cli.lifecycle`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .. import sync
from ..accumulator import Accumulator
from ..result import StepResult
from ..sampler import WindowSampler
from ..tasks.data import Task, load_task
from ..tasks.models import build_model
from .errors import CLIError
from .config import DEVICES, TrainConfig
from .lifecycle import Position, ResumePlan, RunLifecycle
from .measure import RunMemory
from .progress import Progress
from .tracking import MetricsLog
from .sharding import setup_distributed, shard_model

__all__ = ["RunResult", "run_training", "resolve_device", "setup_distributed"]


@dataclass
class RunResult:
    """What a run leaves: its summary, its metrics rows (one per window, one per epoch's test
    metrics), the model, and its folder's life cycle (``raise_if_unsaved`` reports a final write that failed, after the caller has printed)."""

    summary: Dict[str, Any]
    history: List[Dict[str, Any]] = field(default_factory=list)
    model: Optional[nn.Module] = None
    unit: str = "items"
    already_complete: bool = False
    lifecycle: Optional[RunLifecycle] = None
    label: str = "train"        # the run in a legend: "accumulate 32 x 4 = 128"
    title: str = ""             # task, model and window, for plots
    window_unit: str = "items"  # what the global batch counts: images, sequences
    config: Optional[TrainConfig] = None  # the settings trained (--resume may take B from the checkpoint)


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
    (b, m, n), w = cfg.window, cfg.world_size
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
            f"{cfg.optimizer} lr {cfg.lr:g}, {cfg.dtype} parameters, {_compute(cfg)} compute, seed {cfg.seed}")


def _compute(cfg: TrainConfig) -> str:
    """``--precision fp32`` is no autocast: the compute is in the parameters' dtype (float64 too)."""
    return str(cfg.dtype) if cfg.precision == "fp32" else f"{cfg.precision} autocast"


def _wrap(cfg: TrainConfig, model: nn.Module, device: torch.device) -> nn.Module:
    """DDP under torchrun, FSDP2 with --shard, the model itself on one process."""
    if cfg.shard:
        return shard_model(model, device)
    if sync.is_distributed():
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


class MicroBatches:
    """The WindowSampler's micro-batches as batches: the loader ``Accumulator.train`` cuts into windows
    (it reads where each window ends from ``batch_sampler`` and advances its position).

    It holds the micro-batches of the window before the current one until :meth:`window_done`: a
    window then frees nothing that was allocated before it began, so the CPU profiler that measures
    one window sees every block it frees (no "Memory block of unknown size" warning)."""

    def __init__(self, sampler: WindowSampler, task: Task) -> None:
        self.batch_sampler = sampler
        self.task = task
        self._current: List[Any] = []
        self._previous: List[Any] = []

    def __iter__(self) -> Iterator[Any]:
        for indices in self.batch_sampler:
            batch = self.task.gather(indices)
            self._current.append(batch)
            yield batch

    def window_done(self) -> None:
        """A window was stepped: its micro-batches are kept one window more, the ones before go."""
        self._previous, self._current = self._current, []


def _steps(acc: Accumulator, loader: MicroBatches, task: Task, epochs: int, auto: bool) -> Iterable[StepResult]:
    """``acc.train`` over the loader; with ``--micro-batch-size auto`` each window's share is one
    batch stepped with the out-of-memory back-off."""
    return acc.train(loader, task.loss_fn, epochs=epochs, num_items=task.count,
                     micro_batch_size="auto" if auto else None)


def _timed(steps: Iterable[StepResult], memory: RunMemory,
           loader: MicroBatches) -> Iterator[Tuple[StepResult, float]]:
    """Each window's result and the seconds it took (gathering its items included); the memory of
    the window ``memory`` asks for is measured around its computation alone."""
    it = iter(steps)
    for index in range(2**62):
        t0 = time.perf_counter()
        with memory.window(index):
            result = next(it, None)
        seconds = time.perf_counter() - t0
        loader.window_done()
        if result is None:
            return
        yield result, seconds


@dataclass
class Trainer:
    """What one run trains with, built and loaded before the first window."""

    cfg: TrainConfig
    task: Task
    device: torch.device
    model: nn.Module        # the plain model (its state_dict is the checkpoint's)
    wrapped: nn.Module      # DDP, FSDP2 or the model itself
    optimizer: torch.optim.Optimizer
    acc: Accumulator
    sampler: WindowSampler
    elapsed: float = 0.0
    memory: Optional[RunMemory] = None

    def evaluate(self) -> Dict[str, float]:
        """The task's test metrics, in eval mode (every rank: FSDP2 gathers parameters)."""
        net = self.wrapped if self.cfg.shard else self.model
        net.eval()
        try:
            return dict(self.task.evaluate(net, self.device))
        finally:
            net.train()

    def checkpoint_state(self) -> Dict[str, Any]:
        held = {} if self.cfg.shard else {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {**held, "accumulator": self.acc.state_dict(), "config": self.cfg.to_dict(), "elapsed": self.elapsed,
                "total_steps": self.sampler.num_windows * int(self.cfg.epochs)}  # type: ignore[arg-type]


def _trainer(cfg: TrainConfig, task: Task, device: torch.device, life: RunLifecycle, plan: ResumePlan,
             state: Optional[Dict[str, Any]]) -> Trainer:
    """Build the model, optimizer, Accumulator and sampler; load the checkpoint into them."""
    model = build(cfg, task, device)
    wrapped = _wrap(cfg, model, device)
    optimizer = _optimizer(cfg, wrapped if cfg.shard else model)
    acc = Accumulator(wrapped, optimizer, precision=cfg.precision, max_grad_norm=cfg.max_grad_norm,
                      compute_grad_norm=True, loss_every=cfg.loss_every)
    (batch, m, _) = cfg.window
    sampler = WindowSampler(task.num_train, batch, batch if m == "auto" else int(m), seed=cfg.seed,
                            rank=sync.rank(), world_size=sync.world_size())
    if sync.is_distributed():  # a fresh process resumed where its share is empty still runs a forward
        acc.set_padding(task.gather([0]))
    trainer = Trainer(cfg, task, device, model, wrapped, optimizer, acc, sampler)
    if state is not None:
        if cfg.shard:
            from .sharding import load_sharded

            load_sharded(wrapped, optimizer, life.checkpoint)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        acc.load_state_dict(state["accumulator"])
        trainer.elapsed = float(state.get("elapsed", 0.0))
    at = plan.position  # the checkpoint's (epoch, window): the one place a run resumes from
    sampler.load_state_dict({"epoch": at.epoch, "window": at.window})
    acc.epoch = at.epoch  # a checkpoint written before train() kept the epoch count holds 0
    return trainer


class WindowHooks:
    """What the run does after each window, in order: a metrics row, progress, the test metrics at
    an epoch's end (a row of their own), then the life cycle's periodic checkpoint or stop."""

    def __init__(self, trainer: Trainer, life: RunLifecycle, metrics: MetricsLog, progress: Progress) -> None:
        self.t, self.life, self.metrics, self.progress = trainer, life, metrics, progress
        self.per_epoch = trainer.sampler.num_windows
        self.last_eval: Optional[Dict[str, Any]] = None

    def __call__(self, result: StepResult, seconds: float) -> None:
        t, epoch, window = self.t, int(result.epoch or 0), int(result.window or 0)
        t.elapsed += seconds
        index = epoch * self.per_epoch + window
        items = min(t.sampler.global_batch_size, t.task.num_train - window * t.sampler.global_batch_size)
        self.metrics.write({
            "kind": "train", "window_index": index, "step": result.step, "epoch": epoch, "window": window,
            "skipped": result.skipped, "loss": result.loss, "lr": result.lr, "num_items": result.num_items,
            "window_items": items, "grad_norm": result.grad_norm, "micro_batches": result.micro_batches,
            "accum_steps": result.accum_steps, "micro_batch_size": result.micro_batch_size or t.cfg.window[1],
            "world_size": sync.world_size(), "samples_per_second": items / seconds if seconds > 0 else None})
        self.progress.update(index + 1, result.loss, result.num_items, seconds)
        ended = window + 1 == self.per_epoch
        if ended:
            self.last_eval = {"kind": "eval", "epoch": epoch, "window_index": index, "step": result.step,
                              **t.evaluate()}
            self.metrics.write(self.last_eval)
        at = Position(epoch + 1, 0, result.step) if ended else Position(epoch, window + 1, result.step)
        self.life.after_window(at, t.checkpoint_state, last=at.epoch == t.cfg.epochs, stop=result.stop_requested)
        if at.epoch == t.cfg.epochs:
            self.life.finish(at, t.checkpoint_state)


def _train(trainer: Trainer, life: RunLifecycle, plan: ResumePlan, history: List[Dict[str, Any]],
           prefix: str, label: str) -> Optional[Dict[str, Any]]:
    """The windows from the plan's position to the last epoch's end; returns the last epoch's test
    metrics row (None if this process ran no epoch's end)."""
    cfg, sampler, at = trainer.cfg, trainer.sampler, plan.position
    total = sampler.num_windows * int(cfg.epochs)  # type: ignore[arg-type]
    done = at.epoch * sampler.num_windows + at.window
    progress = Progress(total, done, label=label, unit=trainer.task.unit, prefix=prefix, enabled=sync.is_rank_zero())
    # the third window this process runs (optimizer state exists, DDP has rebuilt its buckets), or the last
    trainer.memory = memory = RunMemory(trainer.device, trainer.wrapped, trainer.optimizer,
                                        measure_at=min(2, total - done - 1), sharded=cfg.shard)
    loader = MicroBatches(sampler, trainer.task)
    steps = _steps(trainer.acc, loader, trainer.task, int(cfg.epochs) - trainer.acc.epoch,  # type: ignore[arg-type]
                   auto=cfg.window[1] == "auto")
    life.on_stop_signal(trainer.acc.request_stop, loss_every=int(cfg.loss_every))
    with life.handling_signals(), MetricsLog(life.out, history, enabled=sync.is_rank_zero()) as metrics:
        hooks = WindowHooks(trainer, life, metrics, progress)
        try:
            for result, seconds in _timed(steps, memory, loader):
                hooks(result, seconds)
        finally:
            progress.close()
    return hooks.last_eval


def run_training(cfg: TrainConfig, out: Path, *, resume: bool = False, overwrite: bool = False,
                 command: str = "gradaccum train --resume", label: Optional[str] = None,
                 task: Optional[Task] = None) -> RunResult:
    """Train ``cfg`` into ``out`` (fresh, resumed or already complete: the life cycle decides)."""
    device = resolve_device(cfg.device)
    setup_distributed(device, shard=cfg.shard)
    if cfg.world_size != sync.world_size():  # the launch decides; B = M x N x W is checked again
        cfg = replace(cfg, world_size=sync.world_size())
    task = task or load_task(cfg.task, cfg.data_path)
    life = RunLifecycle(out, resume=resume, overwrite=overwrite, command=command,
                        checkpoint_every=cfg.checkpoint_every, sharded=cfg.shard, write=None, device=device)
    plan, state = life.plan(cfg)  # refuses (one line) before anything is written
    cfg = plan.config or cfg
    trainer = _trainer(cfg, task, device, life, plan, state)
    if cfg.shard:
        from .sharding import save_sharded

        life.use_writer(lambda meta, path: save_sharded(trainer.wrapped, trainer.optimizer, meta, path))
    life.total_steps = trainer.sampler.num_windows * int(cfg.epochs)  # type: ignore[arg-type]
    life.prepare(plan)
    if cfg.window_items > task.num_train and plan.kind != "complete":
        life.say(f"warning: a window of {cfg.window_items} {task.window_unit} is more than the {task.num_train} of "
                 f"the training set: each step takes all {task.num_train} (summary.json records global_batch_size "
                 f"{task.num_train}); pass --batch-size {task.num_train} or less to say so")
    history = _kept_rows(life, plan, trainer.sampler.num_windows)
    prefix = f"gradaccum train ({label}):" if label else "gradaccum train:"  # --compare's baseline says so
    label = label or f"accumulate {window_words(cfg, task.num_train, task.window_unit)}"
    title = plot_title(cfg, task, task.num_train)
    last_eval = None
    if plan.kind != "complete":
        last_eval = _train(trainer, life, plan, history, prefix, label)
    trainer.model.eval()
    parts = dict(history=history, model=trainer.model, unit=task.unit, lifecycle=life, label=label, title=title,
                 window_unit=task.window_unit, config=cfg)
    if plan.kind == "complete" and plan.has_summary:  # left as it was (rank 0's copy, on every rank)
        kept = sync.broadcast_object(json.loads((out / "summary.json").read_text()) if sync.is_rank_zero() else None)
        if sync.is_rank_zero() and not (out / "loss.png").exists():  # a Ctrl-C after summary.json, before it
            _plot(out, history, label, title, task)
            life.say(f"drew {out / 'loss.png'}, which was missing, from metrics.jsonl")
        return RunResult(kept, already_complete=True, **parts)  # type: ignore[arg-type]
    summary = _summary(trainer, plan, history, last_eval)
    life.write_summary(summary)
    if sync.is_rank_zero():
        _plot(out, history, label, title, task)
    return RunResult(summary, already_complete=plan.kind == "complete", **parts)  # type: ignore[arg-type]


def _plot(out: Path, history: List[Dict[str, Any]], label: str, title: str, task: Task) -> None:
    """``loss.png`` from the run's rows (written whole or not at all)."""
    from .report import plot_losses

    plot_losses({label: history}, out / "loss.png", title=title, unit=task.unit)


def _kept_rows(life: RunLifecycle, plan: ResumePlan, per_epoch: int) -> List[Dict[str, Any]]:
    """The metrics rows before the plan's position; rows of an older version get their window index."""
    if plan.kind == "fresh":
        return []
    rows = life.kept_history(plan.position)
    for row in rows:
        row.setdefault("kind", "train")
        if row["kind"] == "train":
            row.setdefault("window_index", row["epoch"] * per_epoch + row["window"])
    return rows


def _trailing(rows: List[Dict[str, Any]], holds: Callable[[Dict[str, Any]], bool]) -> int:
    """How many of the last rows, counted back from the end, ``holds`` for."""
    count = 0
    for row in reversed(rows):
        if not holds(row):
            break
        count += 1
    return count


def _summary(trainer: Trainer, plan: ResumePlan, history: List[Dict[str, Any]],
             last_eval: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``summary.json``: the test metrics, the run's counts as trained, its memory."""
    cfg, task, acc = trainer.cfg, trainer.task, trainer.acc
    metrics = ({k: v for k, v in last_eval.items() if k.startswith("test_")} if last_eval is not None
               else trainer.evaluate())
    rows = [r for r in history if r.get("kind", "train") == "train"]
    per_step = [float(r["num_items"]) for r in rows]
    batch = cfg.window_items
    summary: Dict[str, Any] = dict(metrics)
    reported = [r for r in rows if r["loss"] is not None]  # under --loss-every K, every K-th window
    summary.update(steps=acc.steps, windows=len(rows), skipped_windows=sum(1 for r in rows if r.get("skipped")),
                   skipped_at_end=_trailing(rows, lambda r: bool(r.get("skipped"))),
                   last_loss=reported[-1]["loss"] if reported else None,
                   last_loss_step=reported[-1].get("step") if reported else None,
                   wall_time_seconds=trainer.elapsed,
                   epochs=cfg.epochs, global_batch_size=min(batch, task.num_train),
                   window_items=min(batch, task.num_train), world_size=sync.world_size(),
                   micro_batch_size=acc.auto_micro_batch_size or cfg.window[1],
                   accum_steps=cfg.accum_steps_per_rank, sharded=cfg.shard, device=str(trainer.device),
                   config=cfg.to_dict(), threads=torch.get_num_threads())
    if batch > task.num_train:
        summary["requested_global_batch_size"] = batch
    summary[f"{task.unit}_per_step"] = sum(per_step) / len(per_step) if per_step else None
    if plan.kind == "complete":
        summary.update(peak_memory_bytes=None, peak_memory_source="not measured: this summary was written by a "
                       "later --resume of the finished run")
    elif trainer.memory is not None:
        summary.update(trainer.memory.summary())
    return summary
