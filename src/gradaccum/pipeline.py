"""Exact accumulation over a ``torch.distributed.pipelining`` schedule: :class:`PipelineWindow` weighs each
micro-batch as every gradaccum window does (:mod:`gradaccum._weights`), where the stock ``scale_grads=True``
divides the summed gradient by K, the mean of micro-batch means::

    micro-batch k backpropagates  S_k * W / N     (S_k = n_k L_k, its summed loss; sum_weight)
    data-parallel reduction        / W            (fully_shard over the replicas)
    window gradient                sum_k S_k / N  (N: the window's items over every replica)

How a window is counted, run and stepped: docs/guides/pipeline.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._checks import positive_int, positive_number
from ._maths import target_count, tensor_norms
from ._seam import all_reduce_, is_process_group, shared_ranks
from ._settings import check_scheduler_optimizer
from ._state import AccumulatorState
from ._weights import Gradients, WindowWeights, clip_coefficient, window_mean
from .errors import ConfigurationError, NotExactError
from .result import StepResult
from .sync import sharded_stage

__all__ = ["PipelineWindow"]

#: the boundary's all-reduce over the pipeline group, one float64 each; the first two also sum over dp_group
SQUARE, LOSS, ITEMS, K_FIRST, K_LAST, MISCOUNTED = range(6)


def _check_loss(loss_fn: Any, reduction: str) -> None:
    """Refuse a loss that is not a per-item sum or mean, and a module that says another reduction."""
    if reduction not in ("sum", "mean"):
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


def _check_groups(pp_group: Any, dp_group: Any) -> None:
    """Refuse a group that is not a process group, and a pipeline group holding this rank's replicas too."""
    for name, dim, group in (("pp_group", "pp", pp_group), ("dp_group", "dp", dp_group)):
        if group is not None and not is_process_group(group):
            raise ConfigurationError(f"{name}={group!r} is not a process group: pass one such as "
                                     f"mesh[{dim!r}].get_group(), or None")
    if dp_group is None or dp_group.size() == 1:
        return
    shared = shared_ranks(pp_group, dp_group)
    if len(shared) > 1:
        raise ConfigurationError(
            f"pp_group and dp_group share the ranks {shared}: the pipeline group must hold this rank's "
            "stages only, one rank per stage (the default, None, is the world, replicas included), else the "
            "window's items and norm are summed over the replicas twice; pass pp_group=mesh['pp'].get_group()")


def _pad(value: Any, rows: int, pad: int) -> Any:
    if not isinstance(value, torch.Tensor) or pad == 0:
        return value
    return torch.cat([value] + [value[-rows:]] * pad)


@dataclass
class _Tally:
    """What one window's ``pipe.loss`` calls need and leave (on the last stage only)."""

    k: int                               #: the window's real micro-batches (the rest of the schedule's pad)
    counts: List[float]                  #: n_k per real micro-batch
    weights: WindowWeights               #: the window's weights, N known
    targets: List[Optional[int]] = field(default_factory=list)   #: each call's target memory (``data_ptr``)
    inference: int = 0                   #: 1 once the first call is known to be the stage's shape inference
    summed: Dict[int, torch.Tensor] = field(default_factory=dict)   #: S_k per micro-batch, detached

    def index(self, target: Any) -> int:
        """Micro-batch k of this call: the calls come in micro-batch order, the stage's shape inference first."""
        here = target.data_ptr() if isinstance(target, torch.Tensor) else None
        if len(self.targets) == 1 and here is not None and here == self.targets[0]:
            self.inference = 1  # micro-batch 0's memory again: the first call was the stage's shape inference
        self.targets.append(here)
        return len(self.targets) - 1 - self.inference


