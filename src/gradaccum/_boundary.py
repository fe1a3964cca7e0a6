"""The boundary of a window: from the accumulated gradient to one optimizer step.

The formulas (the backward weight, R, the boundary scale, the clip coefficient, the verdict) are in
:mod:`gradaccum._maths`; this module runs them in order. The gradient itself is reduced across ranks
before the boundary, by DDP or FSDP2 inside the last micro-batch's backward (:mod:`gradaccum.sync`
skips the reduction in the others). The window's all-reduce of ``(sum n_k L_k, N)`` and its flags
(:class:`~gradaccum._exchange.Exchange`) is launched before that last backward when it can be, so it
overlaps it. At the boundary, in this order: unscale (fp16, once); on the first window under DDP, a
check that the replicas' gradients agree (:func:`check_replicas`); the exchanged numbers read on the
host (the window's one host synchronisation; under FSDP2 with a measured norm the all-reduce starts
here and also sums the shards' squared norms); the total norm of the normalized gradient (with
clipping, fp16 or ``compute_grad_norm``); the **verdict** (step, skip or raise, from the loss and that
norm); the **clip coefficient** folded into the boundary scale, so clipping costs no extra pass; the
optimizer step; the scheduler step (only on steps taken); gradients cleared.

**Windows that exchange nothing.** Under DDP the reduced gradient is the same on every rank, so a
verdict read from it alone is the same on every rank too. When every rank also knows the window's
global N up front (a WindowSampler's shares) and ``loss_fn`` counts those items, the all-reduce above
only tells the ranks each other's loss (and carries stop requests). ``Accumulator(loss_every=k)`` does
it on every k-th window only (:meth:`Boundary.exchanges`); the windows between cost no collective
besides DDP's own reduction. Their verdict reads the gradient's norm (measured always there), and a
rank's non-finite loss still reaches every rank, through the gradient: its reducing backward adds
``nan`` times one element of a parameter (:func:`gradaccum._maths.loss_check_term`), so the reduced
gradient, and every rank's verdict, are not finite. ``StepResult.loss`` is None there.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional

import torch

from ._gradients import WindowGradients
from ._maths import Verdict, boundary_scale, clip_coefficient, verdict
from .precision import MixedPrecision
from .sync import GradSync, full_tensor

__all__ = ["Counters", "WindowTotals", "Exchanged", "Outcome", "Boundary", "InFlight"]

# -- the procedure ------------------------------------------------------------------------------------

@dataclass
class Counters:
    """Where training stands: optimizer steps taken, windows skipped, epochs finished by ``train()``."""

    steps: int = 0
    skipped: int = 0
    epoch: int = 0


@dataclass(frozen=True)
class WindowTotals:
    """What one rank's window hands the boundary.

    Attributes:
        loss_sum: ``sum n_k L_k`` of this rank's micro-batches, on the device.
        host_items: the sum of the counts given as Python numbers.
        device_items: the sum of the counts given as tensors, on the device (None if none was).
        reference: R, the count the backward weights were divided by.
        ran: whether this rank ran any micro-batch, padding included (for the empty-window warning).
        can_pad: whether this rank can pad its next window (has run a micro-batch to repeat).
        known_items: the window's global N, when every rank knew it up front and the window
            exchanges nothing (see :meth:`Boundary.exchanges`); else None.
        counts_from_loss_fn: ``loss_fn`` returned its own count for some micro-batch (a
            ``(mean, count)`` pair) rather than weighing a bare mean by the count known up front.
    """

    loss_sum: torch.Tensor
    host_items: float
    device_items: Optional[torch.Tensor]
    reference: float
    ran: bool
    can_pad: bool = True
    known_items: Optional[float] = None
    counts_from_loss_fn: bool = False


@dataclass(frozen=True)
class Outcome:
    """What the boundary did: the window's global loss sum (None when not exchanged) and item count,
    the norm, the verdict, and what the ranks told each other on the way (every rank can pad, None
    when not exchanged; any rank asked to stop)."""

    loss_sum: Optional[float]
    num_items: float
    grad_norm: Optional[float]
    skipped: bool
    lr: float
    step: int
    peers_can_pad: Optional[bool] = False
    stop_requested: bool = False


class Exchanged(NamedTuple):
    """What a boundary's all-reduce told every rank (on one process: the rank itself)."""

    loss_sum: float
    num_items: float
    raw_norm: Optional[float]  # the reduced gradient's norm before the boundary scale, when measured
    peers_can_pad: bool  # every rank has a micro-batch to pad a later window with
    stop: bool  # some rank asked to stop
    counts_from_loss_fn: bool  # some rank's loss_fn returned its own counts


