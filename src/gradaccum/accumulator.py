"""Accumulator: a window of micro-batches -> scaled backward -> one reduction -> one optimizer step.

The maths. A window holds micro-batches k = 1..K (on every rank r) with n_k items and mean loss L_k.
One step on the whole window is a step on its item-weighted mean loss::

    L = sum_k n_k L_k / N,        grad L = sum_k n_k grad L_k / N,        N = sum_{r,k} n_k

so each micro-batch backpropagates its item sum, as ``(n_k / R) * L_k`` (gradients add up in
``.grad``), and at the boundary the summed gradient is multiplied once by ``R * W / N`` (W = the
ranks the data-parallel reduction averaged over, 1 locally). R is a constant reference count, the
first micro-batch's size, agreed across ranks once: it keeps the backward at the magnitude of a
mean loss, which fp16's loss scale needs, and cancels exactly. Dividing each micro-batch by K instead is exact
only when every n_k is equal, which uneven micro-batches, padded sequences and a short last window
are not.

At the boundary, in this order: one all-reduce of ``(loss sum, N)``; unscale (fp16); the total
norm, measured on the normalized gradient; a non-finite check (skip or raise); clipping to
``max_grad_norm``; the optimizer step; the scheduler step; gradients cleared. The only host
synchronisation is one ``.tolist()`` per window, for the result.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .batching import Batch, MicroBatchSize, as_micro_batches, check_micro_batch_size, leading_dim, split_batch
from .buffers import AccumulationBuffers
from .precision import MixedPrecision
from .result import StepResult
from .sync import GradSync, full_tensor, sync_for

LossFn = Callable[[nn.Module, Batch], Union[torch.Tensor, Tuple[torch.Tensor, Union[int, torch.Tensor]]]]
AccumSteps = Union[int, Mapping[int, int], Callable[[int], int]]

__all__ = ["Accumulator", "Window", "AccumSchedule", "is_out_of_memory"]

_NONFINITE = ("skip", "raise")
_BATCHNORM = (nn.modules.batchnorm._BatchNorm,)


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA's ``torch.OutOfMemoryError`` and the CPU allocator's "can't allocate memory"."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class AccumSchedule:
    """The accumulation factor per epoch: an int, ``{first_epoch: N}`` or a callable ``epoch -> N``.

    With a mapping, N holds from its epoch until the next key; epochs before the first key use 1
    (as Lightning's ``GradientAccumulationScheduler``).
    """

    def __init__(self, accum_steps: AccumSteps) -> None:
        self._fn: Callable[[int], int]
        if isinstance(accum_steps, Mapping):
            if not accum_steps:
                raise ValueError("accum_steps mapping is empty; give at least {0: N}")
            for epoch, n in accum_steps.items():
                if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                    raise ValueError(f"accum_steps keys must be epochs (ints >= 0), got {epoch!r}")
                _check_positive_int(f"accum_steps[{epoch}]", n)
            points = sorted(accum_steps.items())
            self._fn = lambda e: next((n for start, n in reversed(points) if e >= start), 1)
        elif callable(accum_steps):
            self._fn = accum_steps
        else:
            _check_positive_int("accum_steps", accum_steps)
            self._fn = lambda e: accum_steps  # type: ignore[return-value]

    def __call__(self, epoch: int) -> int:
        return _check_positive_int(f"accum_steps for epoch {epoch}", self._fn(epoch))


def _unpack_loss(out: Any, micro_batch: Batch) -> Tuple[torch.Tensor, Union[int, torch.Tensor]]:
    """``loss_fn`` output -> (mean loss, item count); a bare loss counts the leading dimension."""
    if isinstance(out, (tuple, list)) and len(out) == 2:
        loss, n = out
    elif isinstance(out, torch.Tensor):
        loss, n = out, leading_dim(micro_batch, argument="micro_batch")
    else:
        raise TypeError(
            f"loss_fn must return a scalar tensor (the mean loss over the micro-batch) or a pair "
            f"(mean_loss, num_items), got {type(out).__name__}"
        )
    return loss, n


class Window:
    """One open window: N micro-batches, each a forward and backward, then one ``step()``.

    This is the lower-level path for people who keep their own loop; ``Accumulator.step`` is built
    on it. Every micro-batch runs inside ``micro_batch()`` (which skips the gradient reduction
    before the last one and autocasts) and hands ``backward`` its *mean* loss and item count::

        with acc.window(len(micro_batches)) as window:
            for mb in micro_batches:
                with window.micro_batch():
                    loss = criterion(model(mb[0]), mb[1])
                    window.backward(loss, num_items=len(mb[0]))
            result = window.step()

    Leaving the block by an exception, or without ``step()``, drops the window's gradients.
    """

    def __init__(self, acc: "Accumulator", num_micro_batches: Optional[int], *,
                 micro_batch_size: Optional[Any] = None, defer_reduction: bool = False) -> None:
        if num_micro_batches is not None:
            _check_positive_int("num_micro_batches", num_micro_batches)
        self._acc = acc
        self.size = num_micro_batches
        self.micro_batch_size = micro_batch_size
        self.done = 0
        self._open = False
        self._in_micro_batch = False
        self._result: Optional[StepResult] = None
        self._abandoned = False
        self._defer = defer_reduction
        dtype = torch.float32 if acc.device.type == "mps" else torch.float64
        self._loss_sum = torch.zeros((), dtype=dtype, device=acc.device)  # sum n_k L_k, on the device
        self._host_items = 0.0  # sum of the counts given as Python numbers
        self._device_items: Optional[torch.Tensor] = None  # sum of the counts given as tensors

    def __enter__(self) -> "Window":
        self._acc._begin_window()
        self._open = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._open = False
        if self._result is None:
            self._acc._clear_grads()
            if exc_type is None and not self._abandoned:
                raise RuntimeError(
                    "the window was closed without step(); call window.step() inside the "
                    "`with acc.window(...)` block to take its optimizer step"
                )

    @contextlib.contextmanager
    def micro_batch(self, *, last: Optional[bool] = None) -> Iterator[None]:
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
        acc = self._acc
        self._in_micro_batch = True
        try:
            with acc.sync.micro_batch(last=bool(last) and not self._defer), acc.precision.autocast():
                yield
        finally:
            self._in_micro_batch = False

    def backward(self, loss: torch.Tensor, num_items: Union[int, torch.Tensor]) -> None:
        """Backpropagate ``num_items * loss`` (the micro-batch's item sum); remember both for the step.

        Args:
            loss: the **mean** loss over the micro-batch's items, a scalar tensor.
            num_items: how many items that mean is over (an int, or a tensor left on the device).
        """
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
        if isinstance(num_items, (int, float)) and not isinstance(num_items, bool) and num_items < 0:
            raise ValueError(f"num_items must be >= 0, got {num_items}")
        acc = self._acc
        ref = acc._reference_items(num_items)
        weight: Union[float, torch.Tensor]
        if isinstance(num_items, torch.Tensor):
            # in the loss's precision: an int64 count / float would round the weight to float32
            weight = num_items.to(torch.promote_types(loss.dtype, torch.float32)) / ref
        else:
            weight = num_items / ref  # a Python float: no device tensor per micro-batch
        with torch.autocast(device_type=acc.device.type, enabled=False):
            acc.precision.scale(loss * weight).backward()
        detached = loss.detach().to(self._loss_sum.dtype)
        if isinstance(num_items, torch.Tensor):
            count = num_items.to(self._loss_sum.dtype)
            self._loss_sum.add_(detached * count)
            self._device_items = count if self._device_items is None else self._device_items + count
        else:
            self._loss_sum.add_(detached, alpha=num_items)
            self._host_items += num_items
        self.done += 1

    def totals(self) -> torch.Tensor:
        """``(sum n_k L_k, sum n_k)`` of this rank's micro-batches, on the device."""
        items = self._loss_sum.new_tensor(self._host_items)
        if self._device_items is not None:
            items = items + self._device_items
        return torch.stack([self._loss_sum, items])

    def abandon(self) -> None:
        """Drop this window's gradients and take no step (e.g. after an out-of-memory error)."""
        self._abandoned = True
        self._acc._clear_grads()

    def step(self) -> StepResult:
        """Reduce counts, normalize, unscale, clip, take (or skip) the one optimizer step."""
        if self._result is not None:
            raise RuntimeError("step() was already called for this window; open a new one")
        if self.done == 0:
            raise RuntimeError("step() on a window with no micro-batch; run at least one backward first")
        if self.size is not None and self.done != self.size:
            raise RuntimeError(
                f"the window was opened for {self.size} micro-batches but {self.done} ran; under "
                "data parallelism the last one is the one that reduces gradients, so the counts must match"
            )
        self._result = self._acc._finish_window(self)
        return self._result


class Accumulator:
    """Gradient accumulation that equals one optimizer step on the whole window.

    Args:
        model: the module (plain, ``DistributedDataParallel``, or FSDP2 ``fully_shard``-ed).
        optimizer: any ``torch.optim.Optimizer``.
        scheduler: stepped once per optimizer step taken, never on a skipped window.
        max_grad_norm: clip the window's gradient to this total 2-norm, after normalization and
            unscaling.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        accum_dtype: e.g. ``torch.float32``: accumulate low-precision parameters' gradients in
            buffers of this dtype, rounded once for the optimizer.
        nonfinite: ``"skip"`` a window whose gradient is not finite, or ``"raise"``.
        reduce_every_micro_batch: reduce (all-reduce / reduce-scatter) after every micro-batch
            instead of once per window; saves FSDP2 the unsharded gradient memory. Every rank must
            then run the same number of micro-batches per window (as under FSDP2 anyway, whose
            forward all-gathers); with the default, DDP ranks may run different numbers.

    Example:
        >>> model = nn.Linear(3, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = Accumulator(model, opt)
        >>> loss_fn = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])
        >>> batch = (torch.randn(10, 3), torch.randn(10, 1))
        >>> acc.step(batch, loss_fn, micro_batch_size=4).num_items
        10
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
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.nonfinite = nonfinite
        self.params = params
        self.device = params[0].device
        self.precision = MixedPrecision(precision, self.device)
        self.sync: GradSync = sync_for(model, reduce_every_micro_batch=reduce_every_micro_batch)
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
        #: R, the constant reference item count of the backward weights (see the module docstring)
        self.reference_items: Optional[float] = None
        self._warned_batchnorm = False

    # -- the high-level path ---------------------------------------------------------------

    def step(self, window: Union[Batch, Sequence[Batch]], loss_fn: LossFn, *,
             micro_batch_size: MicroBatchSize = None) -> StepResult:
        """Run the window's micro-batches and take exactly one optimizer step (or skip it).

        Args:
            window: a sequence of micro-batches, or one batch when ``micro_batch_size`` is given.
            loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss, or ``(mean_loss, num_items)``.
            micro_batch_size: split the batch along dim 0 into chunks of this size (the last may
                be smaller); ``"auto"`` starts from the whole batch (or the last size that worked)
                and halves on out-of-memory errors.
        """
        check_micro_batch_size(micro_batch_size)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, micro_batch), got {loss_fn!r}")
        if micro_batch_size == "auto":
            return self._step_auto(window, loss_fn)
        micro_batches = as_micro_batches(window, micro_batch_size)  # type: ignore[arg-type]
        self._reference_items(leading_dim(micro_batches[0]))
        result = self._attempt(micro_batches, loss_fn, micro_batch_size=micro_batch_size)
        assert result is not None
        return result

    def window(self, num_micro_batches: Optional[int] = None, *,
               micro_batch_size: Optional[Any] = None) -> Window:
        """Open a window for a hand-written loop (see :class:`Window`)."""
        return Window(self, num_micro_batches, micro_batch_size=micro_batch_size)

    def train(self, loader: Iterable[Batch], loss_fn: LossFn, *, accum_steps: AccumSteps,
              epochs: int = 1, drop_last: bool = False) -> Iterator[StepResult]:
        """Group consecutive items of ``loader`` (each one micro-batch) into windows of ``accum_steps``.

        At the end of each epoch a shorter window is stepped, normalized by its own item count,
        unless ``drop_last=True``. ``accum_steps`` may be an int, ``{epoch: N}`` or ``epoch -> N``.
        A sampler with ``set_epoch`` (``DistributedSampler``) is told each epoch.
        """
        schedule = AccumSchedule(accum_steps)
        _check_positive_int("epochs", epochs)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, micro_batch), got {loss_fn!r}")
        return self._train(loader, loss_fn, schedule, epochs, drop_last)

    def _train(self, loader: Iterable[Batch], loss_fn: LossFn, schedule: AccumSchedule,
               epochs: int, drop_last: bool) -> Iterator[StepResult]:
        for epoch in range(epochs):
            sampler = getattr(loader, "sampler", None)
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)  # type: ignore[union-attr]
            n = schedule(epoch)
            pending: List[Batch] = []
            for micro_batch in loader:
                pending.append(micro_batch)
                if len(pending) == n:
                    yield replace(self.step(pending, loss_fn), accum_steps=n, epoch=epoch)
                    pending = []
            if pending and not drop_last:
                yield replace(self.step(pending, loss_fn), accum_steps=n, epoch=epoch)

    # -- one attempt at a window -----------------------------------------------------------

    def _attempt(self, micro_batches: List[Batch], loss_fn: LossFn, *, micro_batch_size: Any,
                 catch_oom: bool = False) -> Optional[StepResult]:
        """Forward/backward every micro-batch, then step. With ``catch_oom``, an out-of-memory
        error drops the window and returns None, after every rank has agreed on it."""
        defer = catch_oom and self.sync.distributed  # no collective before the ranks agree
        with Window(self, len(micro_batches), micro_batch_size=micro_batch_size,
                    defer_reduction=defer) as window:
            oom = False
            for mb in micro_batches:
                try:
                    with window.micro_batch():
                        window.backward(*_unpack_loss(loss_fn(self.model, mb), mb))
                except Exception as error:  # noqa: BLE001 - re-raised unless it is an OOM we handle
                    if not (catch_oom and is_out_of_memory(error)):
                        raise
                    oom = True
                    break
            if defer:
                flag = torch.tensor([1.0 if oom else 0.0], device=self.device)
                oom = bool(self.sync.all_reduce_(flag, "max").item())
            if oom:
                window.abandon()
                return None
            if defer:
                self.sync.reduce_gradients_(self._materialized_grads())
            return window.step()

    def _step_auto(self, batch: Batch, loss_fn: LossFn) -> StepResult:
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
        self._reference_items(n)  # before any forward pass: its collective must not meet an OOM
        size = min(self.auto_micro_batch_size or n, n)
        if self.sync.distributed:  # every rank starts from the same size
            size = int(self.sync.all_reduce_(torch.tensor([size], device=self.device), "min").item())
        backed_off = False
        while True:
            result = self._attempt(split_batch(batch, size), loss_fn, micro_batch_size=size, catch_oom=True)
            if result is not None:
                # a short window (fewer items than the size that works) must not shrink the memory
                if backed_off or self.auto_micro_batch_size is None:
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

    # -- the boundary ----------------------------------------------------------------------

    def _reference_items(self, items: Union[int, float, torch.Tensor]) -> float:
        """R, fixed at its first use (one host sync and, across ranks, one max all-reduce, once)."""
        if self.reference_items is None:
            ref = max(float(items), 1.0)
            if self.sync.distributed:
                ref = float(self.sync.all_reduce_(torch.tensor([ref], device=self.device), "max").item())
            self.reference_items = ref
        return self.reference_items

    def _begin_window(self) -> None:
        if not self._warned_batchnorm and self.model.training:
            self._warned_batchnorm = True
            names = [n for n, m in self.model.named_modules() if isinstance(m, _BATCHNORM) and m.training]
            if names:
                warnings.warn(
                    f"the model holds BatchNorm layers in training mode ({', '.join(names[:3])}"
                    f"{', ...' if len(names) > 3 else ''}): their statistics are per micro-batch, so "
                    "accumulation is not equivalent to one big batch. Check with "
                    "gradaccum.check_equivalence, or use GroupNorm/LayerNorm.",
                    stacklevel=4,
                )
        self._clear_grads()  # stale gradients would leak into the window
        if self.buffers is not None:
            self.buffers.active = True

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
            self.buffers.active = False

    def _finish_window(self, window: Window) -> StepResult:
        if self.buffers is not None:
            self.buffers.active = False
        totals = self.sync.all_reduce_(window.totals())  # one small all-reduce per window
        self.precision.unscale_(self.optimizer)
        grads = self._grads()
        raw_norm = _total_norm(grads, self.device)
        loss_sum, num_items, raw_norm_f = torch.cat(
            [totals.to(torch.float64), raw_norm.reshape(1).to(device=totals.device, dtype=torch.float64)]
        ).tolist()  # the window's one host synchronisation
        lr = float(self.optimizer.param_groups[0]["lr"])
        ref = self.reference_items or 1.0
        scale = ref * self.sync.grad_divisor / num_items if num_items > 0 else 0.0
        grad_norm: Optional[float] = raw_norm_f * scale
        finite = grad_norm is not None and math.isfinite(grad_norm)
        if num_items <= 0 or not finite:
            if not finite and self.nonfinite == "raise" and self.precision.scaler is None:
                self._clear_grads()
                raise FloatingPointError(
                    f"the window's gradient is not finite (norm {grad_norm}); no step was taken and "
                    "the gradients were cleared. Lower the learning rate, use max_grad_norm, or pass "
                    "nonfinite='skip' to skip such windows"
                )
            self.precision.skip(self.optimizer)
            skipped = True
            if not finite:
                grad_norm = None
        else:
            coef = scale
            if self.max_grad_norm is not None:
                coef *= min(1.0, self.max_grad_norm / (grad_norm + 1e-6))  # as clip_grad_norm_
            if grads:
                torch._foreach_mul_(grads, coef)
            if self.buffers is not None:
                self.buffers.write_grads_()
            self.precision.step(self.optimizer)
            if self.scheduler is not None:
                self.scheduler.step()
            self.steps += 1
            skipped = False
        self._clear_grads()
        size = window.micro_batch_size
        return StepResult(
            loss=loss_sum / num_items if num_items > 0 else 0.0,
            num_items=int(round(num_items)),
            micro_batches=window.done,
            grad_norm=grad_norm,
            skipped=skipped,
            lr=lr,
            step=self.steps,
            micro_batch_size=size if isinstance(size, int) else None,
            accum_steps=window.done,
        )

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """What resuming needs beyond the model and optimizer: step count, scaler, auto size."""
        return {"steps": self.steps, "auto_micro_batch_size": self.auto_micro_batch_size,
                "reference_items": self.reference_items, "precision": self.precision.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.precision.load_state_dict(state["precision"])
        self.steps = int(state["steps"])
        self.auto_micro_batch_size = state.get("auto_micro_batch_size")
        self.reference_items = state.get("reference_items")


def _total_norm(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(grads, 2.0) if hasattr(torch.nn.utils, "get_total_norm") \
        else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return full_tensor(norm)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
