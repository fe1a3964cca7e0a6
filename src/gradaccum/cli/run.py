"""One training run of the command line: global windows -> each rank's micro-batches -> one step each.

The global batch B (``--batch-size``, or M x N x W) is the invariant: every optimizer step sees B
items across all ranks, whatever the number of ranks. Data order depends on the seed alone
(:class:`~gradaccum.WindowSampler`): each epoch is a seeded permutation cut into global windows of
B, and each rank takes its share of every window, cut into micro-batches of at most M. The same seed
and B therefore train the same model on 1, 2 or 8 ranks, and a run continues on another world size
(or micro-batch size) from its checkpoint. Under torchrun the model is wrapped in DDP, or sharded
with FSDP2 (``--shard``, see :mod:`gradaccum.cli.sharding`).

:func:`run_training` reads in the order a run goes: build the model, optimizer, Accumulator and
sampler (:func:`build_parts`), decide fresh / resume / complete, then :func:`run_loop`, the one
loop. Each turn of it trains one window (the library's ``Accumulator.train`` over the
WindowSampler's micro-batches; resuming at (epoch, window) is the sampler's position, loaded from
the checkpoint), records it (a metrics row, progress), evaluates at an epoch's end, stops when a
signal asked and writes the periodic checkpoint when it is due. After the loop: the final
checkpoint, ``summary.json`` and ``loss.png``. When the folder is written and what a signal does is
:mod:`gradaccum.cli.lifecycle`'s; every file goes through :class:`~gradaccum.cli.folder.RunFolder`.
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .. import sync
from .._maths import ceil_div
from ..accumulator import Accumulator
from ..result import StepResult
from ..sampler import WindowSampler
from ..tasks.data import Task
from ..tasks.models import build_model
from .config import DEVICES, TrainConfig
from .errors import CLIError
from .folder import Position, ResumePlan, RunFolder
from .launch import launch
from .lifecycle import RunLifecycle
from .measure import RunMemory
from .progress import Progress
from .sharding import shard_model

__all__ = ["RunParts", "RunResult", "build", "build_parts", "plot_title", "resolve_device", "run_training",
           "run_loop", "window_words"]


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
    stopped_by: Optional[int] = None      # a signal that came at the run's end (it finished first)


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise CLIError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available; use --device cpu")
    local_rank = launch().local_rank
    if name == "cuda" and local_rank is not None:
        return torch.device("cuda", local_rank)
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


def window_flags(cfg: TrainConfig) -> str:
    """The flags that make the window, in the user's terms (a default said to be one): ``--micro-batch-size
    5000 x --accum-steps 4 (the default) = 20000``, ``--batch-size 20000``."""
    (b, m, n), w = cfg.window, cfg.world_size
    if cfg.batch_size is not None:
        return f"--batch-size {b}"
    if m == "auto":
        return f"--batch-size {b} (the default with --micro-batch-size auto)"
    flags = [f"{flag} {value}" + ("" if given is not None else " (the default)") for flag, value, given
             in (("--micro-batch-size", m, cfg.micro_batch_size), ("--accum-steps", n, cfg.accum_steps))]
    return " x ".join(flags) + (f" x {w} ranks" if w > 1 else "") + f" = {b}"


def plot_title(cfg: TrainConfig, task: Task, history: List[Dict[str, Any]]) -> str:
    """Task, model and window (line 1) and the rest of the recipe (line 2), for every plot of the run.
    A run resumed with another micro-batch size or number of ranks says where each held."""
    shapes = _shapes(history)
    if len(shapes) > 1:
        items = min(cfg.window_items, task.num_train)
        window = f"{items} {task.window_unit}: " + ", then ".join(
            f"micro-batches of {m}{f' on {w} ranks' if w > 1 else ''} ({_steps_text(first, last)})"
            for (m, w), first, last in shapes)
    else:
        window = window_words(cfg, task.num_train, task.window_unit)
    return (f"{cfg.task} / {cfg.model}: windows of {window}\n"
            f"{cfg.optimizer} lr {cfg.lr:g}, {cfg.dtype} parameters, {_compute(cfg)} compute, seed {cfg.seed}")


def _shapes(history: List[Dict[str, Any]]) -> List[Tuple[Tuple[Any, int], int, int]]:
    """The run's split as trained, one entry per stretch of windows that kept it:
    ``((micro_batch_size, world_size), first step, last step)``."""
    stretches: List[Tuple[Tuple[Any, int], int, int]] = []
    for row in history:
        if row.get("kind", "train") != "train" or "micro_batch_size" not in row:
            continue
        shape, step = (row["micro_batch_size"], int(row.get("world_size", 1))), int(row["step"])
        if stretches and stretches[-1][0] == shape:
            stretches[-1] = (shape, stretches[-1][1], step)
        else:
            stretches.append((shape, step, step))
    return stretches


def _steps_text(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


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


@dataclass
class RunParts:
    """The objects one run trains with, built and loaded from its checkpoint before its first window
    (:func:`build_parts`), and the training time they have had so far."""

    cfg: TrainConfig
    task: Task
    device: torch.device
    model: nn.Module        # the plain model (its state_dict is the checkpoint's)
    wrapped: nn.Module      # DDP, FSDP2 or the model itself
    optimizer: torch.optim.Optimizer
    acc: Accumulator
    sampler: WindowSampler
    elapsed: float = 0.0    # seconds of training, over this run and the runs it resumed

    @property
    def micro_batch_size(self) -> Any:
        """M as it runs: the flag's, but at most a full window's share of one rank (``--micro-batch-size
        5000`` on 1438 items runs micro-batches of 1438); ``"auto"`` before auto-sizing has picked one."""
        m = self.acc.auto_micro_batch_size or self.cfg.window[1]
        if m == "auto":
            return m
        share = ceil_div(min(self.cfg.window_items, self.task.num_train), sync.world_size())
        return min(int(m), share)

    @property
    def total_windows(self) -> int:
        """Windows of the whole run: per epoch, times the epochs."""
        return self.sampler.num_windows * int(self.cfg.epochs)  # type: ignore[arg-type]

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
                "total_steps": self.total_windows}


def build_parts(cfg: TrainConfig, task: Task, device: torch.device, folder: RunFolder, plan: ResumePlan,
                state: Optional[Dict[str, Any]]) -> RunParts:
    """Build the model, optimizer, Accumulator and sampler; load the checkpoint into them."""
    model = build(cfg, task, device)
    wrapped = _wrap(cfg, model, device)
    optimizer = _optimizer(cfg, wrapped if cfg.shard else model)
    acc = Accumulator(wrapped, optimizer, precision=cfg.precision, max_grad_norm=cfg.max_grad_norm,
                      compute_grad_norm=True)
    (batch, m, _) = cfg.window
    sampler = WindowSampler(task.num_train, batch, batch if m == "auto" else int(m), seed=cfg.seed,
                            rank=sync.rank(), world_size=sync.world_size())
    if sync.is_distributed():  # a fresh process resumed where its share is empty still runs a forward
        acc.set_padding(task.gather([0]))
    parts = RunParts(cfg, task, device, model, wrapped, optimizer, acc, sampler)
    if state is not None:
        if cfg.shard:
            from .sharding import load_sharded

            load_sharded(wrapped, optimizer, folder.checkpoint)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        acc.load_state_dict(state["accumulator"])
        parts.elapsed = float(state.get("elapsed", 0.0))
    at = plan.position  # the checkpoint's (epoch, window): the one place a run resumes from
    sampler.load_state_dict({"epoch": at.epoch, "window": at.window})
    acc.epoch = at.epoch  # a checkpoint written before train() kept the epoch count holds 0
    if cfg.shard:
        from .sharding import save_sharded

        folder.use_writer(lambda meta, path: save_sharded(wrapped, optimizer, meta, path))
    return parts


#: the library's warning for a skipped window; the command line says it in its own words instead
_SKIP_WARNING = r"a window's .* not finite|a window counted 0 items"


def run_loop(parts: RunParts, life: RunLifecycle, start: Position, history: List[Dict[str, Any]],
                  progress: Progress) -> Tuple[Position, Optional[Dict[str, Any]], RunMemory]:
    """The run's loop, from ``start`` to the last epoch's end. Each turn: train one window, record it
    (a metrics row, progress), evaluate at an epoch's end (a row of its own), stop if a signal asked
    (a checkpoint, then :class:`~gradaccum.cli.signals.Stopped`), write the periodic checkpoint when
    it is due. Returns where training ended, the last test metrics row (None if this process ran
    no epoch's end) and the memory measured."""
    cfg, acc, task, sampler = parts.cfg, parts.acc, parts.task, parts.sampler
    per_epoch = sampler.num_windows
    # the third window this process runs (optimizer state exists, DDP has rebuilt its buckets), or the last
    done = start.epoch * per_epoch + start.window
    memory = RunMemory(parts.device, parts.wrapped, parts.optimizer, measure_at=min(2, parts.total_windows - done - 1),
                       sharded=cfg.shard)
    loader = MicroBatches(sampler, task)
    windows = iter(acc.train(loader, task.loss_fn, epochs=int(cfg.epochs) - acc.epoch,  # type: ignore[arg-type]
                             num_items=task.count, micro_batch_size="auto" if cfg.window[1] == "auto" else None))
    life.on_stop_signal(acc.request_stop)
    at, last_eval, skipped_before = start, None, False
    with life.folder.metrics_log(history) as metrics, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SKIP_WARNING)
        for index in itertools.count():
            began = time.perf_counter()  # train a window (gathering its items included)
            with memory.window(index):
                result = next(windows, None)
            seconds = time.perf_counter() - began
            loader.window_done()
            if result is None:
                break
            parts.elapsed += seconds
            epoch, window = int(result.epoch or 0), int(result.window or 0)
            row = _train_row(parts, result, seconds)  # record it: the terminal's line, then the file's row,
            progress.update(row["window_index"] + 1, result.loss, result.num_items, seconds)
            metrics.write(row)  # so that a signal after the row is written is said after the window's line
            if result.skipped and not skipped_before and cfg.precision != "fp16":
                skipped_before = True
                life.say(_skipped_line(cfg, row))
            ended = window + 1 == per_epoch
            if ended:  # evaluate at the epoch's end
                last_eval = {"kind": "eval", "epoch": epoch, "window_index": row["window_index"],
                             "step": result.step, **parts.evaluate()}
                metrics.write(last_eval)
            at = Position(epoch + 1, 0, result.step) if ended else Position(epoch, window + 1, result.step)
            last = at.epoch == cfg.epochs  # the final checkpoint comes after the loop
            if life.stop_here(result.stop_requested) and not last:  # stop when asked
                life.stop(at, parts.checkpoint_state)
            if life.checkpoint_due(at) and not last:  # checkpoint when due
                life.save(at, parts.checkpoint_state)
    return at, last_eval, memory


