"""The boundary of a window: from the accumulated gradient to one optimizer step (:meth:`Boundary.finish`), with
the window's one all-reduce (:class:`ExchangeRow`) and its one host synchronisation. The order of its steps:
docs/architecture.md ("One micro-batch's trip", step 5)."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ._maths import count_dtype, tensor_norms
from ._state import AccumulatorState
from .errors import ConfigurationError
from .precision import MixedPrecision
from .result import StepResult
from ._deepspeed import not_known_up_front
from .sync import GradSync
from ._weights import Closing, Gradients, Verdict, WindowWeights, clip_coefficient, total_norm, window_mean

__all__ = ["Tally", "Totals", "Boundary", "InFlight", "ExchangeRow", "Exchanged", "read_on_host"]


class Totals(NamedTuple):
    """What one rank's window hands the boundary."""

    tally: List[Tuple[torch.Tensor, Any]]  #: this rank's micro-batches: ``(mean loss, count)``
    weights: WindowWeights  #: the window's weighting, which closes and records it
    ran: bool  #: this rank ran any micro-batch, padding included (for the empty-window warning)
    can_pad_next: bool = True  #: this rank has a micro-batch to pad its next window with
    #: this rank counted its items before the first backward (exchanged: every rank learns if the next counts first)
    counted_first: bool = False


