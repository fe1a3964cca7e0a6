"""Accumulator: a window of micro-batches -> weighted backward -> one reduction -> one optimizer step.

The maths. A window holds micro-batches k = 1..K (on every rank r) with n_k items and mean loss L_k.
One step on the whole window is a step on its item-weighted mean loss::

    L = sum_k n_k L_k / N,        grad L = sum_k n_k grad L_k / N,        N = sum_{r,k} n_k

so each micro-batch backpropagates ``(n_k * W / R) * L_k`` (gradients add up in ``.grad``; W is the
number of ranks the data-parallel reduction averages over, 1 locally) and at the boundary the summed
gradient is multiplied once by ``R / N``. R is the window's global item count whenever it is known
before the first backward: the micro-batches' leading dimensions when ``loss_fn`` returns a bare mean,
or what a ``num_items=`` counter says. Then ``R / N == 1``: no scaling pass, and each micro-batch's
backward sees the very weights ``n_k / N`` of the full batch, so float32 parts of a float64 model (a
Llama RMSNorm) round as one big batch does. When the counts come from ``loss_fn`` only (a
``(mean, count)`` pair), R is a reference count fixed beforehand and the scale corrects it exactly.
Dividing each micro-batch by K instead is exact only when every n_k is equal, which uneven
micro-batches, padded sequences and a short last window are not.

Ranks agree when a window opens (one small all-gather of micro-batch and item counts): a rank whose
data ran out still runs a forward (a zero-weight repeat of a micro-batch it has, since DDP and FSDP2
run collectives in forward) and contributes zero items, so every rank steps the same number of times
and nothing waits forever.

At the boundary, in this order: one all-reduce of ``(loss sum, N)``; unscale (fp16); the total
norm of the normalized gradient (with ``max_grad_norm``, fp16 or ``compute_grad_norm``: a pass over
the gradient that the plain loop does not make); a non-finite check of the loss and that norm (skip
or raise); clipping; the optimizer step; the scheduler step; gradients cleared. The only host
synchronisations are one ``.tolist()`` per window for the result and, across ranks, the agreement.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .batching import Batch, MicroBatchSize, as_micro_batches, check_micro_batch_size, leading_dim, split_batch
from .buffers import AccumulationBuffers
from .precision import MixedPrecision
from .result import StepResult
from .schedule import AccumSchedule, AccumSteps, check_positive_int
from .sync import DDPSync, GradSync, full_tensor, sync_for

LossFn = Callable[[nn.Module, Batch], Union[torch.Tensor, Tuple[torch.Tensor, Union[int, float, torch.Tensor]]]]
Count = Union[int, float, torch.Tensor]
CountFn = Callable[[Batch], Count]

__all__ = ["Accumulator", "Window", "WindowPlan", "AccumSchedule", "is_out_of_memory"]

_NONFINITE = ("skip", "raise")
_BATCHNORM = (nn.modules.batchnorm._BatchNorm,)


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA's ``torch.OutOfMemoryError`` and the CPU allocator's "can't allocate memory"."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _check_count(name: str, value: Any) -> Count:
    """A count of items: a finite number >= 0, or a tensor (left on its device, unchecked)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one number, got a tensor of shape {tuple(value.shape)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (how many items the loss is a mean over), "
                         f"got {value!r}")
    return value


def _unpack_loss(out: Any, count: Count) -> Tuple[torch.Tensor, Count]:
    """``loss_fn`` output -> (mean loss, item count). A bare loss counts ``count``: the micro-batch's
    leading dimension, or what the ``num_items`` counter said."""
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], _check_count("the count returned by loss_fn", out[1])
    if isinstance(out, torch.Tensor):
        return out, count
    raise TypeError(
        f"loss_fn must return a scalar tensor (the mean loss over the micro-batch) or a pair "
        f"(mean_loss, num_items), got {type(out).__name__}"
    )


def _as_number(count: Count) -> float:
    return float(count.item()) if isinstance(count, torch.Tensor) else float(count)


@dataclass(frozen=True)
class WindowPlan:
    """What every rank agreed on when a window opened.

    Attributes:
        micro_batches: this rank's micro-batches.
        most, fewest: the largest and smallest count on any rank.
        items: the window's global item count when every rank knew its own before the first
            backward (then it is R, and the boundary scale is 1); else None.
    """

    micro_batches: int
    most: int
    fewest: int
    items: Optional[float]


class _MicroBatch:
    """One micro-batch's context: the sync switch (skip the reduction unless ``reduces``) and autocast,
    each entered only where it does something (a local fp32 window pays for neither)."""

    __slots__ = ("window", "reduces", "stack")

    def __init__(self, window: "Window", reduces: bool) -> None:
        self.window, self.reduces = window, reduces
        self.stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> None:
        acc = self.window._acc
        if acc.sync.distributed or acc.precision.dtype is not None:
            stack = self.stack = contextlib.ExitStack()
            stack.enter_context(acc.sync.micro_batch(last=self.reduces))
            stack.enter_context(acc.precision.autocast())
        self.window._in_micro_batch = True

    def __exit__(self, *exc: Any) -> None:
        self.window._in_micro_batch = False
        if self.stack is not None:
            self.stack.close()  # restores every switch, also when an exception leaves the block