class PipelineWindow:
    """One optimizer step per window of a ``torch.distributed.pipelining`` schedule, weighed as one big batch.

    Args:
        stages: this rank's ``PipelineStage`` (or the list of them, for an interleaved or V schedule): the
            stages the schedule is built over.
        optimizer: the optimizer of this rank's stages' parameters, stepped once per window.
        loss_fn: your per-item loss, ``loss_fn(output, target)`` on the last stage per micro-batch; build the
            schedule with ``loss_fn=pipe.loss``, its weighed version, and ``scale_grads=False``.
        n_microbatches: the schedule's micro-batches per window (build it with ``pipe.n_microbatches``).
        reduction: what ``loss_fn`` returns per micro-batch: ``"sum"`` (S_k, its summed loss; torchtitan's
            token sum) or ``"mean"`` (L_k over the ``num_items`` of its target).
        num_items: ``num_items(target)`` -> n_k, micro-batch k's items (a count, on any device). Default: the
            targets that are not -100 (:func:`gradaccum._maths.target_count`, cross-entropy's ``ignore_index``).
        micro_batch_size: rows per micro-batch: a window of fewer rows than ``n_microbatches *
            micro_batch_size`` (the short last window) is padded with repeats of its last micro-batch that
            weigh 0. Default: every window fills the schedule.
        max_grad_norm: clip by the global norm over every stage's parameters (and the replicas' shards).
        pp_group: the pipeline's process group, one rank per stage (``mesh['pp'].get_group()``); default the
            world, which then holds no replica (with ``dp_group``, one sharing more than this rank is refused).
        dp_group: the replicas' group, where each stage's module is in ``fully_shard`` over it (FSDP2, as
            torchtitan; ``DistributedDataParallel`` is refused: its reducer fails under a PipelineStage):
            N sums over it and W is its size. Default: no data parallelism, W = 1.
        lr_scheduler: stepped after each optimizer step.

    Collectives per window: one all-reduce over ``pp_group``; with ``dp_group``, one more over it, and on
    the last stage's ranks one more (N, before the schedule).
    """

    def __init__(self, stages: Any, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor], *,
                 n_microbatches: int, reduction: str, num_items: Optional[Callable[[torch.Tensor], Any]] = None,
                 micro_batch_size: Optional[int] = None, max_grad_norm: Optional[float] = None,
                 pp_group: Any = None, dp_group: Any = None, lr_scheduler: Any = None) -> None:
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]  # a list when interleaved
        needed = ("is_first", "is_last", "submod", "device")
        if not self.stages or not all(hasattr(s, a) for s in self.stages for a in needed):
            raise ConfigurationError(f"stages={stages!r} is not this rank's torch.distributed.pipelining stages: pass "
                                     "the PipelineStage (or the list of them) that the schedule is built over")
        if not callable(loss_fn):
            raise ConfigurationError(f"loss_fn must be your per-item loss, called as loss_fn(output, target); "
                                     f"got {loss_fn!r}")
        _check_loss(loss_fn, reduction)
        self.n_microbatches = positive_int("n_microbatches", n_microbatches)
        self.micro_batch_size = None if micro_batch_size is None else positive_int("micro_batch_size", micro_batch_size)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer over this rank's stages' parameters, got "
                            f"{type(optimizer).__name__}")
        check_scheduler_optimizer(lr_scheduler, optimizer, "PipelineWindow", "lr_scheduler")
        if num_items is not None and not callable(num_items):
            raise ConfigurationError(f"num_items must be a function num_items(target) -> n_k, got {num_items!r}; "
                                     "e.g. lambda target: (target != -100).sum()")
        if max_grad_norm is not None:
            max_grad_norm = positive_number("max_grad_norm", max_grad_norm, what="a positive finite number or None")
        _check_groups(pp_group, dp_group)
        sharded = [s for s in self.stages if sharded_stage(s.submod)]  # each stage in fully_shard, or none
        if sharded and dp_group is None:
            raise ConfigurationError(
                f"stage {sharded[0].stage_index}'s module is in fully_shard but dp_group=None: pass dp_group= the "
                "replicas' group (mesh['dp'].get_group()), over which the window's items are summed and the "
                "gradient averaged")
        if dp_group is not None and dp_group.size() > 1 and len(sharded) < len(self.stages):
            raise ConfigurationError(
                "dp_group has several replicas but a stage's module is not in fully_shard: its replicas would step "
                "on their own gradients; wrap each stage's module in fully_shard(module, mesh=mesh['dp'])")
        self.optimizer, self.lr_scheduler, self.loss_fn = optimizer, lr_scheduler, loss_fn
        self.reduction, self.max_grad_norm = reduction, max_grad_norm
        self.num_items = num_items or target_count
        self.pp_group, self.dp_group = pp_group, dp_group
        self.first, self.last = any(s.is_first for s in self.stages), any(s.is_last for s in self.stages)
        self.device = self.stages[0].device
        #: W: the replicas the data-parallel reduction averages over (1 without ``dp_group``)
        self.grad_divisor = float(dp_group.size()) if dp_group is not None else 1.0
        #: steps, skipped windows and the last window's N, saved by :meth:`state_dict`
        self.state = AccumulatorState()
        self._tally: Optional[_Tally] = None  # the window in progress, inside step() only

    # -- one window, in the order it runs ---------------------------------------------------------------

    def step(self, schedule: Any, *args: Any, target: Optional[torch.Tensor] = None, **kwargs: Any) -> StepResult:
        """Run ``schedule`` over one window and step once on every stage (call it on every rank, the inputs
        on the first stage, ``target`` on the last, nothing on the others).

        Returns:
            the window's :class:`~gradaccum.StepResult`, the same on every rank: the loss ``sum_k S_k / N``,
            N, the window's micro-batches K, the norm before clipping (over every stage), skipped.
        """
        if not callable(getattr(schedule, "step", None)):
            raise ConfigurationError(f"schedule={schedule!r} is not a torch.distributed.pipelining schedule: build "
                                     "one (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B...) over the stages")
        if getattr(schedule, "scale_grads", False):
            raise ConfigurationError(
                f"schedule={type(schedule).__name__} was built with scale_grads=True: it divides the window's gradient "
                f"by n_microbatches={self.n_microbatches}, the mean of micro-batch means, not one big batch; build it "
                "with scale_grads=False (gradaccum divides by the window's N)")
        args, kwargs, target, k_first = self._count(args, kwargs, target)
        try:
            schedule.step(*args, target=target, return_outputs=False, **kwargs)
            told = self._boundary(k_first)
        finally:
            self._tally = None
        return self._step(told)

    def _count(self, args: Tuple[Any, ...], kwargs: Dict[str, Any],
               target: Optional[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any], Any, int]:
        """1. The window's micro-batches on the first stage (its inputs padded to the schedule's), and on the
        last its targets' n_k and N over the replicas (one all-reduce over ``dp_group``): the tally."""
        rows, n_mb = self.micro_batch_size or 0, self.n_microbatches
        k_first = 0
        if self.first:
            k_first = self._micro_batches(next((a for a in args if isinstance(a, torch.Tensor)), None), "inputs")
            args = tuple(_pad(a, rows, n_mb - k_first) for a in args)
            kwargs = {name: _pad(v, rows, n_mb - k_first) for name, v in kwargs.items()}
        if not self.last:  # no pipe.loss call here: no tally
            return args, kwargs, None, k_first
        k = self._micro_batches(target, "target")
        target = _pad(target, rows, n_mb - k)
        counts = [self.num_items(t) for t in torch.tensor_split(target, n_mb)[:k]]
        each = torch.stack([torch.as_tensor(c, dtype=torch.float64).to(self.device) for c in counts])
        n = each.sum().reshape(1)
        if self.dp_group is not None:
            all_reduce_(n, group=self.dp_group)
        *each_n, num_items = torch.cat([each, n]).tolist()  # one host read for the window, not one per micro-batch
        self._tally = _Tally(k, each_n, WindowWeights(self.state, self.grad_divisor, num_items=num_items))
        return args, kwargs, target, k_first

    def _micro_batches(self, batch: Optional[torch.Tensor], name: str) -> int:
        """K, this window's micro-batches, from the rows of ``batch``."""
        n_mb = self.n_microbatches
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

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's ``loss_fn`` (``loss_fn=pipe.loss``): micro-batch k's loss times its weight (``W / N``
        per summed item); a padding micro-batch, a mean over no item, or a window of none backpropagates 0.
        Outside :meth:`step` (``schedule.eval``) it is your ``loss_fn`` itself."""
        tally = self._tally
        if tally is None:
            return self.loss_fn(output, target)
        k, weights, mean = tally.index(target), tally.weights, self.reduction == "mean"
        if weights.empty or k >= tally.k or (mean and tally.counts[k] == 0):  # weighs 0: a zero joined to the
            # output, whose backward brings every parameter 0 where 0 * nan (a mean over 0 items) would bring nan
            outputs = [output] if isinstance(output, torch.Tensor) else output
            return sum(t.sum() for t in outputs if isinstance(t, torch.Tensor)) * 0.0
        loss = self.loss_fn(output, target)
        tally.summed[k] = loss.detach() * tally.counts[k] if mean else loss.detach()
        return loss * (weights.mean_weight(tally.counts[k]) if mean else weights.sum_weight())

    def _boundary(self, k_first: int) -> torch.Tensor:
        """3. The boundary's one all-reduce over the pipeline group (its layout: ``SQUARE`` ... ``MISCOUNTED``)."""
        tally = self._tally
        told = torch.zeros(6, dtype=torch.float64, device=self.device)
        grads = self._gradients().tensors()
        if grads:
            told[SQUARE] = (tensor_norms([g.to_local() if hasattr(g, "to_local") else g for g in grads],
                                         torch.float64) ** 2).sum()  # fully_shard: this rank's shard
        if self.last:
            told[LOSS] = sum(s.to(self.device, torch.float64) for s in tally.summed.values())
            told[ITEMS], told[K_LAST] = float(tally.weights.num_items or 0), float(tally.k)
            told[MISCOUNTED] = float(len(tally.targets) - tally.inference != self.n_microbatches)  # loss calls
        told[K_FIRST] = float(k_first)
        all_reduce_(told, group=self.pp_group)
        if self.dp_group is not None:
            all_reduce_(told[:ITEMS], group=self.dp_group)
        return told

    def _gradients(self) -> Gradients:
        return Gradients([p for s in self.stages for p in s.submod.parameters()], None)

    def _step(self, told: torch.Tensor) -> StepResult:
        """4. The verdict, the clip, one optimizer step on every stage alike, the gradients cleared, recorded."""
        square, loss, items, k_first, k_last, miscounted = told.tolist()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if miscounted or k_first != k_last:
            self.optimizer.zero_grad(set_to_none=True)
            raise ConfigurationError(
                f"the schedule's loss_fn was not called once per micro-batch of n_microbatches={self.n_microbatches}: "
                "build the schedule with loss_fn=pipe.loss and n_microbatches=pipe.n_microbatches (nothing was stepped)"
                if miscounted else f"the first stage's inputs hold {int(k_first)} micro-batches but the last stage's "
                f"target {int(k_last)} (of n_microbatches={self.n_microbatches}): pass both stages the same window "
                "(nothing was stepped)")
        num_items = int(items) if items.is_integer() else items
        weights = WindowWeights(self.state, self.grad_divisor, num_items=num_items)
        closing = weights.close(num_items, loss_sum=loss, raw_norm=math.sqrt(square), nonfinite="skip")
        if closing.steps:
            self._gradients().finalize(clip_coefficient(closing.grad_norm, self.max_grad_norm))
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        weights.record(closing, warn_empty="the pipeline's targets are all ignore_index")
        return StepResult(window_mean(loss, num_items), num_items, int(k_last),
                          None if weights.empty else closing.grad_norm, not closing.steps, lr, self.state.steps)

    def state_dict(self) -> Dict[str, Any]:
        """The window's counters (steps, skipped, the last window's N); save them beside the stages'
        and the optimizer's state dicts: a resumed run continues bit-identically."""
        return self.state.saved()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.state.load_saved(self.state.read_saved(state))