class Tally:
    """One rank's window as its boundary reads it (nothing is added while it runs), summed in :func:`count_dtype`."""

    __slots__ = ("losses", "counts", "host_items", "device_items", "dtype")

    def __init__(self, entries: Sequence[Tuple[torch.Tensor, Any]], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.losses = [loss for loss, _ in entries]
        # a tensor count in the sum's dtype (float64), so that n_k L_k is not rounded (nor overflows) in the loss's
        self.counts = [count.to(dtype) if isinstance(count, torch.Tensor) else count for _, count in entries]
        numbers = [c for c in self.counts if not isinstance(c, torch.Tensor)]
        tensors = [c for c in self.counts if isinstance(c, torch.Tensor)]
        self.host_items = functools.reduce(operator.add, numbers, 0.0)  # in order: sum() compensates from Python 3.12
        self.device_items = functools.reduce(operator.add, tensors) if tensors else None

    @property
    def loss_sum(self) -> Optional[torch.Tensor]:
        """``sum n_k L_k`` on the device in float64, added in order (None before the first micro-batch)."""
        total: Optional[torch.Tensor] = None
        for loss, count in zip(self.losses, self.counts):
            if isinstance(count, torch.Tensor):
                part = loss * count
                total = part.to(self.dtype) if total is None else total.add_(part)
            elif total is None:  # the first: one op, in the sum's (float64) precision
                total = loss.to(self.dtype) * count
            else:
                total.add_(loss, alpha=count)  # promoted into the float64 sum
        return total

    def read(self, norm: Optional[torch.Tensor] = None) -> Tuple[float, Optional[float]]:
        """One process with host counts: ``sum n_k L_k`` added on the host, and ``norm``, in one copy.

        >>> t = Tally([(torch.tensor(0.5), 4), (torch.tensor(0.25), 2)], torch.float64)
        >>> t.read(), t.loss_sum.item()
        ((2.5, None), 2.5)
        """
        losses = self.losses
        stacked = (torch.stack(losses) if len(losses) > 1 else losses[0]) if losses else None
        losses_read, norm_read = read_on_host(stacked, norm)
        total = 0.0  # added in order, as host_items
        for loss, count in zip(losses_read, self.counts):
            total += loss * count  # type: ignore[operator]
        return total, norm_read


class Boundary:
    """Runs a window's boundary. In the :class:`~gradaccum._state.AccumulatorState` it changes the steps and skipped
    windows (``WindowWeights.record``), the scheduler's position, the stops carried, if the replicas were checked."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, *, state: AccumulatorState,
                 precision: MixedPrecision, sync: GradSync, grads: Gradients, max_grad_norm: Optional[float],
                 compute_grad_norm: bool, nonfinite: str, device: torch.device) -> None:
        self.optimizer, self.scheduler, self.state = optimizer, scheduler, state
        self.precision, self.sync, self.grads = precision, sync, grads
        self.max_grad_norm, self.nonfinite, self.device = max_grad_norm, nonfinite, device
        self.count_dtype = count_dtype(device)  # what counts and loss sums are added in
        # where the wrapper steps itself (DeepSpeed), it clips and measures the norm too: once, not twice
        self.measure = (max_grad_norm is not None or compute_grad_norm or precision.scaler is not None) \
            and not sync.owns_step
        #: whether the all-reduce may start before the last backward (:meth:`launch`): across ranks, and
        #: not when it carries the squared norm of a sharded (FSDP2) gradient, which exists only after
        self.launch_before_last_backward = sync.shares_windows and not (self.measure and sync.sharded_grads)
        self.steps_on_loss = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.wrapped_step = sync.owns_step or precision.scaler is not None  # else the optimizer's own step()
        #: Accelerate's prepared optimizer: its step() does nothing where this state's sync_gradients is False
        self.accelerate = getattr(optimizer, "gradient_state", None)
        self.watch_replicas()

    def watch_replicas(self) -> None:
        """Whether the next boundary compares the replicas' gradients: DDP's, and FSDP2's plain ones (a trainable
        parameter in no fully_shard module, which nothing reduces); again after a ``requires_grad`` change."""
        self.compare_replicas = self.sync.replicated_grads or self.sync.sharded_grads and any(
            p.requires_grad and not hasattr(p, "device_mesh") for p in self.grads.params)
        self.state.replicas_checked = False

    def check_scheduler(self) -> None:
        """Before a window opens: the scheduler must stand where this boundary's last step left it. Stepped elsewhere
        too (the user's own, or another Accumulator's), it would move the learning rate twice per step, in silence."""
        at, state = getattr(self.scheduler, "last_epoch", None), self.state
        if not isinstance(at, int) or isinstance(at, bool):
            return  # a scheduler without a step counter: nothing to compare
        if state.scheduler_at is None:
            state.scheduler_at = at
        elif at != state.scheduler_at:
            if state.scheduler_at_restored:
                raise ConfigurationError(
                    f"the scheduler given to the Accumulator ({type(self.scheduler).__name__}) has last_epoch={at}, "
                    f"but the Accumulator's state was saved with it at {state.scheduler_at}: resumed so, the learning "
                    "rate would follow another schedule than the run's. Save the scheduler's state_dict() with the "
                    "checkpoint and load it before training; or, to start a new schedule on purpose, load the "
                    "Accumulator's state without its 'scheduler_at' entry")
            moved = at - state.scheduler_at
            raise ConfigurationError(
                f"the scheduler given to the Accumulator ({type(self.scheduler).__name__}) was stepped outside it: "
                f"its last_epoch went from {state.scheduler_at} to {at} since the Accumulator's last optimizer "
                f"step ({moved:+d} step{'s' if abs(moved) != 1 else ''} it did not take). The Accumulator steps it "
                "once per optimizer step taken, so a scheduler.step() of your own (or another Accumulator "
                "given the same scheduler) moves the learning rate twice as fast. Remove your own "
                "scheduler.step() call, or do not pass scheduler= to the Accumulator")
        state.scheduler_at_restored = False

    def finish(self, totals: Totals, in_flight: Optional["InFlight"] = None, *, micro_batches: int = 0,
               micro_batch_size: Any = None) -> Tuple["Exchanged", StepResult]:
        """Take or skip the window's step (``in_flight``: :meth:`launch`'s all-reduce); returns what the ranks
        told each other and the window's result."""
        if self.accelerate is not None and not self.accelerate.sync_gradients:
            raise ConfigurationError(
                "the optimizer is Accelerate's and its gradient_state.sync_gradients is False (inside "
                "accelerator.accumulate(), off Accelerate's own boundary): its step() would do nothing while the "
                "window counted a step. gradaccum accumulates: leave out accelerator.accumulate() around acc.step "
                "(Accelerator(gradient_accumulation_steps=...) alone changes nothing). No step was taken")
        if self.sync.replicated_grads:
            self.sync.check_reduced()
        if self.precision.scaler is not None:
            self.precision.unscale_(self.optimizer)
        first_check = self.compare_replicas and not self.state.replicas_checked
        # the gradient's tensors, where something reads them before the step (else listed below if it scales)
        grads = self.grads.tensors() if self.measure or first_check else None
        try:  # the gradient goes whatever happens here: stepped, skipped, or refused
            if first_check:
                self.state.replicas_checked = True
                check_replicas(grads, self.sync, self.device)  # type: ignore[arg-type]
            told = self._exchanged(totals, grads, in_flight)
            loss_sum, lr = told.loss_sum, float(self.optimizer.param_groups[0]["lr"])
            closing = totals.weights.close(told.num_items, loss_sum=loss_sum, raw_norm=told.raw_norm,
                                           nonfinite=self.nonfinite, has_scaler=self.precision.scaler is not None)
            grad_norm, stepped = closing.grad_norm, False
            if closing.steps:
                if self.sync.needs_count_first and closing.scale != 1.0:
                    raise not_known_up_front(in_engine=True)  # loss_fn counted other items than those known up front
                self.grads.finalize(closing.scale * clip_coefficient(grad_norm, self.max_grad_norm), grads)
                stepped_norm = None  # the norm a stepper measured itself (DeepSpeed), not finite where it skipped
                if self.wrapped_step:
                    stepped_norm = self.sync.step(self.optimizer, self.precision)
                else:
                    self.optimizer.step()
                # counted (a step the stepper did not apply, DeepSpeed's fp16 overflow, is a skip) before the
                # scheduler, which may raise after it, and which steps on steps applied only
                stepped = stepped_norm is None or math.isfinite(stepped_norm)
                totals.weights.record(closing, applied=stepped)
                if stepped and self.scheduler is not None:
                    if self.steps_on_loss:  # ReduceLROnPlateau: the window's loss is the metric
                        self.scheduler.step(window_mean(loss_sum, told.num_items))
                    else:
                        self.scheduler.step()
                    self.state.scheduler_at = getattr(self.scheduler, "last_epoch", None)  # see check_scheduler
                grad_norm = grad_norm if stepped_norm is None else stepped_norm
            else:
                self._skip(closing, loss_sum, totals)
        finally:
            self.grads.drop()
        n = told.num_items
        return told, StepResult(loss=window_mean(loss_sum, n), lr=lr, grad_norm=grad_norm, skipped=not stepped,
                                step=self.state.steps, num_items=int(n) if float(n).is_integer() else n,
                                micro_batches=micro_batches, stop_requested=told.stop,
                                micro_batch_size=micro_batch_size if isinstance(micro_batch_size, int) else None)

    def launch(self, totals: Totals) -> "InFlight":
        """Start the window's one all-reduce before the last micro-batch's backward, which it overlaps."""
        row = self._row(totals, Tally(totals.tally, self.count_dtype))
        return InFlight(row, self.sync.all_reduce_async(row))

    def _stop_now(self) -> bool:
        """Whether a stop was requested since the last boundary (read once: a later request waits)."""
        requests = self.state.stop_requests
        stop, self.state.stops_carried = requests > self.state.stops_carried, requests
        return stop

    def _row(self, totals: Totals, tally: Tally, square_norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        total = tally.loss_sum  # zero for a rank that ran no micro-batch of its own
        total = total if total is not None else torch.zeros((), dtype=tally.dtype, device=self.device)
        items = total.new_tensor(tally.host_items)
        if tally.device_items is not None:
            items = items + tally.device_items
        flags = total.new_tensor([float(totals.can_pad_next), float(self._stop_now()), float(totals.counted_first)])
        row = torch.cat([torch.stack([total, items]), flags])
        if square_norm is not None:
            row = torch.cat([row, square_norm.to(row).reshape(1)])
        return row

    def _exchanged(self, totals: Totals, grads: Optional[List[torch.Tensor]], in_flight: Optional["InFlight"]
                   ) -> Exchanged:
        """The window's global numbers on the host, from one small all-reduce (across ranks, or for a tensor
        count) that also sums the flags and, under FSDP2, the shards' squared norms."""
        tally = None if in_flight is not None else Tally(totals.tally, self.count_dtype)  # else summed at launch
        if tally is not None and not self.sync.shares_windows and tally.device_items is None:
            # one process, counts on the host already: the losses and the norm read in the window's one host sync
            loss_sum, raw = tally.read(total_norm(grads, self.device) if self.measure else None)  # type: ignore
            return Exchanged(loss_sum, tally.host_items, raw, True, self._stop_now(), totals.counted_first)
        if tally is None:
            row, square = in_flight.wait(), None  # type: ignore[union-attr]
        else:  # with this rank's part of the squared norm, summed in the all-reduce (FSDP2)
            square = self.sync.local_square_sum(grads) if self.measure else None  # type: ignore[arg-type]
            row = self.sync.all_reduce_(self._row(totals, tally, square))
        norm = total_norm(grads, self.device) if self.measure and square is None else None  # type: ignore[arg-type]
        read, norm_read = read_on_host(row.to(torch.float64), norm)  # the window's one host sync
        told = ExchangeRow(*read)
        raw = math.sqrt(told.square_norm) if square is not None else norm_read
        return Exchanged(told.loss_sum, told.num_items, raw, told.can_pad_next >= self.sync.group_size, told.stop > 0,
                         told.counted_first >= self.sync.group_size)

    def _skip(self, closing: Closing, loss_sum: float, totals: Totals) -> None:
        decision, grad_norm = closing.verdict, closing.grad_norm
        if decision is Verdict.RAISE:
            self.precision.skip()  # the scaler's unscale_ answered (fp16), so that a next window can run
            raise FloatingPointError(
                f"the window's {_what(loss_sum)} is not finite (loss sum {loss_sum}, gradient norm {grad_norm}); no "
                "step was taken and the gradients were cleared. Lower the learning rate, use max_grad_norm, or pass "
                "nonfinite='skip' to skip such windows")
        if decision is Verdict.SKIP_NONFINITE and self.sync.owns_step:
            raise FloatingPointError(
                f"the window's {_what(loss_sum)} is not finite (loss sum {loss_sum}) and the DeepSpeed engine holds "
                "its gradient, which gradaccum cannot drop: no step was taken, and the engine's accumulated gradient "
                "must not reach the next step. Restore the last checkpoint (engine.load_checkpoint and "
                "acc.load_state_dict), and lower the learning rate or set \"gradient_clipping\" in the DeepSpeed "
                "config")
        overflow = self.precision.scaler is not None and math.isfinite(loss_sum)  # the scaler backs off: routine
        said = None if decision is not Verdict.SKIP_NONFINITE or overflow else (
            f"a window's {_what(loss_sum)} was not finite, so it was skipped (no step; StepResult.skipped is True, "
            "acc.skipped counts them). Lower the learning rate, use max_grad_norm, or pass nonfinite='raise' to stop")
        totals.weights.record(closing, warn_empty="its StepResult.loss is nan" if totals.ran else None,
                              warn_nonfinite=said, stacklevel=5)
        self.precision.skip()


def _what(loss_sum: float) -> str:
    return "gradient" if math.isfinite(loss_sum) else "loss"


class InFlight(NamedTuple):
    """An all-reduce started; ``wait()`` gives the summed tensor."""

    tensor: torch.Tensor
    work: Any

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.tensor


def check_replicas(grads: List[torch.Tensor], sync: GradSync, device: torch.device) -> None:
    """After the first window's reduction, the ranks' gradients must be equal: compare a fingerprint (the sum of the
    per-parameter norms, and a position-weighted sum) across ranks, once. A ``loss_fn`` that runs the inner module
    (``ddp.module``) bypasses DDP's forward, so nothing is reduced and the replicas drift apart in silence; under
    FSDP2 the same holds for a parameter in no ``fully_shard`` module, whose gradient is a plain tensor (a DTensor's
    shards differ by design, and are left out; a window loss's own parameter, equal on every rank by construction,
    passes). Every rank sees every fingerprint, so every rank raises alike."""
    grads = [g for g in grads if not hasattr(g, "device_mesh")]
    if grads:
        norms = tensor_norms(grads, torch.float64)
        weights = torch.arange(1, len(grads) + 1, dtype=torch.float64, device=norms.device)
        mine = torch.stack([norms.sum(), (norms * weights).sum()])
    else:
        mine = torch.zeros(2, dtype=torch.float64, device=device)
    rows = sync.all_gather(mine.to(device)).tolist()
    if any(abs(a - b) > 1e-6 * max(abs(a), abs(b), 1e-30) for row in rows[1:] for a, b in zip(rows[0], row)):
        if sync.sharded_grads:
            raise ConfigurationError(
                "the ranks' gradients of the parameters in no fully_shard module differ after the window "
                f"(fingerprints per rank: {[round(r[0], 8) for r in rows]}): nothing reduces them, so each rank would "
                "step on its own and the replicas would drift apart. Shard the root too, fully_shard(model, "
                "mesh=mesh), after its submodules. No step was taken")
        raise ConfigurationError(
            "the ranks' gradients differ after the window's reduction (gradient fingerprints per rank: "
            f"{[round(r[0], 8) for r in rows]}), so DistributedDataParallel never reduced them: each rank "
            "would step on its own gradient and the replicas would drift apart. loss_fn must run the model "
            "it is given (the DDP-wrapped one), not the module inside it (ddp.module, or self.net inside a "
            "LightningModule); in Lightning use gradaccum.integrations.lightning.ExactAccumulation, which "
            "keeps Lightning's own DDP forward. Or a parameter was unused in the window's last micro-batch (a "
            "branch some micro-batches skip), so DDP never finished its reduction: wrap with "
            "DistributedDataParallel(model, find_unused_parameters=True). No step was taken")


class ExchangeRow(NamedTuple):
    """The boundary's all-reduce, position by position: what each rank adds; after the sum, what
    every rank reads. Flags are 1.0 or 0.0 per rank, so their sums count ranks."""

    loss_sum: float            #: ``sum n_k L_k``
    num_items: float           #: N
    can_pad_next: float        #: ranks that can pad a later window (all of them: the group's size)
    stop: float                #: ranks that asked to stop since the last boundary
    counted_first: float       #: ranks that counted the window's items before its first backward
    square_norm: float = math.nan  #: FSDP2: the shards' squared gradient norms, when measured


class Exchanged(NamedTuple):
    """What a boundary's all-reduce told every rank (on one process: the rank itself)."""

    loss_sum: float
    num_items: float
    raw_norm: Optional[float]  # the reduced gradient's norm before the boundary scale, when measured
    peers_can_pad: bool  # every rank has a micro-batch to pad a later window with
    stop: bool  # some rank asked to stop
    counted_first: bool  # every rank counted the window's items before its first backward


def read_on_host(values: Optional[torch.Tensor], norm: Optional[torch.Tensor]) -> Tuple[List[float], Optional[float]]:
    """``values`` (flattened) and ``norm`` as Python numbers, in one device-to-host copy, in the wider of their
    dtypes (a bf16 loss read with a float32 norm stays float32).

    >>> read_on_host(torch.tensor([1.0, 2.0]), torch.tensor(3.0)), read_on_host(None, None)
    (([1.0, 2.0], 3.0), ([], None))
    """
    if values is None or norm is None:
        return ([] if values is None else values.reshape(-1).tolist()), None if norm is None else norm.item()
    dtype = torch.promote_types(values.dtype, norm.dtype)
    *read, n = torch.cat([values.reshape(-1).to(dtype), norm.reshape(1).to(values.device, dtype)]).tolist()
    return read, n