def _train_row(parts: RunParts, result: StepResult, seconds: float) -> Dict[str, Any]:
    """``metrics.jsonl``'s row of one window."""
    epoch, window = int(result.epoch or 0), int(result.window or 0)
    batch = parts.sampler.global_batch_size
    items = min(batch, parts.task.num_train - window * batch)
    share = parts.sampler.shares(window)[parts.sampler.rank]  # this rank's items: the sampler's plan, from the flags
    return {"kind": "train", "window_index": epoch * parts.sampler.num_windows + window, "step": result.step,
            "epoch": epoch, "window": window, "skipped": result.skipped, "loss": result.loss, "lr": result.lr,
            "num_items": result.num_items, "window_items": items, "grad_norm": result.grad_norm,
            "micro_batches": result.micro_batches, "accum_steps": ceil_div(share, parts.sampler.micro_batch_size),
            "micro_batch_size": result.micro_batch_size or parts.micro_batch_size, "world_size": sync.world_size(),
            "samples_per_second": items / seconds if seconds > 0 else None}


def _skipped_line(cfg: TrainConfig, row: Dict[str, Any]) -> str:
    """The first skipped window, in the command line's words (the library's warning names its own
    options, which have no flag here)."""
    fix = f"lower --lr (now {cfg.lr:g})" + ("" if cfg.max_grad_norm else " or clip with --max-grad-norm 1.0")
    return (f"warning: window {row['window_index'] + 1} (epoch {row['epoch']}, window {row['window']}) was skipped: "
            "its loss or gradient is not finite, so no optimizer step was taken; training goes on, and the run "
            f"exits 3 at its end if it does not recover; {fix}")