class Window:
    """One open window: its micro-batches, each a forward and backward, then one ``step()``.

    This is the lower-level path for people who keep their own loop; ``Accumulator.step`` is built
    on it. Every micro-batch runs inside ``micro_batch()`` (which skips the gradient reduction
    before the last one and autocasts) and hands ``backward`` its *mean* loss and item count::

        with acc.window(len(micro_batches)) as window:
            for mb in micro_batches:
                with window.micro_batch():
                    loss = criterion(model(mb[0]), mb[1])
                    window.backward(loss, num_items=len(mb[0]))
            result = window.step()

    Under data parallelism every rank runs a forward in each window (DDP and FSDP2 run collectives
    there). A rank whose data ran out opens ``acc.window(0, pad=True)``, runs ``window.padding``
    zero-weight micro-batches (any micro-batch it has, through ``window.backward_padding``) and steps
    with the others: it contributes no items, and the step stays exact::

        with acc.window(len(mine), pad=True) as window:
            for mb in mine: ...                           # as above
            for _ in range(window.padding):               # DDP: one on a rank with none; FSDP2: up to the most
                with window.micro_batch():
                    window.backward_padding(criterion(model(spare[0]), spare[1]))
            result = window.step()

    ``num_items=`` (this rank's items in the window, known before the first backward) makes each
    backward weigh exactly ``n_k / N`` and saves the scaling pass at the boundary.

    Leaving the block by an exception, or without ``step()``, drops the window's gradients.
    """

    def __init__(self, acc: "Accumulator", num_micro_batches: Optional[int], *,
                 num_items: Optional[Count] = None, micro_batch_size: Optional[Any] = None,
                 defer_reduction: bool = False, can_pad: bool = False,
                 plan: Optional[WindowPlan] = None) -> None:
        if num_micro_batches is not None and not (acc.sync.distributed and num_micro_batches == 0):
            check_positive_int("num_micro_batches", num_micro_batches)
        if num_items is not None:
            _check_count("num_items", num_items)
        self._acc = acc
        self.size = num_micro_batches
        self.micro_batch_size = micro_batch_size
        self.done = 0
        #: zero-weight micro-batches this rank runs so that every rank runs as many (FSDP2)
        self.padding = 0
        self.plan: Optional[WindowPlan] = plan  # agreed already (train() needs it before opening)
        self._num_items = num_items
        self._can_pad = can_pad
        self._open = False
        self._in_micro_batch = False
        self._result: Optional[StepResult] = None
        self._abandoned = False
        self._defer = defer_reduction
        self._reference: Optional[float] = None  # R for this window when known up front
        self._sum_dtype = torch.float32 if acc.device.type == "mps" else torch.float64
        self._loss_sum: Optional[torch.Tensor] = None  # sum n_k L_k, on the device (made by the first)
        self._host_items = 0.0  # sum of the counts given as Python numbers
        self._device_items: Optional[torch.Tensor] = None  # sum of the counts given as tensors

    def __enter__(self) -> "Window":
        acc = self._acc
        acc._begin_window(self)
        try:
            if self.size is not None:
                if self.plan is None:
                    self.plan = acc._agree(self.size, self._num_items, self._can_pad)
                self._follow(self.plan)
            elif self._num_items is not None and not acc.sync.distributed:
                self._reference = _as_number(self._num_items)
        except BaseException:
            acc._end_window(self)
            raise
        self._open = True
        return self

    def _follow(self, plan: WindowPlan) -> None:
        """Act on the agreement, identically on every rank."""
        acc = self._acc
        sync = acc.sync
        if plan.items is not None and plan.items > 0:
            # counts known up front: R = N exactly (ratio 1). When loss_fn counts other items (tokens
            # of sequences), the last window's ratio keeps the backward near a mean loss's magnitude
            self._reference = plan.items * acc.count_ratio
        if plan.most == plan.fewest:
            return
        target = _padded_count(plan.micro_batches, plan.most, sync.needs_equal_counts)
        if target > plan.micro_batches:
            # the agreement refused, on every rank alike, any window where a rank that must pad cannot
            assert self._can_pad, "the agreement lets no rank pad that cannot"
            self.padding = target - plan.micro_batches
            self.size = target

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._open = False
        self._acc._end_window(self)
        if self._result is None:
            self._acc._clear_grads()
            if exc_type is None and not self._abandoned:
                raise RuntimeError(
                    "the window was closed without step(); call window.step() inside the "
                    "`with acc.window(...)` block to take its optimizer step"
                )

    def micro_batch(self, *, last: Optional[bool] = None) -> "_MicroBatch":
        """Context for one micro-batch's forward and backward.

        ``last`` defaults to "this is micro-batch number ``num_micro_batches``"; pass it when the
        window was opened without a size. Only the last micro-batch reduces gradients across ranks.
        """
        if not self._open:
            raise RuntimeError("use window.micro_batch() inside `with acc.window(...) as window:`")
        if self.size is not None and self.done >= self.size:
            raise RuntimeError(
                f"the window was opened for {self.size} micro-batches and all have run; "
                "call window.step(), or open it with the right num_micro_batches"
            )
        if last is None:
            if self.size is None:
                raise ValueError("pass micro_batch(last=...) when the window was opened without a size")
            last = self.done == self.size - 1
        return _MicroBatch(self, bool(last) and not self._defer)

    def _weight(self, num_items: Count, loss: torch.Tensor) -> Union[float, torch.Tensor]:
        acc = self._acc
        ref = self._reference if self._reference is not None else acc._reference_items(num_items)
        if isinstance(num_items, torch.Tensor):
            # in the loss's precision: an int64 count / float would round the weight to float32
            return num_items.to(torch.promote_types(loss.dtype, torch.float32)) * (acc.sync.grad_divisor / ref)
        return num_items * acc.sync.grad_divisor / ref  # a Python float: no device tensor per micro-batch

    def _check_loss(self, loss: Any) -> None:
        if not self._in_micro_batch:
            raise RuntimeError(
                "window.backward() must run inside `with window.micro_batch():`, which also wraps "
                "the forward pass (DDP decides in forward whether the backward reduces)"
            )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss must be a scalar tensor (the mean over the micro-batch's items), got {shape}; "
                "reduce it with .mean() or return (mean_loss, num_items)"
            )
        if not loss.requires_grad:
            raise ValueError(
                "loss does not require grad: it was computed under torch.no_grad(), detached, or from "
                "a model with no trainable parameter. Compute it from the model's output inside "
                "window.micro_batch(), without .detach() or .item()"
            )

    def backward(self, loss: torch.Tensor, num_items: Count) -> None:
        """Backpropagate ``num_items * loss`` (the micro-batch's item sum); remember both for the step.

        Args:
            loss: the **mean** loss over the micro-batch's items, a scalar tensor.
            num_items: how many items that mean is over (an int, a float weight, or a tensor left on
                the device).
        """
        self._check_loss(loss)
        _check_count("num_items", num_items)
        acc = self._acc
        scaled = acc.precision.scale(loss * self._weight(num_items, loss))
        if acc.precision.dtype is None:
            scaled.backward()
        else:  # the forward ran under autocast; its backward must not
            with torch.autocast(device_type=acc.device.type, enabled=False):
                scaled.backward()
        if isinstance(num_items, torch.Tensor):
            count = num_items.to(self._sum_dtype)
            part = loss.detach() * count
            self._device_items = count if self._device_items is None else self._device_items + count
            self._loss_sum = part.to(self._sum_dtype) if self._loss_sum is None else self._loss_sum.add_(part)
        else:
            self._host_items += num_items
            if self._loss_sum is None:  # the first: one op, in the sum's (float64) precision
                self._loss_sum = loss.detach().to(self._sum_dtype) * num_items
            else:
                self._loss_sum.add_(loss.detach(), alpha=num_items)  # promoted into the float64 sum
        self.done += 1

    def backward_padding(self, loss: torch.Tensor) -> None:
        """Backpropagate a zero-weight micro-batch: it adds nothing to the gradient or the counts, but
        runs the forward and backward collectives that ranks with data run (FSDP2)."""
        self._check_loss(loss)
        self._weight(0, loss)  # takes part in fixing R, as the ranks with data do
        with torch.autocast(device_type=self._acc.device.type, enabled=False):
            self._acc.precision.scale(loss * 0.0).backward()
        self.done += 1

    def loss_sum(self) -> torch.Tensor:
        """``sum n_k L_k`` of this rank's micro-batches, on the device (0 before any)."""
        if self._loss_sum is None:
            return torch.zeros((), dtype=self._sum_dtype, device=self._acc.device)
        return self._loss_sum

    def totals(self) -> torch.Tensor:
        """``(sum n_k L_k, sum n_k)`` of this rank's micro-batches, on the device."""
        loss_sum = self.loss_sum()
        items = loss_sum.new_tensor(self._host_items)
        if self._device_items is not None:
            items = items + self._device_items
        return torch.stack([loss_sum, items])

    @property
    def reference_items(self) -> Optional[float]:
        """R: the count the backward weights were divided by (see the module docstring)."""
        return self._reference if self._reference is not None else self._acc.reference_items

    def abandon(self) -> None:
        """Drop this window's gradients and take no step (e.g. after an out-of-memory error)."""
        self._abandoned = True
        self._acc._clear_grads()

    def step(self) -> StepResult:
        """Reduce counts, normalize, unscale, clip, take (or skip) the one optimizer step."""
        if self._result is not None:
            raise RuntimeError("step() was already called for this window; open a new one")
        acc = self._acc
        empty_here = self.plan is not None and acc.sync.distributed
        if self.done == 0 and not empty_here:
            raise RuntimeError("step() on a window with no micro-batch; run at least one backward first")
        if self.size is not None and self.done != self.size:
            raise RuntimeError(
                f"the window was opened for {self.size} micro-batches but {self.done} ran; under "
                "data parallelism the last one is the one that reduces gradients, so the counts must match"
            )
        if self._defer:
            acc.sync.reduce_gradients_(acc._materialized_grads())
        self._result = acc._finish_window(self)
        return self._result