class Boundary:
    """Runs a window's boundary (the module docstring's order) and counts the steps it takes."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, *, precision: MixedPrecision,
                 sync: GradSync, grads: WindowGradients, max_grad_norm: Optional[float],
                 compute_grad_norm: bool, nonfinite: str, device: torch.device, loss_every: int = 1) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler
        self.precision, self.sync, self.grads = precision, sync, grads
        self.max_grad_norm, self.nonfinite, self.device = max_grad_norm, nonfinite, device
        self.measure = max_grad_norm is not None or compute_grad_norm or precision.scaler is not None
        #: whether the all-reduce may start before the last backward (:meth:`launch`): not when it
        #: carries the squared norm of a sharded (FSDP2) gradient, which exists only after that backward
        self.launch_before_last_backward = not (self.measure and sync.sharded_grads)
        self.counters = Counters()
        self.steps_on_loss = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        #: counted by ``Accumulator.request_stop`` (maybe from a signal handler); each new request is
        #: carried to every rank by the next boundary's all-reduce
        self.stop_requests = 0
        self._stops_carried = 0
        #: whether the first reduced gradient is still to be compared across ranks (see check_replicas)
        self.verify_replicas = sync.replicated_grads
        self.loss_every = loss_every
        #: windows this Boundary finished, the same on every rank (all run every window); not
        #: ``counters``, which a checkpoint may restore on one rank alone and a user may set
        self.windows = 0
        #: some rank's loss_fn returned its own counts in the last exchanged window (the same on every rank)
        self.loss_fn_counts = False
        self._warned: set = set()

    def exchanges(self, known_items: Optional[float], count_ratio: float) -> bool:
        """Whether a window's boundary all-reduces its totals across ranks (always, on one process:
        there it costs nothing). Every input is the same on every rank, so every rank decides alike.
        A window may skip it when the reduced gradient is the same on every rank (DDP), every rank
        knows the global N up front (``known_items``: a WindowSampler's shares), in the last exchanged
        window every rank's ``loss_fn`` returned bare means weighed by those very counts (no own
        counts, ``count_ratio`` 1), no ReduceLROnPlateau needs the loss, DDP's reduction is its plain
        average (:meth:`gradaccum.sync.GradSync.plain_reduction`: no ``find_unused_parameters``, no
        comm hook, which could keep or lose the loss check, :func:`loss_check_term`) and reduces a
        trainable parameter to carry that check (``grads.probe``: one the wrapper covers that had a
        gradient in the window whose replicas were compared, so never before that window), and the
        window is not a ``loss_every``-th one, counted by :attr:`windows` (not by the steps, which a
        checkpoint loaded on one rank alone would set apart)."""
        probe = self.grads.probe
        if not (self.sync.distributed and self.sync.replicated_grads) or probe is None or not probe.requires_grad \
                or known_items is None or count_ratio != 1.0 or self.loss_fn_counts \
                or not self.sync.plain_reduction():
            return True
        return self.steps_on_loss or self.windows % self.loss_every == 0

    def finish(self, totals: WindowTotals, in_flight: Optional["InFlight"] = None, exchange: bool = True) -> Outcome:
        """Reduce, unscale, measure, decide, clip, step; the window's gradients are cleared after.
        ``in_flight`` is the all-reduce :meth:`launch` started, if the window started it; without
        ``exchange`` the ranks exchange nothing (see :meth:`exchanges`)."""
        self.windows += 1
        self.grads.close()
        self.precision.unscale_(self.optimizer)
        grads = self.grads.tensors()
        if self.verify_replicas:
            self.verify_replicas = False
            try:
                check_replicas(grads, self.sync, self.device)
            except BaseException:
                self.grads.clear()
                raise
            self.grads.choose_probe()  # among the gradients the ranks just found equal
        loss_sum: Optional[float]
        peers_can_pad: Optional[bool]
        if exchange:
            told = self._host_numbers(totals, grads, in_flight)
            loss_sum, num_items, raw_norm = told.loss_sum, told.num_items, told.raw_norm
            peers_can_pad, stop, self.loss_fn_counts = told.peers_can_pad, told.stop, told.counts_from_loss_fn
        else:
            assert totals.known_items is not None, "a window exchanges nothing only when N is known"
            loss_sum, num_items, peers_can_pad, stop = None, totals.known_items, None, False
            raw_norm = float(total_norm(grads, self.device).item())  # the window's one host sync
        lr = float(self.optimizer.param_groups[0]["lr"])
        scale = boundary_scale(totals.reference, num_items)
        grad_norm = raw_norm * scale if raw_norm is not None else None
        decision = verdict(loss_sum, num_items, grad_norm, nonfinite=self.nonfinite,
                           has_scaler=self.precision.scaler is not None)
        try:
            if decision is Verdict.STEP:
                self._step(grads, scale * clip_coefficient(grad_norm, self.max_grad_norm),
                           None if loss_sum is None else loss_sum / num_items)
            else:
                self._skip(decision, loss_sum, grad_norm, totals.ran)
        finally:
            self.grads.clear()
        return Outcome(loss_sum, num_items, grad_norm, decision is not Verdict.STEP, lr, self.counters.steps,
                       peers_can_pad, stop)

    def launch(self, totals: WindowTotals) -> "InFlight":
        """Start the window's one all-reduce of ``(sum n_k L_k, N, can-pad, stop)`` across ranks
        without waiting: called after the last micro-batch's forward and before its backward, so it
        overlaps that backward and DDP's bucket all-reduce instead of adding a round trip after them.
        Every rank launches it at the same point of the same window, so collectives stay in order."""
        tensor = self._totals_tensor(totals)
        return InFlight(tensor, self.sync.all_reduce_async(tensor))

    def _totals_tensor(self, totals: WindowTotals) -> torch.Tensor:
        requests = self.stop_requests  # read once: a request made after this waits for the next window
        stop, self._stops_carried = requests > self._stops_carried, requests
        items = totals.loss_sum.new_tensor(totals.host_items)
        if totals.device_items is not None:
            items = items + totals.device_items
        flags = totals.loss_sum.new_tensor([1.0 if totals.can_pad else 0.0, 1.0 if stop else 0.0,
                                            1.0 if totals.counts_from_loss_fn else 0.0])
        return torch.cat([torch.stack([totals.loss_sum, items]), flags])

    def _host_numbers(self, totals: WindowTotals, grads: List[torch.Tensor], in_flight: Optional["InFlight"]) -> Exchanged:
        """The window's global numbers on the host, from one small all-reduce (across ranks, or when
        a count is a tensor; launched early when the window could, see :meth:`launch`) and the
        window's one host synchronisation. Across ranks the all-reduce also sums the flags, so the
        next window needs no agreement and a stop reaches every rank at the same window; under FSDP2
        it also sums the shards' squared norms."""
        square = None  # this rank's part of the squared norm, summed in the all-reduce (FSDP2)
        if in_flight is not None:
            parts = [in_flight.wait().to(torch.float64)]
        elif self.sync.distributed or totals.device_items is not None:
            tensor = self._totals_tensor(totals)
            square = self.sync.local_square_sum(grads) if self.measure else None
            if square is not None:
                tensor = torch.cat([tensor, square.to(tensor).reshape(1)])
            parts = [self.sync.all_reduce_(tensor).to(torch.float64)]
        else:  # the count is a host number already: only the loss sum crosses to the host
            parts = [totals.loss_sum.reshape(1)]
        if self.measure and square is None:
            parts.append(total_norm(grads, self.device).reshape(1).to(device=parts[0].device, dtype=parts[0].dtype))
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # the window's one host sync
        raw_norm = None
        if self.measure:  # the last number: the norm, or the ranks' summed squared shard norms
            raw_norm = math.sqrt(host.pop()) if square is not None else host.pop()
        if len(host) == 1:
            requests = self.stop_requests  # one process: a request is its own answer
            stop, self._stops_carried = requests > self._stops_carried, requests
            return Exchanged(host[0], totals.host_items, raw_norm, True, stop, totals.counts_from_loss_fn)
        return Exchanged(host[0], host[1], raw_norm, host[2] >= self.sync.world_size, host[3] > 0, host[4] > 0)

    def _step(self, grads: List[torch.Tensor], coef: float, loss: Optional[float]) -> None:
        if grads and coef != 1.0:
            torch._foreach_mul_(grads, coef)
        self.grads.write_back()
        self.precision.step(self.optimizer)
        self.counters.steps += 1  # counted before the scheduler, which may raise after the step
        if self.scheduler is not None:
            if self.steps_on_loss:
                self.scheduler.step(loss)  # ReduceLROnPlateau: the window's loss is the metric
            else:
                self.scheduler.step()

    def _skip(self, decision: Verdict, loss_sum: Optional[float], grad_norm: Optional[float], ran: bool) -> None:
        if decision is Verdict.RAISE:
            raise FloatingPointError(
                f"the window's {_what(loss_sum)} is not finite "
                f"(loss sum {'not exchanged' if loss_sum is None else loss_sum}, gradient norm {grad_norm}); "
                "no step was taken and the gradients were cleared. Lower the learning rate, use "
                "max_grad_norm, or pass nonfinite='skip' to skip such windows"
            )
        self.counters.skipped += 1
        if decision is Verdict.SKIP_EMPTY and ran:
            self._warn_once("no_items", "a window counted 0 items (e.g. every label is the ignore_index): it has "
                            "no loss to step on, so it was skipped; its StepResult.loss is nan")
        elif decision is Verdict.SKIP_NONFINITE and self.precision.scaler is None:
            self._warn_once("nonfinite", f"a window's {_what(loss_sum)} was not "
                            "finite, so it was skipped (no step; StepResult.skipped is True, acc.skipped counts "
                            "them). Lower the learning rate, use max_grad_norm, or pass nonfinite='raise' to stop")
        self.precision.skip()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=6)