def run_training(cfg: TrainConfig, folder: RunFolder, task: Task, *, command: str = "gradaccum train --resume",
                 label: Optional[str] = None) -> RunResult:
    """Train ``cfg`` into ``folder`` (entered: locked): fresh, resumed or already complete, as the
    folder and the flags decide. The process group is set up and the task loaded by the caller."""
    device = resolve_device(cfg.device)
    if cfg.world_size != sync.world_size():  # the launch decides; B = M x N x W is checked again
        cfg = replace(cfg, world_size=sync.world_size())
    life = RunLifecycle(folder, command=command, checkpoint_every=cfg.checkpoint_every, device=device)
    plan, state = life.plan(cfg)  # refuses (one line) before anything is written
    cfg = plan.config or cfg
    parts = build_parts(cfg, task, device, folder, plan, state)
    life.total_steps = parts.total_windows
    prefix = f"gradaccum train ({label}):" if label else "gradaccum train:"  # --compare's baseline says so
    label = label or f"accumulate {window_words(cfg, task.num_train, task.window_unit)}"
    result = RunResult({}, model=parts.model, unit=task.unit, lifecycle=life, label=label,
                       window_unit=task.window_unit, config=cfg)
    with life.handling_signals():
        folder.prepare(plan)
        if cfg.window_items > task.num_train and plan.kind != "complete":
            n = task.num_train
            life.say(f"warning: {window_flags(cfg)} {task.window_unit} is more than the {n} {task.window_unit} of the "
                     f"training set: each step takes all {n} (summary.json records global_batch_size {n}); pass "
                     f"--batch-size {n} or less to say so")
        result.history = history = _kept_rows(folder, plan, parts.sampler.num_windows)
        last_eval, memory = None, None
        if plan.kind != "complete":
            done = plan.position.epoch * parts.sampler.num_windows + plan.position.window
            progress = Progress(parts.total_windows, done, label=label, unit=task.unit, prefix=prefix,
                                enabled=sync.is_rank_zero())
            try:
                end, last_eval, memory = run_loop(parts, life, plan.position, history, progress)
            finally:
                progress.close()
            life.finish(end, parts.checkpoint_state)  # the final checkpoint, after the loop
        parts.model.eval()
        result.title = plot_title(cfg, task, history)
        if plan.kind == "complete" and plan.has_summary:  # left as it was (rank 0's copy, on every rank)
            result.summary, result.already_complete = folder.read_json("summary.json"), True
            if not folder.has("loss.png"):  # a Ctrl-C after summary.json, before it
                _plot(folder, result, task)
                life.say(f"drew {folder.out / 'loss.png'}, which was missing, from metrics.jsonl")
        else:
            result.summary = _summary(parts, plan, history, last_eval, memory)
            result.already_complete = plan.kind == "complete"
            life.write_summary(result.summary)
            _plot(folder, result, task)
        result.stopped_by = life.signal_at_end()
    return result


