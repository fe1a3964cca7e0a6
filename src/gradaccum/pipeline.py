"""Exact accumulation over a ``torch.distributed.pipelining`` schedule: :class:`PipelineWindow`.

A pipeline schedule is a window: it runs K micro-batches through the stages, and the optimizer steps
once. Stock, its ``loss_fn`` returns micro-batch k's mean L_k and ``scale_grads=True`` divides the
summed gradient by K: the mean of the micro-batch means, not the window's mean over its N items
(1.45e-2 off one big batch with 23, 3, 9 and 22 target tokens per micro-batch; ``docs/guides/pipeline.md``).
Here the schedule's loss is weighed as every gradaccum window weighs it (:mod:`gradaccum._maths`)::

    micro-batch k backpropagates  S_k * W / N     (S_k = n_k L_k, its summed loss; sum_weight)
    data-parallel reduction        / W            (DDP or fully_shard over the replicas)
    window gradient                sum_k S_k / N  (N: the window's items over every replica)

Build the stages and the schedule as usual, with the per-item loss and ``scale_grads=False``, and step
the window instead of the schedule::

    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=token_loss_sum, scale_grads=False)
    pipe = PipelineWindow(schedule, optimizer, reduction="sum", max_grad_norm=1.0)
    result = pipe.step(inputs, target=targets)     # inputs on the first stage, targets on the last

:meth:`PipelineWindow.step`, on every stage, in the order it runs:

1. **count first**: the last stage counts its targets' items n_k (``num_items``) and the first and last
   stages their micro-batches; one all-reduce over the pipeline group (and one over ``dp_group``) gives
   every stage N and K. A short last window (K below the schedule's ``n_microbatches``) is padded with
   repeats of its last micro-batch that weigh 0.
2. a window of no item is skipped on every stage before the schedule runs;
3. the schedule runs, its ``loss_fn`` weighed: ``S_k * W / N``, or ``L_k * n_k W / N`` for a mean;
4. **boundary**: one all-reduce of (squared gradient norm, summed loss) over the pipeline group (and
   over ``dp_group``): the global norm over every stage's parameters, and the window's loss;
5. the verdict (:func:`gradaccum._maths.verdict`: no item or not finite skips, on every stage alike),
   the clip (:func:`gradaccum._maths.clip_coefficient`), one optimizer step, the gradients cleared, and
   the window recorded in an :class:`~gradaccum.AccumulatorState` (``state_dict``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch

from ._maths import clip_coefficient, target_count, tensor_norms
from ._seam import all_reduce_, loaded_type
from ._state import AccumulatorState
from ._weights import WindowWeights
from .errors import ConfigurationError, NotExactError
from .result import StepResult

__all__ = ["PipelineWindow"]

REDUCTIONS = ("sum", "mean")


def _stages(schedule: Any) -> List[Any]:
    """The stages a schedule runs on this rank (``_stages`` of a multi-stage schedule, else ``_stage``)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if not hasattr(schedule, "_loss_fn") or any(s is None for s in stages):
        raise ConfigurationError(f"schedule={type(schedule).__name__} is not a torch.distributed.pipelining schedule; "
                                 "build one (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B...) over your stages")
    return stages


def _check_loss(loss_fn: Any, reduction: str) -> None:
    """Refuse a loss that is not a per-item sum or mean, and a module that says another reduction."""
    if reduction not in REDUCTIONS:
        raise NotExactError(f"reduction={reduction!r}: a pipeline window is exact for a loss that is the sum "
                            "('sum') or the mean ('mean', with num_items counting what it averages over) of per-item "
                            "terms; return the micro-batch's summed loss and pass reduction='sum'")
    said = getattr(loss_fn, "reduction", None)
    if said is not None and said != reduction:
        raise NotExactError(f"the schedule's loss_fn is a {type(loss_fn).__name__}(reduction={said!r}) but reduction="
                            f"{reduction!r} was declared: build the loss with reduction={reduction!r} (a per-item sum "
                            "or mean), or declare what it returns")
    if reduction == "mean" and getattr(loss_fn, "weight", None) is not None:
        raise NotExactError(f"the schedule's loss_fn is a {type(loss_fn).__name__} with class weights and reduction="
                            "'mean': it divides by the summed weights, not by the items num_items counts; build it "
                            "with reduction='sum' and declare reduction='sum'")