class Accumulator:
    """Gradient accumulation that equals one optimizer step on the whole window.

    Args:
        model: the module: plain, ``DistributedDataParallel``, FSDP2 ``fully_shard``-ed, or anything
            holding one of them (``torch.compile(ddp_model)``, Accelerate's prepared model).
        optimizer: any ``torch.optim.Optimizer`` over (some of) the model's trainable parameters.
        scheduler: stepped once per optimizer step taken, never on a skipped window.
        max_grad_norm: clip the window's gradient to this total 2-norm, after normalization and
            unscaling.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        accum_dtype: e.g. ``torch.float32``: accumulate low-precision parameters' gradients in
            buffers of this dtype, rounded once for the optimizer.
        nonfinite: ``"skip"`` a window whose gradient is not finite, or ``"raise"``.
        reduce_every_micro_batch: reduce (all-reduce / reduce-scatter) after every micro-batch
            instead of once per window: for FSDP2 this keeps only sharded gradients between
            micro-batches (less memory, N times the communication).
        data_parallel: ``"auto"`` finds the DDP or FSDP2 module in ``model`` and, when
            ``torch.distributed`` runs several ranks and none reduces the gradients, refuses the
            model (the replicas would drift apart). ``"none"`` trains each rank on its own items on
            purpose: no collective at all.
        compute_grad_norm: measure the window's total gradient norm for ``StepResult.grad_norm``
            (one pass over the gradient). It is always measured with ``max_grad_norm`` or fp16;
            otherwise ``grad_norm`` is None and the non-finite check uses the window's loss, which
            costs nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any = None,
        max_grad_norm: Optional[float] = None,
        precision: str = "fp32",
        accum_dtype: Optional[torch.dtype] = None,
        nonfinite: str = "skip",
        reduce_every_micro_batch: bool = False,
        data_parallel: str = "auto",
        compute_grad_norm: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0
        ):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        if accum_dtype is not None and not isinstance(accum_dtype, torch.dtype):
            raise TypeError(f"accum_dtype must be a torch.dtype such as torch.float32, got {accum_dtype!r}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no parameter that requires grad; there is nothing to accumulate")
        _check_optimizer_covers(optimizer, params, model)
        _check_no_foreign_scaler(optimizer)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.nonfinite = nonfinite
        self.compute_grad_norm = bool(compute_grad_norm)
        self.params = params
        self.device = params[0].device
        self.precision = MixedPrecision(precision, self.device)
        self.sync: GradSync = sync_for(model, reduce_every_micro_batch=reduce_every_micro_batch,
                                       data_parallel=data_parallel)
        self.buffers: Optional[AccumulationBuffers] = None
        if accum_dtype is not None:
            if self.sync.distributed:
                raise ValueError(
                    "accum_dtype is for single-process training; with DDP or FSDP2 keep float32 "
                    "master parameters (FSDP2: MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                    "reduce_dtype=torch.float32)) and leave accum_dtype=None"
                )
            if precision == "fp16":
                raise ValueError(
                    "accum_dtype with precision='fp16' is not supported: GradScaler unscales "
                    "float32 gradients only. Use precision='bf16' or keep float32 parameters"
                )
            self.buffers = AccumulationBuffers(params, accum_dtype)
        #: optimizer steps taken
        self.steps = 0
        #: the micro-batch size that last worked under micro_batch_size="auto"
        self.auto_micro_batch_size: Optional[int] = None
        #: R for windows whose item count is not known up front (see the module docstring)
        self.reference_items: Optional[float] = None
        #: items loss_fn counted per item counted up front, in the last window (1.0 when they agree)
        self.count_ratio = 1.0
        #: the next epoch train() runs when its loader has no WindowSampler (which keeps its own)
        self.epoch = 0
        self._window: Optional[Window] = None
        self._replay: Optional[Batch] = None  # the last micro-batch run, for zero-weight padding
        self._warned: set = set()

    # -- the high-level path ---------------------------------------------------------------

    def step(self, window: Union[Batch, Sequence[Batch]], loss_fn: LossFn, *,
             micro_batch_size: MicroBatchSize = None, num_items: Optional[CountFn] = None) -> StepResult:
        """Run the window's micro-batches and take exactly one optimizer step (or skip it).

        Args:
            window: a list of micro-batches, or one batch when ``micro_batch_size`` is given. Under
                data parallelism a rank whose data ran out passes ``[]``.
            loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss, or ``(mean_loss, num_items)``.
            micro_batch_size: split the batch along dim 0 into chunks of this size (the last may
                be smaller); ``"auto"`` starts from the whole batch (or the last size that worked)
                and halves on out-of-memory errors.
            num_items: ``num_items(micro_batch)`` -> how many items its mean loss is over, counted
                before any forward pass (e.g. ``gradaccum.count_targets(mb["labels"])``). A bare
                loss is then weighted by it instead of the leading dimension, and each backward
                weighs exactly ``n_k / N``. The step is exact without it too.
        """
        self._check_idle()
        check_micro_batch_size(micro_batch_size)
        _check_loss_fn(loss_fn)
        if num_items is not None and not callable(num_items):
            raise TypeError(f"num_items must be a function micro_batch -> count, got {type(num_items).__name__}; "
                            "pass counts of a hand-written loop to window.backward(loss, num_items=...)")
        if micro_batch_size == "auto":
            return self._step_auto(window, loss_fn, num_items)
        micro_batches = as_micro_batches(window, micro_batch_size,  # type: ignore[arg-type]
                                         allow_empty=self.sync.distributed)
        result = self._attempt(micro_batches, loss_fn, num_items, micro_batch_size=micro_batch_size)
        assert result is not None
        return result

    def window(self, num_micro_batches: Optional[int] = None, *, num_items: Optional[Count] = None,
               micro_batch_size: Optional[Any] = None, pad: bool = False) -> Window:
        """Open a window for a hand-written loop (see :class:`Window`).

        Args:
            num_micro_batches: this rank's micro-batches in the window (0 on a rank whose data
                ran out). Ranks agree on the counts when it opens.
            num_items: this rank's items in the window, if known before the first backward.
            pad: this loop runs ``window.padding`` zero-weight micro-batches when the ranks' counts
                call for it (DDP: a rank with none runs one; FSDP2: every rank as many as the most).
                Without it such a window is refused on every rank alike.
        """
        self._check_idle()
        return Window(self, num_micro_batches, num_items=num_items, micro_batch_size=micro_batch_size,
                      can_pad=pad)

    def set_padding(self, micro_batch: Batch) -> None:
        """A micro-batch this rank may run with zero weight in a window where it has none.

        Under DDP and FSDP2 every rank must run a forward in each window (they run collectives in
        forward: DDP's buffer broadcast and bucket rebuild, FSDP2's all-gathers). ``step()`` and
        ``train()`` repeat the last micro-batch a rank ran; a rank that has none yet (a fresh
        process resumed at a window where its share is empty) needs this one. Its loss must depend
        on the model as a real micro-batch's does; it adds nothing to the gradient or the counts.
        """
        leading_dim(micro_batch, argument="micro_batch")
        self._replay = micro_batch

    def train(self, loader: Iterable[Batch], loss_fn: LossFn, *, accum_steps: Optional[AccumSteps] = None,
              epochs: int = 1, drop_last: bool = False, num_items: Optional[CountFn] = None) -> Iterator[StepResult]:
        """Group the loader's micro-batches into windows and step once per window, for ``epochs`` epochs
        from where training stands (call it once per epoch, or once for all).

        Windows come from the loader's :class:`~gradaccum.WindowSampler` (``batch_sampler=``), which
        knows where each global window ends and where training stands, or from ``accum_steps``
        consecutive micro-batches: an int, ``{epoch: N}`` or ``epoch -> N``, epochs counted by
        ``acc.epoch`` (saved in ``state_dict``; an epoch left unfinished starts again). At the end of
        each epoch a shorter window is stepped, normalized by its own item count, unless
        ``drop_last=True``. A sampler with ``set_epoch`` is told each epoch. Under data parallelism
        every rank steps as often as the rank with the most windows (with ``drop_last``, the fewest);
        a rank whose data ran out contributes no items.
        """
        from .training import train_windows

        self._check_idle()
        _check_loss_fn(loss_fn)
        return train_windows(self, loader, loss_fn, accum_steps=accum_steps, epochs=epochs,
                             drop_last=drop_last, num_items=num_items)

    # -- one attempt at a window -----------------------------------------------------------

    def _count(self, micro_batches: List[Batch], count_fn: Optional[CountFn]) -> Tuple[List[Count], float]:
        """Each micro-batch's item count before any forward pass, and their sum: what a bare mean
        loss is weighted by (the leading dimension, or the ``num_items`` counter). Every
        micro-batch's leading dimensions are checked here, before anything runs."""
        counts: List[Count] = [leading_dim(mb, argument=f"window[{i}]") for i, mb in enumerate(micro_batches)]
        if count_fn is not None:
            counts = [_check_count("num_items(micro_batch)", count_fn(mb)) for mb in micro_batches]
        return counts, float(sum(_as_number(c) for c in counts))

    def _attempt(self, micro_batches: List[Batch], loss_fn: LossFn, count_fn: Optional[CountFn], *,
                 micro_batch_size: Any, catch_oom: bool = False, plan: Optional[WindowPlan] = None,
                 counts: Optional[List[Count]] = None) -> Optional[StepResult]:
        """Forward/backward every micro-batch (and the padding FSDP2 needs), then step. With
        ``catch_oom``, an out-of-memory error drops the window and returns None, after every rank
        has agreed on it."""
        if counts is None:
            counts, total = self._count(micro_batches, count_fn)
        else:
            total = sum(_as_number(c) for c in counts)
        defer = catch_oom and self.sync.distributed  # no collective before the ranks agree
        # DDP runs collectives in a window's first forward (its buffer broadcast, its one bucket
        # rebuild): under "auto", every rank first runs that forward on one item with zero weight,
        # so that an out-of-memory error before a rank's forward cannot leave its peers waiting there
        flush = [split_batch(micro_batches[0], 1)[0]] if defer and isinstance(self.sync, DDPSync) and micro_batches else []
        with Window(self, len(flush) + len(micro_batches), num_items=total, micro_batch_size=micro_batch_size,
                    defer_reduction=defer, can_pad=bool(micro_batches) or self._replay is not None,
                    plan=plan) as window:
            window.padding += len(flush)
            oom = False
            try:
                for mb in flush:
                    with window.micro_batch():
                        window.backward_padding(_unpack_loss(loss_fn(self.model, mb), 0)[0])
                for mb, count in zip(micro_batches, counts):
                    with window.micro_batch():
                        window.backward(*_unpack_loss(loss_fn(self.model, mb), count))
            except Exception as error:  # noqa: BLE001 - re-raised unless it is an OOM we handle
                if not (catch_oom and is_out_of_memory(error)):
                    raise
                oom = True
            if self.sync.distributed and micro_batches:
                self._replay = micro_batches[-1]  # to pad a later window where this rank has none
            if not oom:
                for _ in range(window.padding - len(flush)):
                    with window.micro_batch():
                        window.backward_padding(_unpack_loss(loss_fn(self.model, self._replay), 0)[0])
            if defer:
                flag = torch.tensor([1.0 if oom else 0.0], device=self.device)
                oom = bool(self.sync.all_reduce_(flag, "max").item())
            if oom:
                window.abandon()
                return None
            return window.step()

    def _step_auto(self, batch: Batch, loss_fn: LossFn, count_fn: Optional[CountFn]) -> StepResult:
        """micro_batch_size="auto": start from the whole batch or the last size that worked, halve
        on out-of-memory. A failed attempt's partial gradients are dropped, so the step equals one
        made with the final size from the start."""
        if self.sync.distributed and not self.sync.can_reduce_later:
            raise ValueError(
                f"micro_batch_size='auto' is not supported with {type(self.sync).__name__}: its "
                "gradients reduce only inside backward, so ranks cannot agree on an out-of-memory "
                "error first. Pass an int micro_batch_size (found once, e.g. with DDP)"
            )
        n = leading_dim(batch)
        if n == 0 and not self.sync.distributed:
            raise ValueError("batch has 0 items along dim 0; there is nothing to step on")
        size = min(self.auto_micro_batch_size or n, n) if n else 2 ** 62  # an empty share follows the others
        if self.sync.distributed:  # every rank starts from the same size
            size = int(self.sync.all_reduce_(torch.tensor([size], device=self.device), "min").item())
        backed_off = False
        while True:
            micro_batches = split_batch(batch, size) if n else []
            result = self._attempt(micro_batches, loss_fn, count_fn, micro_batch_size=size, catch_oom=True)
            if result is not None:
                # a short window (fewer items than the size that works) must not shrink the memory
                if n and (backed_off or self.auto_micro_batch_size is None):
                    self.auto_micro_batch_size = size
                return result
            backed_off = True
            _free_memory(self.device)
            if size == 1:
                raise torch.OutOfMemoryError(
                    "micro_batch_size='auto' ran out of memory with micro-batches of 1 item; "
                    "the model does not fit: reduce its size, use precision='bf16', or shard it"
                )
            size = max(1, size // 2)

    # -- window life cycle -----------------------------------------------------------------

    def _check_idle(self) -> None:
        if self._window is not None:
            raise RuntimeError(
                "a window is already open on this Accumulator: finish it with window.step() before "
                "calling step(), train() or window() again (a nested window would drop the open "
                "window's gradients)"
            )

    def _agree(self, num_micro_batches: int, num_items: Optional[Count], can_pad: bool) -> WindowPlan:
        """Every rank's micro-batch count and up-front item count, from one small all-gather."""
        if not self.sync.distributed:
            items = None if num_items is None else _as_number(num_items)
            return WindowPlan(num_micro_batches, num_micro_batches, num_micro_batches, items)
        known = num_items is not None
        mine = torch.tensor([float(num_micro_batches), 0.0 if num_items is None else _as_number(num_items),
                             1.0 if known else 0.0, 1.0 if can_pad else 0.0],
                            dtype=torch.float64 if self.device.type != "mps" else torch.float32,
                            device=self.device)
        rows = self.sync.all_gather(mine).tolist()  # the agreement's one host synchronisation
        counts = [int(r[0]) for r in rows]
        plan = WindowPlan(num_micro_batches, max(counts), min(counts),
                          sum(r[1] for r in rows) if all(r[2] for r in rows) else None)
        stuck = [r for r, row in enumerate(rows)
                 if _padded_count(int(row[0]), plan.most, self.sync.needs_equal_counts) > row[0] and not row[3]]
        if stuck:  # every rank sees the same rows: every rank raises, none waits in a collective
            raise ValueError(
                f"{type(self.sync).__name__} needs every rank to run "
                f"{'as many micro-batches as the busiest' if self.sync.needs_equal_counts else 'a forward'} in "
                f"each window (collectives run in forward), but rank(s) {stuck} run fewer "
                f"({', '.join(str(int(rows[r][0])) for r in stuck)} of up to {plan.most}) and cannot pad: in "
                "a hand-written loop open the window with acc.window(n, pad=True) and run window.padding "
                "zero-weight micro-batches (window.backward_padding); with step()/train(), a rank with no "
                "data yet needs acc.set_padding(micro_batch)"
            )
        return plan

    def _reference_items(self, items: Count) -> float:
        """R for windows whose count is not known up front, fixed at its first use (one host sync
        and, across ranks, one max all-reduce, once)."""
        if self.reference_items is None:
            ref = max(_as_number(items), 1.0)
            if self.sync.distributed:
                ref = float(self.sync.all_reduce_(torch.tensor([ref], device=self.device), "max").item())
            self.reference_items = ref
        return self.reference_items

    def _begin_window(self, window: Window) -> None:
        self._check_idle()  # before anything changes: a nested window would clear the open one
        if "batchnorm" not in self._warned and self.model.training:
            self._warned.add("batchnorm")
            names = [n for n, m in self.model.named_modules() if isinstance(m, _BATCHNORM) and m.training]
            if names:
                warnings.warn(
                    f"the model holds BatchNorm layers in training mode ({', '.join(names[:3])}"
                    f"{', ...' if len(names) > 3 else ''}): their statistics are per micro-batch, so "
                    "accumulation is not equivalent to one big batch. Check with "
                    "gradaccum.check_equivalence, or use GroupNorm/LayerNorm.",
                    stacklevel=5,
                )
        self._window = window
        self._clear_grads()  # stale gradients would leak into the window
        if self.buffers is not None:
            self.buffers.active = True

    def _end_window(self, window: Window) -> None:
        if self._window is window:
            self._window = None
        if self.buffers is not None:
            self.buffers.active = False

    def _grads(self) -> List[torch.Tensor]:
        if self.buffers is not None:
            return self.buffers.tensors()
        return [p.grad for p in self.params if p.grad is not None]

    def _materialized_grads(self) -> List[torch.Tensor]:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]  # type: ignore[misc]

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None
        if self.buffers is not None:
            self.buffers.clear()

    # -- the boundary ----------------------------------------------------------------------

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)

    def _finish_window(self, window: Window) -> StepResult:
        if self.buffers is not None:
            self.buffers.active = False
        self.precision.unscale_(self.optimizer)
        grads = self._grads()
        measure = self.max_grad_norm is not None or self.compute_grad_norm or self.precision.scaler is not None
        if self.sync.distributed or window._device_items is not None:
            totals = self.sync.all_reduce_(window.totals())  # one small all-reduce per window
            parts = [totals.to(torch.float64)]
        else:  # the count is a host number already: only the loss sum crosses to the host
            parts = [window.loss_sum().reshape(1)]
        if measure:
            parts.append(_total_norm(grads, self.device).reshape(1).to(device=parts[0].device, dtype=parts[0].dtype))
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # the window's one host sync
        loss_sum = host[0]
        num_items = host[1] if len(host) == (3 if measure else 2) else window._host_items
        lr = float(self.optimizer.param_groups[0]["lr"])
        ref = window.reference_items or 1.0
        upfront = window.plan.items if window.plan is not None else None
        if upfront and num_items > 0:  # the same global numbers on every rank: the same ratio
            self.count_ratio = num_items / upfront
        scale = ref / num_items if num_items > 0 else 0.0
        grad_norm: Optional[float] = host[-1] * scale if measure else None
        finite = math.isfinite(loss_sum) and (grad_norm is None or math.isfinite(grad_norm))
        skipped = True
        try:
            if num_items <= 0 or not finite:
                if not finite and self.nonfinite == "raise" and self.precision.scaler is None:
                    raise FloatingPointError(
                        f"the window's {'gradient' if math.isfinite(loss_sum) else 'loss'} is not finite "
                        f"(loss sum {loss_sum}, gradient norm {grad_norm}); no step was taken and the "
                        "gradients were cleared. Lower the learning rate, use max_grad_norm, or pass "
                        "nonfinite='skip' to skip such windows"
                    )
                if num_items <= 0 and window.done > 0:
                    self._warn_once("no_items", "a window counted 0 items (e.g. every label is the "
                                    "ignore_index): it has no loss to step on, so it was skipped; its "
                                    "StepResult.loss is nan")
                self.precision.skip(self.optimizer)
            else:
                coef = scale
                if self.max_grad_norm is not None:
                    assert grad_norm is not None  # measured whenever clipping
                    coef *= min(1.0, self.max_grad_norm / (grad_norm + 1e-6))  # as clip_grad_norm_
                if grads and coef != 1.0:
                    torch._foreach_mul_(grads, coef)
                if self.buffers is not None:
                    self.buffers.write_grads_()
                self.precision.step(self.optimizer)
                self.steps += 1  # counted before the scheduler, which may raise after the step
                skipped = False
                if self.scheduler is not None:
                    self.scheduler.step()
        finally:
            self._clear_grads()
        size = window.micro_batch_size
        return StepResult(
            loss=loss_sum / num_items if num_items > 0 else math.nan,
            num_items=int(num_items) if float(num_items).is_integer() else num_items,
            micro_batches=window.done - window.padding,
            grad_norm=grad_norm,
            skipped=skipped,
            lr=lr,
            step=self.steps,
            micro_batch_size=size if isinstance(size, int) else None,
            accum_steps=window.done - window.padding,
        )

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """What resuming needs beyond the model and optimizer: step count, scaler, auto size."""
        return {"steps": self.steps, "auto_micro_batch_size": self.auto_micro_batch_size,
                "reference_items": self.reference_items, "count_ratio": self.count_ratio, "epoch": self.epoch,
                "precision": self.precision.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        missing = [k for k in ("steps", "precision") if k not in state]
        if missing:
            raise KeyError(f"Accumulator.load_state_dict: the state lacks {', '.join(map(repr, missing))}; "
                           "pass what Accumulator.state_dict() returned")
        self.precision.load_state_dict(state["precision"])
        self.steps = int(state["steps"])
        self.auto_micro_batch_size = state.get("auto_micro_batch_size")
        self.reference_items = state.get("reference_items")
        self.count_ratio = float(state.get("count_ratio", 1.0))
        self.epoch = int(state.get("epoch", 0))


def _padded_count(count: int, most: int, equal_counts: bool) -> int:
    """How many micro-batches a rank runs when the busiest runs ``most``: as many under syncs with a
    collective in every micro-batch, else at least one (DDP's forward collectives)."""
    if equal_counts:
        return most
    return max(count, 1) if most > 0 else 0


def _check_loss_fn(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, micro_batch), got {loss_fn!r}")


def _check_optimizer_covers(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], model: nn.Module) -> None:
    """An optimizer over none of the model's trainable parameters would 'step' and move nothing."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in held for p in params):
        raise ValueError(
            f"the optimizer holds none of the {type(model).__name__}'s {len(params)} trainable "
            "parameters, so its steps would never move the model: build it over this model's "
            "parameters, e.g. torch.optim.AdamW(model.parameters()) after wrapping/sharding the model"
        )


def _check_no_foreign_scaler(optimizer: torch.optim.Optimizer) -> None:
    """Accelerate's prepared optimizer under ``mixed_precision="fp16"`` carries a GradScaler and runs
    ``scaler.step()`` in its own ``step()``: it would unscale gradients gradaccum never scaled."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None and callable(getattr(scaler, "is_enabled", None)) and scaler.is_enabled():
        raise ValueError(
            f"the optimizer ({type(optimizer).__name__}) carries its own enabled GradScaler, so its step() "
            "would unscale gradients gradaccum never scaled (Accelerate's prepared optimizer under "
            "mixed_precision='fp16'). Prepare with Accelerator(mixed_precision='no') and pass "
            "precision='fp16' to Accumulator, which owns the scaler"
        )


def _total_norm(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The gradient's total 2-norm: one fused pass for plain tensors on one device (the common
    case, without get_total_norm's per-call grouping); DTensors and mixed devices take the general path."""
    if not grads:
        return torch.zeros((), device=device)
    if hasattr(torch, "_foreach_norm") and all(type(g) is torch.Tensor and g.device == device for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    norm = torch.nn.utils.get_total_norm(grads, 2.0) if hasattr(torch.nn.utils, "get_total_norm") \
        else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return full_tensor(norm)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