def _plot(folder: RunFolder, result: RunResult, task: Task) -> None:
    """``loss.png`` from the run's rows (written whole or not at all)."""
    from .report import plot_losses

    folder.draw("loss.png", lambda path: plot_losses({result.label: result.history}, path, title=result.title,
                                                      unit=task.unit))


def _kept_rows(folder: RunFolder, plan: ResumePlan, per_epoch: int) -> List[Dict[str, Any]]:
    """The metrics rows before the plan's position; rows of an older version get their window index."""
    if plan.kind == "fresh":
        return []
    rows = folder.kept_history(plan.position)
    for row in rows:
        row.setdefault("kind", "train")
        if row["kind"] == "train":
            row.setdefault("window_index", row["epoch"] * per_epoch + row["window"])
    return rows


def _trailing(rows: List[Dict[str, Any]], holds: Callable[[Dict[str, Any]], bool]) -> int:
    """How many of the last rows, counted back from the end, ``holds`` for."""
    n = 0
    for row in reversed(rows):
        if not holds(row):
            break
        n += 1
    return n


def _summary(parts: RunParts, plan: ResumePlan, history: List[Dict[str, Any]], last_eval: Optional[Dict[str, Any]],
             memory: Optional[RunMemory]) -> Dict[str, Any]:
    """``summary.json``: the test metrics, the run's counts as trained, its memory."""
    cfg, task, acc = parts.cfg, parts.task, parts.acc
    metrics = ({k: v for k, v in last_eval.items() if k.startswith("test_")} if last_eval is not None
               else parts.evaluate())
    rows = [r for r in history if r.get("kind", "train") == "train"]
    per_step = [float(r["num_items"]) for r in rows]
    items = min(cfg.window_items, task.num_train)  # as trained: at most the training set
    micro_batch_size = parts.micro_batch_size  # as it ran: at most a full window's share of one rank
    summary: Dict[str, Any] = dict(metrics)
    summary.update(steps=acc.steps, windows=len(rows), skipped=sum(1 for r in rows if r.get("skipped")),
                   skipped_at_end=_trailing(rows, lambda r: bool(r.get("skipped"))),
                   last_loss=rows[-1]["loss"] if rows else None,
                   last_loss_step=rows[-1].get("step") if rows else None,
                   wall_time_seconds=parts.elapsed,
                   epochs=cfg.epochs, global_batch_size=items, window_items=items, world_size=sync.world_size(),
                   micro_batch_size=micro_batch_size,
                   accum_steps=ceil_div(ceil_div(items, sync.world_size()), int(micro_batch_size)),  # a full window's
                   sharded=cfg.shard, device=str(parts.device), config=cfg.to_dict(), threads=torch.get_num_threads())
    if cfg.window_items > task.num_train:
        summary["requested_global_batch_size"] = cfg.window_items
    summary[f"{task.unit}_per_step"] = sum(per_step) / len(per_step) if per_step else None
    if plan.kind == "complete":
        summary.update(peak_memory_bytes=None, peak_memory_source="not measured: this summary was written by a "
                       "later --resume of the finished run")
    elif memory is not None:
        summary.update(memory.summary())
    return summary