def _what(loss_sum: Optional[float]) -> str:
    if loss_sum is None:  # a window that exchanged nothing: the gradient carries every rank's loss check
        return ("gradient (or, on some rank, the loss, or loss_fn counted other items than the window's "
                "known share)")
    return "gradient" if math.isfinite(loss_sum) else "loss"


class InFlight:
    """The window's all-reduce, launched before the last backward; ``wait()`` gives the summed tensor."""

    def __init__(self, tensor: torch.Tensor, work: Any) -> None:
        self.tensor, self.work = tensor, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.tensor


def check_replicas(grads: List[torch.Tensor], sync: GradSync, device: torch.device) -> None:
    """After the first window's reduction, the ranks' gradients must be equal: compare a fingerprint
    (the sum of the per-parameter norms, and a position-weighted sum) across ranks, once.

    A ``loss_fn`` that runs the inner module (``ddp.module``, or Lightning's ``self.net`` under
    manual optimization) bypasses DDP's forward, which is where DDP prepares its reduction: the
    backward then reduces nothing, each rank steps on its own gradient, and the replicas drift apart
    without a word. Every rank sees every fingerprint, so every rank raises alike. The cost: one
    pass over the gradient, one all-gather of two numbers and one host synchronisation, once.
    """
    if grads:
        norms = torch.stack(torch._foreach_norm(grads)).to(torch.float64)
        weights = torch.arange(1, len(grads) + 1, dtype=torch.float64, device=norms.device)
        mine = torch.stack([norms.sum(), (norms * weights).sum()])
    else:
        mine = torch.zeros(2, dtype=torch.float64, device=device)
    rows = sync.all_gather(mine.to(device)).tolist()
    first = rows[0]
    if any(abs(a - b) > 1e-6 * max(abs(a), abs(b), 1e-30) for row in rows[1:] for a, b in zip(first, row)):
        raise RuntimeError(
            "the ranks' gradients differ after the window's reduction (gradient fingerprints per rank: "
            f"{[round(r[0], 8) for r in rows]}), so DistributedDataParallel never reduced them: each rank "
            "would step on its own gradient and the replicas would drift apart. loss_fn must run the model "
            "it is given (the DDP-wrapped one), not the module inside it (ddp.module, or self.net inside a "
            "LightningModule); in Lightning use gradaccum.integrations.lightning.ExactAccumulation, which "
            "keeps Lightning's own DDP forward. No step was taken"
        )


def total_norm(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The gradient's total 2-norm: one fused pass for plain tensors on one device (the common case,
    without get_total_norm's per-call grouping); DTensors and mixed devices take the general path."""
    if not grads:
        return torch.zeros((), device=device)
    if hasattr(torch, "_foreach_norm") and all(type(g) is torch.Tensor and g.device == device for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    norm = torch.nn.utils.get_total_norm(grads, 2.0) if hasattr(torch.nn.utils, "get_total_norm") \
        else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return full_tensor(norm)
