"""``Accumulator``: a window of micro-batches -> weighted backward -> one reduction -> one optimizer step.

The facade: it checks its arguments before anything moves, builds the parts, and hands each call to
the part that owns it. What one window teaches the next lives in one object, ``acc.state``
(:class:`~gradaccum._state.AccumulatorState`); ``state_dict()`` is derived from it. One window, in
the order it runs::

    acc.step / acc.train           -> _run.run_window: the micro-batches through loss_fn (step, train,
                                      the out-of-memory back-off); a WindowLoss -> _cached.run_cached_window,
                                      an exact MoELoss -> moe.run_moe_window
    acc.window                     -> a Window the user's own loop drives; both go through:
         -> RankAgreement.open     once, as the window opens: its plan (known, made alone, or asked
                                   of the ranks: one all-gather), then window_setup: R, whether its
                                   boundary exchanges, its padding                    (_ranks.py)
         -> per micro-batch        forward and backward of  n_k * W / R * L_k  (_maths.backward_weight),
                                   the reduction skipped before the last (sync.py); the Tally adds
                                   n_k * L_k and n_k                                  (_exchange.py)
         -> before the last backward: the boundary's all-reduce of the ExchangeRow starts, and
                                   DDP/FSDP2 reduce the gradient inside that backward
         -> Boundary.finish        unscale, replicas compared (first window), the exchanged numbers
                                   on the host (the one host sync), norm, verdict, clip,
                                   optimizer step, scheduler step                     (_boundary.py)
         -> RankAgreement.learn    what the next window needs to know, kept in acc.state
                                   (R, the count ratio, can-pad, counts from loss_fn)
      -> StepResult

The formulas (why each micro-batch backpropagates ``n_k * W / R`` times its mean loss, and why the
boundary multiplies by ``R / N``) are in :mod:`gradaccum._maths`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from ._autosize import AutoMicroBatch
from ._boundary import Boundary
from ._checks import Count, callable_loss_fn, positive_int, positive_number
from ._gradients import AccumulationBuffers, WindowGradients
from ._ranks import RankAgreement, Rules, WindowRequest
from ._state import AccumulatorState
from ._training import TrainSpec, train_windows
from ._cached import WindowLoss, check_window_loss
from .moe import MoELoss, check_moe_loss
from ._run import CountFn, LossFn, count_items, run_auto, run_window
from ._window import OpenWindow, Window, WindowContext
from .batching import Batch, MicroBatchSize, as_micro_batches, check_micro_batch_size
from .precision import MixedPrecision
from .result import StepResult
from .schedule import AccumSteps
from .sync import GradSync, sync_for
from ._deepspeed import check_engine_arguments, deepspeed_engine
from .errors import ConfigurationError, NotExactError

__all__ = ["Accumulator", "LowPrecisionWarning"]

_NONFINITE = ("skip", "raise")
#: ``accum_dtype=`` names besides a dtype: float32 buffers for low-precision parameters, or none
ACCUM_DTYPES = ("auto", "param")
#: parameter dtypes whose window gradient ``accum_dtype="auto"`` sums in float32
LOW_PRECISION = (torch.bfloat16, torch.float16)


class LowPrecisionWarning(UserWarning):
    """The window's gradient is summed in bf16/fp16 where gradaccum cannot sum it in float32 (under a
    data-parallel wrapper that owns the sum, or a loss scaler that unscales ``.grad`` before the
    boundary): the warning names the setting that would."""


def warn_low_precision_grad_sum(who: str, params: Any, fix: str) -> None:
    """Said once, loudly, through :func:`driver_buffers` (``stacklevel``: the driver's caller), where a
    driver's framework sums the window's gradient into each parameter's own ``.grad`` and gradaccum
    cannot sum it in float32 (a data-parallel wrapper owns the sum, or a loss scaler unscales ``.grad``
    before the driver's boundary): with bf16/fp16 trainable parameters
    that sum rounds after every micro-batch, so its error grows with the window (a bf16 GPT-2 over 64
    micro-batches: about twice the float32 sum's, docs/guides/deepspeed.md's precision table). ``fix``
    names the framework's setting that sums in float32."""
    low = sorted({str(p.dtype) for p in params if p.requires_grad and p.dtype in LOW_PRECISION})
    if low:
        warnings.warn(f"{who}: the trainable parameters are {', '.join(low)}, so each window's gradient is summed in "
                      "their own .grad and rounds after every micro-batch (its error grows with the window: about "
                      f"2x a float32 sum's over 64 micro-batches). {fix}", LowPrecisionWarning, stacklevel=4)


def driver_buffers(who: str, params: Any, accum_dtype: str, *, owns_the_sum: bool,
                   fix: str) -> Optional[AccumulationBuffers]:
    """The float32 :class:`~gradaccum._gradients.AccumulationBuffers` a trainer driver (ExactTrainer,
    Lightning's ExactAccumulation) opens with each window and writes back, rounded once to the
    parameter's dtype, after the window's last backward and before the framework clips and steps.

    ``accum_dtype="auto"``: buffers for the bf16/fp16 trainable parameters where the driver owns the
    window's sum (``owns_the_sum``: one process, no data-parallel wrapper, no scaler unscaling ``.grad``
    before the boundary); elsewhere the sum stays in ``.grad`` and :func:`warn_low_precision_grad_sum`
    says so with ``fix``. ``"param"``: the opt-out, the sum in the parameters' own dtype (rounded after
    every micro-batch), silently. None (no buffers, no hooks) where no trainable parameter is bf16/fp16.

    Raises:
        ConfigurationError: ``accum_dtype`` is neither ``"auto"`` nor ``"param"``.
    """
    if accum_dtype not in ACCUM_DTYPES:
        raise ConfigurationError(f"{who}(accum_dtype={accum_dtype!r}): accum_dtype must be 'auto' (float32 buffers for "
                                 "bf16/fp16 parameters, rounded once per window) or 'param' (the sum in the "
                                 "parameters' own .grad, rounded after every micro-batch)")
    low = [p for p in params if p.requires_grad and p.dtype in LOW_PRECISION]
    if not low or accum_dtype == "param":
        return None
    if not owns_the_sum:
        warn_low_precision_grad_sum(who, low, fix)
        return None
    return AccumulationBuffers(low, torch.float32)


#: a learning-rate scheduler: anything with ``step()`` over the Accumulator's optimizer
Scheduler = Any


class Accumulator:
    """Gradient accumulation that equals one optimizer step on the whole window.

    Args:
        model: the module: plain, ``DistributedDataParallel``, FSDP2 ``fully_shard``-ed, or anything
            holding one of them (``torch.compile(ddp_model)``, Accelerate's prepared model); or a
            ``deepspeed.initialize`` engine (ZeRO 1-3) with ``"managed_gradient_accumulation": false``,
            which owns the reduction, the optimizer, clipping and its scheduler (:mod:`gradaccum._deepspeed`).
        optimizer: any ``torch.optim.Optimizer`` over (some of) the model's trainable parameters
            (None, or the optimizer ``deepspeed.initialize`` returned, around a DeepSpeed engine).
        scheduler: stepped once per optimizer step taken, never on a skipped window. A
            ``ReduceLROnPlateau`` is stepped with the window's loss.
        max_grad_norm: clip the window's gradient to this total 2-norm, after normalization and
            unscaling.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        accum_dtype: where bf16/fp16 parameters' window gradient is summed. ``"auto"`` (the default):
            in float32 buffers, one rounding of the window's gradient to the parameter's dtype for the
            optimizer (single process; under DDP, FSDP2 or DeepSpeed the wrapper owns the sum, and a
            setting that sums in bf16 there is named once in a warning). A dtype such as
            ``torch.float64``: buffers of that dtype. ``"param"`` (or None) opts out: the sum is kept in
            the parameter's own ``.grad``, rounded to 8 bits of mantissa (bf16) after every
            micro-batch, so its error grows with the micro-batches (bf16 GPT-2, K = 64: about 2x the
            floor; ``make bench``'s precision section) for 2 bytes per parameter less (float32
            buffers hold 4 bytes per low-precision parameter while a window is open, the bf16 ``.grad``'s 2 bytes
            more: measured in docs/guides/deepspeed.md's precision section).
        nonfinite: ``"skip"`` a window whose loss or measured gradient is not finite (with a warning
            the first time; ``acc.skipped`` counts them), or ``"raise"``.
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
        loss_every: under DDP, the ranks exchange the window's loss (``StepResult.loss``) and stop
            requests every ``loss_every`` windows. A window in between of ``train()`` over a
            :class:`~gradaccum.WindowSampler` (every rank knows every share) costs no collective
            besides DDP's own reduction: its ``StepResult.loss`` is None, and its non-finite check reads
            the reduced gradient's norm (one pass), where every rank's loss check arrives too (see
            :mod:`gradaccum._boundary`). 1 (the default): every window exchanges.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> acc.step((torch.randn(10, 3), torch.randn(10, 1)), mse, micro_batch_size=4).micro_batches
        3
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        scheduler: Scheduler = None,
        max_grad_norm: Optional[float] = None,
        precision: str = "fp32",
        accum_dtype: Union[None, str, torch.dtype] = "auto",
        nonfinite: str = "skip",
        reduce_every_micro_batch: bool = False,
        data_parallel: str = "auto",
        compute_grad_norm: bool = False,
        loss_every: int = 1,
    ) -> None:
        engine = deepspeed_engine(model)
        if engine is not None:  # the engine steps its own optimizer: see gradaccum._deepspeed
            optimizer = check_engine_arguments(engine, optimizer, scheduler=scheduler, max_grad_norm=max_grad_norm,
                                               precision=precision, accum_dtype=accum_dtype)
        params = _check_arguments(model, optimizer, scheduler, max_grad_norm, nonfinite, accum_dtype,
                                  engine_owned=engine is not None)
        positive_int("loss_every", loss_every)
        device = params[0].device
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.precision = MixedPrecision(precision, device)
        self.sync: GradSync = sync_for(model, reduce_every_micro_batch=reduce_every_micro_batch,
                                       data_parallel=data_parallel)
        self.buffers = _buffers(accum_dtype, self.sync, precision, params)
        #: what one window teaches the next (see :class:`~gradaccum._state.AccumulatorState`)
        self.state = state = AccumulatorState()
        grads = WindowGradients(params, self.buffers, reduced=self.sync.reduced_parameters())
        boundary = Boundary(optimizer, scheduler, state=state, precision=self.precision, sync=self.sync, grads=grads,
                            max_grad_norm=self.max_grad_norm, compute_grad_norm=bool(compute_grad_norm),
                            nonfinite=nonfinite, device=device)
        rules = Rules(self.sync.shares_windows, self.sync.needs_equal_counts, self.sync.plain_reduction,
                      loss_every=loss_every, steps_on_loss=boundary.steps_on_loss,
                      reference_is_count=self.sync.needs_known_items)
        self.auto = AutoMicroBatch(self.sync, device, state)
        self.context = WindowContext(model=model, device=device, sync=self.sync, precision=self.precision,
                                     grads=grads, ranks=RankAgreement(self.sync, device, state, rules),
                                     boundary=boundary, slot=OpenWindow(model, state), state=state)

    # -- where training stands: read from acc.state (saved in state_dict) ----------------------

    @property
    def steps(self) -> int:
        """Optimizer steps taken (``acc.state.steps``)."""
        return self.state.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.state.steps = int(value)

    @property
    def skipped(self) -> int:
        """Windows that took no step (non-finite loss or gradient, fp16 overflow, no item)."""
        return self.state.skipped

    @property
    def epoch(self) -> int:
        """Epochs ``train()`` finished (the next one it runs, without a WindowSampler)."""
        return self.state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.state.epoch = int(value)

    @property
    def auto_micro_batch_size(self) -> Optional[int]:
        """The micro-batch size that last worked under ``micro_batch_size="auto"``."""
        return self.state.auto_micro_batch_size

    @auto_micro_batch_size.setter
    def auto_micro_batch_size(self, value: Optional[int]) -> None:
        self.state.auto_micro_batch_size = value

    @property
    def reference_items(self) -> Optional[float]:
        """Deprecated: ``acc.state.reference``."""
        warnings.warn("Accumulator.reference_items is deprecated: read acc.state.reference", DeprecationWarning,
                      stacklevel=2)
        return self.state.reference

    @property
    def count_ratio(self) -> float:
        """Deprecated: ``acc.state.count_ratio``."""
        warnings.warn("Accumulator.count_ratio is deprecated: read acc.state.count_ratio", DeprecationWarning,
                      stacklevel=2)
        return self.state.count_ratio

    # -- the three ways in ----------------------------------------------------------------------

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
                weighs exactly ``n_k / N``.
        """
        self.context.slot.check_idle()
        check_micro_batch_size(micro_batch_size)
        _check_loss(loss_fn, num_items, micro_batch_size)
        _check_engine_loss(self.sync, loss_fn)
        if micro_batch_size == "auto":
            return run_auto(self.context, self.auto, window, loss_fn, num_items)
        micro_batches = as_micro_batches(window, micro_batch_size,  # type: ignore[arg-type]
                                         allow_empty=self.sync.allows_empty_share)
        result = run_window(self.context, micro_batches, loss_fn, count_items(micro_batches, num_items),
                            micro_batch_size=micro_batch_size)
        assert result is not None
        return result

    def window(self, num_micro_batches: Optional[int] = None, *, num_items: Optional[Count] = None,
               micro_batch_size: Optional[Any] = None, pad: bool = False) -> Window:
        """Open a window for a hand-written loop (see :class:`~gradaccum.Window`).

        Args:
            num_micro_batches: this rank's micro-batches in the window (0 on a rank whose data
                ran out). Ranks agree on the counts when it opens.
            num_items: this rank's items in the window, if known before the first backward: R = N, no
                rescale (across ranks summed as the window opens; give it on every rank or on none).
            micro_batch_size: recorded in the window's ``StepResult.micro_batch_size`` (an int), for logs;
                the loop itself decides how it splits its data.
            pad: this loop runs ``window.padding`` zero-weight micro-batches when the ranks' counts
                call for it (DDP: a rank with none runs one; FSDP2: every rank as many as the most).
                Without it such a window is refused on every rank alike.
        """
        self.context.slot.check_idle()
        return Window(self.context, WindowRequest(num_micro_batches, num_items, can_pad=pad),
                      micro_batch_size=micro_batch_size)

    def train(self, loader: Iterable[Batch], loss_fn: LossFn, *, accum_steps: Optional[AccumSteps] = None,
              epochs: int = 1, drop_last: bool = False, num_items: Optional[CountFn] = None,
              micro_batch_size: Optional[str] = None) -> Iterator[StepResult]:
        """Group the loader's micro-batches into windows and step once per window, for ``epochs`` epochs
        from where training stands (call it once per epoch, or once for all).

        Windows come from the loader's :class:`~gradaccum.WindowSampler` (``batch_sampler=``), which
        knows where each global window ends and where training stands, or from ``accum_steps``
        consecutive micro-batches: an int, ``{epoch: N}`` or ``epoch -> N``, epochs counted by
        ``acc.epoch`` (saved in ``state_dict``; an epoch left unfinished starts again). At the end of
        each epoch a shorter window is stepped, normalized by its own item count, unless
        ``drop_last=True``. A sampler with ``set_epoch`` is told each epoch. Under data parallelism
        every rank steps as often as the rank with the most windows (with ``drop_last``, the fewest);
        a rank whose data ran out contributes no items. ``micro_batch_size="auto"`` joins each
        window's micro-batches into one batch and splits it as ``step(..., micro_batch_size="auto")``
        does, halving on out-of-memory.
        """
        self.context.slot.check_idle()
        _check_loss(loss_fn, num_items, micro_batch_size)
        _check_engine_loss(self.sync, loss_fn)
        if micro_batch_size not in (None, "auto"):
            raise ConfigurationError(f"train(micro_batch_size=...) takes 'auto' or None, got {micro_batch_size!r}: the "
                             "loader's batches are the micro-batches; use 'auto' to re-split each window on "
                             "out-of-memory errors")
        if micro_batch_size == "auto":
            self.auto.check_supported()
        spec = TrainSpec(loss_fn, accum_steps, epochs, drop_last, num_items,
                         self.auto if micro_batch_size == "auto" else None)
        return train_windows(self.context, loader, spec)

    def request_stop(self) -> None:
        """Ask every rank to stop: the next window's ``StepResult.stop_requested`` is True on every
        rank (the flag rides in the boundary's all-reduce, so asking costs no collective of its own).
        Safe to call from a signal handler."""
        self.state.stop_requests += 1

    def set_padding(self, micro_batch: Batch) -> None:
        """A micro-batch this rank may run with zero weight in a window where it has none.

        Under DDP and FSDP2 every rank must run a forward in each window (they run collectives in
        forward: DDP's buffer broadcast and bucket rebuild, FSDP2's all-gathers). ``step()`` and
        ``train()`` repeat the last micro-batch a rank ran; a rank that has none yet (a fresh
        process resumed at a window where its share is empty) needs this one. Its loss must depend
        on the model as a real micro-batch's does; it adds nothing to the gradient or the counts.
        """
        self.context.ranks.set_padding(micro_batch)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """What resuming needs beyond the model and optimizer: the saved fields of ``acc.state``
        (counters, R, the count ratio, the auto size; :data:`gradaccum._state.SAVED_KEYS`) and the scaler."""
        return {**self.state.saved(), "precision": self.precision.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (also one written by an earlier gradaccum)."""
        if not isinstance(state, dict):
            raise TypeError(f"Accumulator.load_state_dict takes the dict Accumulator.state_dict() returned, got "
                            f"{type(state).__name__}; pass checkpoint['accumulator'] (or what you saved it as)")
        missing = [k for k in ("steps", "precision") if k not in state]
        if missing:
            raise KeyError(f"Accumulator.load_state_dict: the state lacks {', '.join(map(repr, missing))}; "
                           "pass what Accumulator.state_dict() returned")
        values = self.state.read_saved(state)  # every field checked before anything is set
        self.precision.load_state_dict(state["precision"])
        self.state.load_saved(values)


# -- construction checks: every one before anything is built ------------------------------------------

def _check_arguments(model: Any, optimizer: Any, scheduler: Any, max_grad_norm: Any, nonfinite: Any,
                     accum_dtype: Any, *, engine_owned: bool = False) -> list:
    """The model's trainable parameters, after every argument is checked (``engine_owned``: a DeepSpeed
    engine's optimizer, checked by :func:`gradaccum._deepspeed.check_engine_arguments`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not engine_owned and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_scheduler(scheduler, optimizer)
    if max_grad_norm is not None:
        positive_number("max_grad_norm", max_grad_norm, what="a positive finite number or None")
    if nonfinite not in _NONFINITE:
        raise ConfigurationError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    if accum_dtype is not None and accum_dtype not in ACCUM_DTYPES and not isinstance(accum_dtype, torch.dtype):
        raise TypeError(f"accum_dtype must be 'auto' (float32 buffers for bf16/fp16 parameters), 'param' (the "
                        f"parameter's own dtype) or a torch.dtype such as torch.float32, got {accum_dtype!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigurationError("model has no parameter that requires grad; there is nothing to accumulate")
    if not engine_owned:
        _check_optimizer_covers(optimizer, params, model)
        _check_no_foreign_scaler(optimizer)
    return params


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """A scheduler steps once per window; it must change the learning rate of *this* optimizer."""
    if scheduler is None:
        return
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
    own = getattr(scheduler, "optimizer", None)
    if own is None:
        return
    ours: Any = optimizer
    seen: List[Any] = []
    while ours is not None and len(seen) < 4:  # Accelerate's AcceleratedOptimizer holds the raw one
        seen.append(ours)
        ours = getattr(ours, "optimizer", None)
    if not any(own is o for o in seen):
        raise ConfigurationError(
            f"the scheduler ({type(scheduler).__name__}) is over another optimizer than the Accumulator's "
            f"({type(optimizer).__name__}), so its learning-rate changes would never reach the model: build "
            "it over the same optimizer, e.g. LinearLR(optimizer, ...) with the optimizer you pass to Accumulator"
        )


def _check_loss(loss_fn: Any, num_items: Any, micro_batch_size: Any) -> None:
    if isinstance(loss_fn, WindowLoss):
        check_window_loss(num_items, micro_batch_size)
        return
    if isinstance(loss_fn, MoELoss):
        check_moe_loss(loss_fn, num_items, micro_batch_size)
        return
    callable_loss_fn(loss_fn)
    _check_count_fn(num_items)


def _check_engine_loss(sync: GradSync, loss_fn: Any) -> None:
    """A WindowLoss's cached passes and an exact MoELoss's counting pass run forwards and backwards of
    their own (the unwrapped module, ``torch.autograd.backward``) that a DeepSpeed engine would not see."""
    from .moe import MoELoss

    two_pass = isinstance(loss_fn, WindowLoss) or (isinstance(loss_fn, MoELoss) and loss_fn.mode == "exact")
    if sync.owns_step and two_pass:
        raise NotExactError(
            f"{type(loss_fn).__name__} around a DeepSpeed engine is not supported yet: its extra passes bypass "
            "engine.backward (and ZeRO-3's gathered forward). Train it under DDP or FSDP2"
            + ("" if isinstance(loss_fn, WindowLoss) else ", or use MoELoss(mode='micro_batch')"))


def _check_count_fn(num_items: Any) -> None:
    if num_items is not None and not callable(num_items):
        raise TypeError(f"num_items must be a function micro_batch -> count, got {type(num_items).__name__}; "
                        "pass counts of a hand-written loop to window.backward(loss, num_items=...)")


def _check_optimizer_covers(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], model: nn.Module) -> None:
    """An optimizer over none of the model's trainable parameters would 'step' and move nothing."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in held for p in params):
        raise ConfigurationError(
            f"the optimizer holds none of the {type(model).__name__}'s {len(params)} trainable "
            "parameters, so its steps would never move the model: build it over this model's "
            "parameters, e.g. torch.optim.AdamW(model.parameters()) after wrapping/sharding the model"
        )


def _check_no_foreign_scaler(optimizer: torch.optim.Optimizer) -> None:
    """Accelerate's prepared optimizer under ``mixed_precision="fp16"`` carries a GradScaler and runs
    ``scaler.step()`` in its own ``step()``: it would unscale gradients gradaccum never scaled."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None and callable(getattr(scaler, "is_enabled", None)) and scaler.is_enabled():
        raise ConfigurationError(
            f"the optimizer ({type(optimizer).__name__}) carries its own enabled GradScaler, so its step() "
            "would unscale gradients gradaccum never scaled (Accelerate's prepared optimizer under "
            "mixed_precision='fp16'). Prepare with Accelerator(mixed_precision='no') and pass "
            "precision='fp16' to Accumulator, which owns the scaler"
        )


def _buffers(accum_dtype: Union[None, str, torch.dtype], sync: GradSync, precision: str,
             params: Sequence[torch.nn.Parameter]) -> Optional[AccumulationBuffers]:
    """The window's float buffers, or None where the sum stays in ``.grad`` (see ``accum_dtype``)."""
    if accum_dtype is None or accum_dtype == "param":
        return None
    if accum_dtype == "auto":
        cost = None
        if sync.reduces_across_ranks:  # the wrapper owns the sum: it is summed in float32 or named here
            cost = sync.low_precision_sum(params)
        elif not any(p.dtype in LOW_PRECISION for p in params):
            return None
        elif precision == "fp16":
            cost = ("precision='fp16' with bf16/fp16 parameters: GradScaler unscales float32 gradients only, so "
                    "the window's gradient is summed in the parameters' own dtype")
        if sync.reduces_across_ranks or precision == "fp16":
            if cost is not None:
                warnings.warn(f"{cost}. That sum rounds after every micro-batch, so its error grows with the "
                              "window (bf16 GPT-2, 64 micro-batches: about 2x the error of a float32 sum). "
                              "Pass accum_dtype='param' to accept it without this warning", LowPrecisionWarning,
                              stacklevel=4)
            return None
        accum_dtype = torch.float32
    if sync.reduces_across_ranks:
        raise ConfigurationError(
            f"accum_dtype is for single-process training (got accum_dtype={accum_dtype}); with DDP or FSDP2 keep "
            "float32 master parameters (FSDP2: MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32)) and leave accum_dtype='auto'"
        )
    if precision == "fp16":
        raise ConfigurationError(
            f"accum_dtype with precision='fp16' is not supported (accum_dtype={accum_dtype}): GradScaler unscales "
            "float32 gradients only. Use precision='bf16', keep float32 parameters, or pass accum_dtype='param'"
        )
    return AccumulationBuffers(params, accum_dtype)  # type: ignore[arg-type]