def _zero(output: Any) -> torch.Tensor:
    """A zero joined to the stage's output, for a micro-batch that weighs 0 (padding, no item): its
    backward brings every parameter 0 where ``0 * nan`` (a mean over 0 items) would bring nan."""
    tensors = [output] if isinstance(output, torch.Tensor) else [o for o in output if isinstance(o, torch.Tensor)]
    return sum(t.sum() for t in tensors) * 0.0


def _pad(value: Any, rows: int, pad: int) -> Any:
    """``value`` with ``pad`` repeats of its last ``rows`` rows (a tensor; anything else as it is)."""
    if not isinstance(value, torch.Tensor) or pad == 0:
        return value
    return torch.cat([value] + [value[-rows:]] * pad)


class PipelineWindow:
    """One optimizer step per window of a ``torch.distributed.pipelining`` schedule, weighed as one big batch.

    Args:
        schedule: a schedule over this rank's stages (``ScheduleGPipe``, ``Schedule1F1B``,
            ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
            ``ScheduleZBVZeroBubble``), built with ``loss_fn`` (called as ``loss_fn(output, target)`` on the
            last stage, per micro-batch) and ``scale_grads=False``; gradaccum weighs that ``loss_fn``.
        optimizer: the optimizer of this rank's stages' parameters, stepped once per window.
        reduction: what ``loss_fn`` returns per micro-batch: ``"sum"`` (S_k, its summed loss; torchtitan's
            token sum) or ``"mean"`` (L_k over the ``num_items`` of its target).
        num_items: ``num_items(target)`` -> n_k, micro-batch k's items (a count, on any device). Default: the
            targets that are not -100 (:func:`gradaccum._maths.target_count`, cross-entropy's ``ignore_index``).
        micro_batch_size: rows per micro-batch: a window of fewer rows than the schedule's
            ``n_microbatches * micro_batch_size`` (the short last window) is padded with repeats of its last
            micro-batch that weigh 0. Default: every window fills the schedule.
        max_grad_norm: clip by the global norm over every stage's parameters (and the replicas' shards).
        pp_group: the pipeline's process group (the stages'); default the world.
        dp_group: the replicas' group, where each stage's module is in ``fully_shard`` over it (FSDP2, as
            torchtitan; ``DistributedDataParallel`` is refused: its reducer fails under a PipelineStage):
            N sums over it and W is its size. Default: no data parallelism, W = 1.
        lr_scheduler: stepped after each optimizer step.
    """

    def __init__(self, schedule: Any, optimizer: torch.optim.Optimizer, *, reduction: str,
                 num_items: Optional[Callable[[torch.Tensor], Any]] = None, micro_batch_size: Optional[int] = None,
                 max_grad_norm: Optional[float] = None, pp_group: Any = None,
                 dp_group: Any = None, lr_scheduler: Any = None) -> None:
        self.stages = _stages(schedule)
        loss_fn = schedule._loss_fn
        if loss_fn is None:
            raise ConfigurationError(f"schedule={type(schedule).__name__} was built without loss_fn, so it runs no "
                                     "backward: build it with loss_fn=your per-item loss (reduction='sum' or 'mean')")
        if schedule.scale_grads:
            raise ConfigurationError(
                f"schedule={type(schedule).__name__} was built with scale_grads=True: it divides the window's gradient "
                f"by n_microbatches={schedule._n_microbatches}, the mean of micro-batch means, not one big batch; "
                "build it with scale_grads=False (gradaccum divides by the window's N)")
        _check_loss(loss_fn, reduction)
        if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
            raise ConfigurationError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigurationError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        wrapped = [s for s in self.stages if _data_parallel(s.submod) is not None]
        if any(_data_parallel(s.submod) == "DistributedDataParallel" for s in wrapped):
            raise NotExactError(
                "a stage's module is wrapped in DistributedDataParallel: a PipelineStage's shape inference runs a "
                "backward outside no_sync, and DDP's reducer then fails its first window (torch 2.13: 'rebuilt "
                "parameter indices size is not same as original model parameters size'), so no exact window was "
                "measured over it; wrap each stage's module in fully_shard(module, mesh=mesh['dp']) instead, as "
                "torchtitan does, and pass dp_group=mesh['dp'].get_group()")
        if wrapped and dp_group is None:
            raise ConfigurationError(
                f"stage {wrapped[0].stage_index}'s module is wrapped in {_data_parallel(wrapped[0].submod)} but "
                "dp_group=None: pass dp_group= the replicas' group (mesh['dp'].get_group()), over which the window's "
                "items are summed and the gradient averaged")
        if dp_group is not None and dp_group.size() > 1 and len(wrapped) < len(self.stages):
            raise ConfigurationError(
                "dp_group has several replicas but a stage's module is not in fully_shard: its replicas would step "
                "on their own gradients; wrap each stage's module in fully_shard(module, mesh=mesh['dp'])")
        self.schedule, self.optimizer, self.lr_scheduler = schedule, optimizer, lr_scheduler
        self.reduction, self.micro_batch_size, self.max_grad_norm = reduction, micro_batch_size, max_grad_norm
        self.num_items = num_items or target_count
        self.pp_group, self.dp_group = pp_group, dp_group
        #: W: the replicas the data-parallel reduction averages over (1 without ``dp_group``)
        self.grad_divisor = float(dp_group.size()) if dp_group is not None else 1.0
        #: steps, skipped windows and the last window's N, saved by :meth:`state_dict`
        self.state = AccumulatorState()
        self._user_loss = loss_fn
        schedule._loss_fn = self._weighted  # the schedule now backpropagates the window's weight
        self._window: Dict[str, Any] = {}

    # -- one window, in the order it runs ---------------------------------------------------------------

    def step(self, *args: Any, target: Optional[torch.Tensor] = None, **kwargs: Any) -> StepResult:
        """Run the schedule over one window and step once on every stage (call it on every rank, the
        inputs on the first stage, ``target`` on the last, nothing on the others).

        Returns:
            the window's :class:`~gradaccum.StepResult`, the same on every rank but ``micro_batches``:
            the loss ``sum_k S_k / N`` and the norm before clipping (over every stage), N, skipped.
        """
        first, last = any(s.is_first for s in self.stages), any(s.is_last for s in self.stages)
        if last and target is None:
            raise ConfigurationError("this rank holds the last stage: pass target= its window's targets")
        n_mb = self.schedule._n_microbatches
        k_first = self._micro_batches(next((a for a in args if isinstance(a, torch.Tensor)), None), first, "inputs")
        k_last = self._micro_batches(target, last, "target")
        rows = self.micro_batch_size or 0
        args = tuple(_pad(a, rows, n_mb - k_first) for a in args) if first else args
        kwargs = {k: _pad(v, rows, n_mb - k_first) for k, v in kwargs.items()} if first else kwargs
        target = _pad(target, rows, n_mb - k_last) if last else None
        counts = [self.num_items(t) for t in torch.tensor_split(target, n_mb)[:k_last]] if last else []
        device = self.stages[0].device

        # 1. count first: N over the replicas, K agreed by the first and last stages
        local = torch.stack([torch.as_tensor(c, dtype=torch.float64).to(device) for c in counts]).sum() \
            if counts else torch.zeros((), dtype=torch.float64, device=device)
        told = torch.stack([local, torch.tensor(float(k_first), dtype=torch.float64, device=device),
                            torch.tensor(float(k_last), dtype=torch.float64, device=device)])
        all_reduce_(told, group=self.pp_group)
        n = told[:1].clone()
        if self.dp_group is not None:
            all_reduce_(n, group=self.dp_group)
        num_items, k_in, k_out = n.item(), *(int(k) for k in told[1:].tolist())
        num_items = int(num_items) if num_items.is_integer() else num_items
        if k_in != k_out:
            raise ConfigurationError(f"the first stage's inputs hold {k_in} micro-batches but the last stage's target "
                                     f"{k_out}: pass both stages the same window")
        weights = WindowWeights(self.state, self.grad_divisor, num_items=num_items)
        self._window = {"weights": weights, "k": k_out, "summed": {},
                        "counts": [float(c) for c in counts] if self.reduction == "mean" else None}
        lr = float(self.optimizer.param_groups[0]["lr"])

        # 2. a window of no item: skipped on every stage, before the schedule runs
        if weights.empty:
            closing = weights.close(0.0)
            self.optimizer.zero_grad(set_to_none=True)
            weights.record(closing, warn_empty="the pipeline's targets are all ignore_index")
            return StepResult(math.nan, num_items, k_out, None, True, lr, self.state.steps)

        # 3. the schedule: each micro-batch's loss weighed by self._weighted
        self.schedule.step(*args, target=target,
                           return_outputs=False, **kwargs)

        # 4. the boundary: the global squared norm and the window's summed loss, in one all-reduce per group
        grads = [p.grad for s in self.stages for p in s.submod.parameters() if p.grad is not None]
        local_grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # fully_shard: this shard
        square = (tensor_norms(local_grads, torch.float64) ** 2).sum() if grads \
            else torch.zeros((), dtype=torch.float64, device=device)
        summed = list(self._window["summed"].values())
        loss_sum = torch.stack(summed).sum().to(torch.float64) if summed else torch.zeros((), dtype=torch.float64)
        told = torch.stack([square.to(device), loss_sum.to(device)])
        for group in (self.pp_group, self.dp_group) if self.dp_group is not None else (self.pp_group,):
            all_reduce_(told, group=group)
        square_sum, loss = told.tolist()

        # 5. verdict, clip, step, record
        closing = weights.close(num_items, loss_sum=loss, raw_norm=math.sqrt(square_sum), nonfinite="skip")
        if closing.steps:
            coefficient = clip_coefficient(closing.grad_norm, self.max_grad_norm)
            if coefficient < 1.0 and grads:
                torch._foreach_mul_(grads, coefficient)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        weights.record(closing)
        return StepResult(loss / num_items, num_items, k_out, closing.grad_norm, not closing.steps, lr, self.state.steps)

    def _micro_batches(self, batch: Optional[torch.Tensor], here: bool, name: str) -> int:
        """K, this window's micro-batches, from the rows of ``batch`` (0 where this rank holds no such stage)."""
        n_mb = self.schedule._n_microbatches
        if not here:
            return 0
        if batch is None:
            raise ConfigurationError(f"this rank holds the {'first' if name == 'inputs' else 'last'} stage: pass its "
                                     f"{name}, a tensor of the window's rows")
        rows, size = batch.shape[0], self.micro_batch_size
        if size is None:
            if rows < n_mb:
                raise ConfigurationError(f"{name} hold {rows} rows for n_microbatches={n_mb}: pass micro_batch_size= "
                                         "to pad a short window")
            return n_mb
        if rows % size or not 0 < rows <= n_mb * size:
            raise ConfigurationError(f"{name} hold {rows} rows: a window is 1 to n_microbatches={n_mb} micro-batches "
                                     f"of micro_batch_size={size} rows")
        return rows // size

    def _weighted(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's ``loss_fn``: micro-batch k's loss times its weight (``W / N`` per summed item); a
        padding micro-batch, or a mean over no item, backpropagates 0."""
        window = self._window
        # k: the schedule's own index of this micro-batch (its losses so far; cleared as each step ends). The
        # stage's shape inference calls loss_fn once more, on micro-batch 0, before the schedule's first
        # step: that call's summed loss is overwritten by micro-batch 0's own, and its gradient dropped
        k = len(self.schedule._internal_losses)
        weights: WindowWeights = window["weights"]
        if k >= window["k"] or (window["counts"] is not None and window["counts"][k] == 0):
            return _zero(output)
        loss = self._user_loss(output, target)
        if self.reduction == "sum":
            window["summed"][k] = loss.detach()
            return loss * weights.sum_weight()
        n_k = window["counts"][k]
        window["summed"][k] = loss.detach() * n_k
        return loss * weights.mean_weight(n_k)

    # -- resume -----------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The window's counters (steps, skipped, the last window's N); save them beside the stages'
        and the optimizer's state dicts: a resumed run continues bit-identically."""
        return self.state.saved()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        for name, value in self.state.read_saved(state).items():
            setattr(self.state, name, value)


def _data_parallel(module: Any) -> Optional[str]:
    """The data-parallel wrapper of a stage's module, by name: DistributedDataParallel, fully_shard, or None."""
    for name, homes, kind in (("DistributedDataParallel", ("torch.nn.parallel.distributed",), "DistributedDataParallel"),
                              ("fully_shard", ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"), "FSDPModule")):
        wrapper = loaded_type(homes, kind)
        if wrapper is not None and isinstance(module, wrapper):
            return name
    return None
