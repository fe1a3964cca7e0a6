"""The maths of exact accumulation, written once as pure functions, and :class:`WindowWeights`, the window core
every driver holds (the Accumulator's :class:`~gradaccum._window.Window`, the pipeline's, ``ExactTrainer``'s and
Lightning's ``ExactAccumulation``'s hooks), so that no driver derives a weight, a scale or a verdict again.

Micro-batch k (on every rank) holds n_k items and the mean loss L_k; one step on the window is a step on
``L = sum_k n_k L_k / N`` with ``N = sum_{ranks, k} n_k``. W is the ranks the data-parallel reduction
averages over (1 locally) and R a reference count, the same on every rank::

    backward weight  = n_k * W / R                                          (backward_weight)
    reduced grad     = (1 / W) * sum_ranks sum_k n_k * W / R * grad L_k  =  sum n_k grad L_k / R
    window grad      = reduced grad * R / N  =  grad L                      (boundary_scale)

Where N is counted before the first backward and ``loss_fn`` counts the same items, R = N: the scale is 1
and each backward weighs exactly ``n_k / N``, as one big batch does. Where ``loss_fn`` counts other items (a
``(mean, count)`` pair), R is the up-front N times the last window's ratio of the two; where nothing is
counted up front, the running R (:func:`running_reference`). Either way the scale corrects it exactly.
Dividing each micro-batch by K instead is exact only when every n_k is equal, which uneven micro-batches,
padded sequences and a short last window are not. A window of N = 0 is skipped (:func:`verdict`). Which R,
when: docs/architecture.md ("The ranks' agreement and R").

:class:`WindowWeights` is the window step by step (each driver's hooks: docs/architecture.md, "One window, whoever
runs the loop"): open, weigh each micro-batch, close at the boundary (in a framework's loop: hand over the gradient,
judge the framework's norm), record what the state learns:

    >>> from gradaccum._state import AccumulatorState
    >>> state = AccumulatorState()
    >>> w = WindowWeights(state, grad_divisor=2.0, num_items=8)      # N known first: R = N
    >>> w.mean_weight(3), w.sum_weight()                              # 3 * 2 / 8, 2 / 8
    (0.75, 0.25)
    >>> w.weight_of                                                   # kept: the next micro-batch of 3 reads it
    {3: 0.75}
    >>> closing = w.close(8); closing.verdict, closing.scale
    (<Verdict.STEP: 'step'>, 1.0)
    >>> w.record(closing).steps, state.steps, state.skipped, state.last_window_items
    (True, 1, 0, 8.0)
    >>> empty = WindowWeights(state, 1.0, num_items=0)                 # known empty: weighs nothing
    >>> empty.sum_weight(), empty.record(empty.close(0)).verdict, state.skipped
    (0.0, <Verdict.SKIP_EMPTY: 'skip: no item'>, 1)
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Union

import torch

from ._checks import Count
from ._empty import may_be_empty, weighing_nothing
from ._gradients import AccumulationBuffers
from ._state import AccumulatorState
from .sync import full_tensor

__all__ = ["CLIP_EPS", "backward_weight", "boundary_scale", "running_reference", "window_mean", "clip_coefficient",
           "Verdict", "verdict", "Closing", "WindowWeights", "Gradients", "total_norm"]


#: added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does
CLIP_EPS = 1e-6


def backward_weight(num_items: Count, reference: float, grad_divisor: float,
                    loss_dtype: torch.dtype = torch.float64) -> Union[float, torch.Tensor]:
    """``w_k = n_k * W / R``: what micro-batch k's mean loss is multiplied by before its backward. A Python count
    gives a Python float (no device tensor per micro-batch); a tensor count stays on its device, in the loss's
    precision (an int64 count divided by a float would round to float32).

    >>> backward_weight(3, reference=12.0, grad_divisor=2.0)
    0.5
    """
    if isinstance(num_items, torch.Tensor):
        return num_items.to(torch.promote_types(loss_dtype, torch.float32)) * (grad_divisor / reference)
    return num_items * grad_divisor / reference


def boundary_scale(reference: float, num_items: float) -> float:
    """``R / N``, the factor that turns the reduced gradient into the window's mean gradient (0 for a
    window that counted no item: it takes no step).

    >>> boundary_scale(12.0, 12.0), boundary_scale(12.0, 8.0), boundary_scale(12.0, 0.0)
    (1.0, 1.5, 0.0)
    """
    return reference / num_items if num_items > 0 else 0.0


def running_reference(count: float) -> float:
    """The running R, for windows whose item count is not known before the first backward: the first count seen
    (across ranks, the largest of them), never below 1 so that a first micro-batch of 0 items still gives finite
    weights. Any positive R is exact (the boundary scale corrects it); one near N keeps the gradients near their
    final size, which fp16's loss scale expects.

    >>> running_reference(0.0), running_reference(37.0)
    (1.0, 37.0)
    """
    return max(float(count), 1.0)


def window_mean(loss_sum: float, num_items: float) -> float:
    """The window's item-weighted mean loss ``sum n_k L_k / N``; nan for a window of 0 items.

    >>> window_mean(6.0, 4.0), math.isnan(window_mean(0.0, 0.0))
    (1.5, True)
    """
    return loss_sum / num_items if num_items > 0 else math.nan


def clip_coefficient(grad_norm: Optional[float], max_grad_norm: Optional[float]) -> float:
    """``min(1, max_grad_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` scales; 1 without clipping.

    >>> clip_coefficient(4.0, 1.0) < 0.25 < clip_coefficient(4.0, None)
    True
    """
    if max_grad_norm is None:
        return 1.0
    return min(1.0, max_grad_norm / (grad_norm + CLIP_EPS))  # type: ignore[operator]  # measured when clipping


class Verdict(enum.Enum):
    """What the boundary does with a window."""

    STEP = "step"
    SKIP_EMPTY = "skip: no item"          # every label ignored: no loss to step on
    SKIP_NONFINITE = "skip: not finite"   # or fp16 overflow: the scaler backs off
    RAISE = "raise"


def verdict(loss_sum: Optional[float], num_items: float, grad_norm: Optional[float], *, nonfinite: str,
            has_scaler: bool) -> Verdict:
    """Step, skip or raise, from the window's global loss sum (None when the ranks did not exchange it: then the
    norm, always measured, carries it), item count and (measured) norm. A non-finite loss or norm skips
    (``nonfinite="skip"``) or raises; under fp16 a gradient that overflows behind a finite loss always skips, since
    an overflow is how the loss scaler learns to back off (a loss that is not finite is no overflow of the scale's).
    A window of 0 items is skipped.

    >>> verdict(1.0, 4, None, nonfinite="raise", has_scaler=False), verdict(1.0, 0, None, nonfinite="raise", has_scaler=False)
    (<Verdict.STEP: 'step'>, <Verdict.SKIP_EMPTY: 'skip: no item'>)
    """
    finite_loss = loss_sum is None or math.isfinite(loss_sum)
    if not (finite_loss and (grad_norm is None or math.isfinite(grad_norm))):
        overflow = has_scaler and finite_loss
        return Verdict.RAISE if nonfinite == "raise" and not overflow else Verdict.SKIP_NONFINITE
    return Verdict.STEP if num_items > 0 else Verdict.SKIP_EMPTY


@dataclass(frozen=True)
class Closing:
    """What a window's boundary decides: the verdict, the scale ``R / N`` that turns the reduced gradient into the
    window's mean gradient (0 for a window of no item), the norm after that scale (when measured), and N."""

    verdict: Verdict
    scale: float
    num_items: float
    grad_norm: Optional[float] = None
    steps: bool = dataclasses.field(init=False)  #: the verdict is STEP (set once: every driver asks it often)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", self.verdict is Verdict.STEP)


class WindowWeights:
    """One window's weighting from its opening to its record.

    Args:
        state: the driver's :class:`~gradaccum._state.AccumulatorState`: the running R is read from it and fixed
            into it, and :meth:`record` writes the window's lesson into it.
        grad_divisor: W, the ranks the gradient reduction averages over (1 on one process).
        num_items: the window's global N, when known before its first backward (count first).
        reference: R, when the driver knows it up front (the Accumulator's: N times the last window's ratio of the
            items ``loss_fn`` counted to those counted up front). Default: ``num_items``, else the running R (None
            until :meth:`fix_reference`).
        buffers: the float32 buffers a framework-driven window's bf16/fp16 gradients fold into, opened now (None:
            the sum is in ``.grad``, or the Accumulator's boundary owns the buffers).
    """

    __slots__ = ("state", "grad_divisor", "num_items", "reference", "weight_of", "buffers")

    def __init__(self, state: AccumulatorState, grad_divisor: float, *, num_items: Optional[Count] = None,
                 reference: Optional[float] = None, buffers: Optional[AccumulationBuffers] = None) -> None:
        self.state, self.grad_divisor = state, float(grad_divisor)
        self.num_items: Optional[float] = None if num_items is None else float(num_items)
        if reference is None:
            reference = self.num_items if self.num_items is not None and self.num_items > 0 else state.reference
        self.reference: Optional[float] = reference
        #: ``n_k * W / R`` by Python count n_k (:meth:`mean_weight`), read first by each micro-batch's caller
        self.weight_of: Dict[int, float] = {}
        self.buffers = buffers
        if buffers is not None:  # the window's bf16 gradients fold into float32 from here on
            buffers.open()

    @property
    def empty(self) -> bool:
        """The window is known before its first backward to hold no item: it weighs nothing, is skipped."""
        return self.num_items == 0

    def fix_reference(self, estimate: Count, agree: Callable[[float], float] = float) -> float:
        """R for this window: known, or the running R, fixed now once per state from ``estimate`` (the
        driver's guess at N from its first backward) made the same on every rank by ``agree`` (a max)."""
        if self.reference is None:
            if self.state.reference is None:
                self.state.reference = float(agree(running_reference(float(estimate))))
            self.reference = self.state.reference
        return self.reference

    def _r(self) -> float:
        if self.reference is None:  # R is read from the state as the window opens, fixed here only
            raise RuntimeError("WindowWeights: a weight asked for before R was fixed; call fix_reference(count) "
                               "at the window's first backward")
        return self.reference

    def mean_weight(self, num_items: Count, loss_dtype: torch.dtype = torch.float64) -> Union[float, torch.Tensor]:
        """What micro-batch k's **mean** loss over ``num_items`` = n_k items is multiplied by: ``n_k * W / R``
        (:func:`backward_weight`), kept in :attr:`weight_of` for a Python count; 0 in a window known empty."""
        weight = 0.0 if self.num_items == 0 else backward_weight(  # 0 in a window known empty
            num_items, self.reference if self.reference is not None else self._r(), self.grad_divisor, loss_dtype)
        if type(num_items) is int:
            self.weight_of[num_items] = weight  # type: ignore[assignment]  # a Python count: a Python float
        return weight

    def sum_weight(self) -> float:
        """What micro-batch k's **summed** loss ``S_k = n_k L_k`` is multiplied by: ``W / R`` (0 if known empty)."""
        if self.num_items == 0:  # known empty
            return 0.0
        return float(backward_weight(1, self.reference if self.reference is not None else self._r(), self.grad_divisor))

    def window_loss_weight(self, num_items: Count) -> float:
        """What the gradient of a loss over the **whole window** (a ``WindowLoss`` over its ``num_items`` = N) is
        multiplied by: ``N / R`` (``W`` = 1: the ranks' divisor rides in the representations' gradient slices)."""
        return 0.0 if self.empty else float(backward_weight(float(num_items), self._r(), 1.0))

    def weigh(self, loss: torch.Tensor, num_items: Count, leaves: Callable[[], Iterable[torch.Tensor]], *,
              divided_by: float = 1.0) -> ContextManager[None]:
        """Micro-batch k's weight ``n_k W / R`` put on the gradient of ``loss``, which the framework itself
        backpropagates after dividing it by ``divided_by`` (Lightning: ``accumulate_grad_batches``). Returns
        the context its backward runs in: :func:`~gradaccum._empty.weighing_nothing` over ``leaves()`` where
        ``n_k`` may be 0 (a mean over no item is nan, which no weight on the loss cleans)."""
        if not loss.requires_grad:
            return contextlib.nullcontext()
        weight = self.weight_of.get(num_items) if type(num_items) is int else None
        if weight is None:
            weight = self.mean_weight(num_items, loss.dtype)
        c = divided_by * weight
        loss.register_hook(lambda grad: (grad * c).to(grad.dtype))
        empty = None if type(num_items) is int and num_items > 0 else may_be_empty(num_items)
        return contextlib.nullcontext() if empty is None else weighing_nothing(leaves(), empty)

    def close(self, num_items: Count, *, loss_sum: Optional[float] = None, raw_norm: Optional[float] = None,
              nonfinite: str = "raise", has_scaler: bool = False) -> Closing:
        """The boundary's decision from the window's global N and, where the driver measured them, its global
        loss sum and the reduced gradient's norm before the scale. Changes nothing: :meth:`record` does."""
        n = float(num_items)
        r = self.reference  # None only where no weighted backward ran: then any R scales a zero gradient
        scale = boundary_scale(r if r is not None else 1.0, n)
        grad_norm = raw_norm * scale if raw_norm is not None else None
        return Closing(verdict(loss_sum, n, grad_norm, nonfinite=nonfinite, has_scaler=has_scaler), scale, n, grad_norm)

    def hand_over(self, params: Iterable[torch.nn.Parameter] = (), num_items: Optional[Count] = None) -> Closing:
        """The boundary of a window a framework steps, before it clips: :meth:`close` on ``num_items`` (N,
        where it was not counted first), then the gradient at its scale ``R / N``, the buffers rounded once
        into ``.grad`` (:meth:`Gradients.finalize`); a skipped window's buffers and ``.grad`` dropped."""
        closing = self.close(self.num_items if num_items is None else num_items)  # type: ignore[arg-type]
        if not closing.steps:
            Gradients(list(params), self.buffers).drop()
        elif closing.scale != 1.0 or self.buffers is not None:  # else nothing to scale or write back
            Gradients(list(params), self.buffers).finalize(closing.scale)
        return closing

    def judge(self, closing: Closing, params: Iterable[torch.nn.Parameter] = (),
              grad_norm: Union[None, float, torch.Tensor] = None, *, nonfinite: str, who: str) -> Closing:
        """The verdict (:func:`verdict`) on the gradient :meth:`hand_over` handed over, before the framework's optimizer
        steps, from ``grad_norm`` where the framework measured it (a tensor), else measured over the ``.grad`` of
        ``params``. A norm that is not finite (the same on every rank) drops that ``.grad`` and skips the window
        under ``nonfinite="skip"`` (the driver ``who`` holds the optimizer and scheduler back), or raises
        ``FloatingPointError`` under ``"raise"``. A window that takes no step is returned as it was."""
        if not closing.steps:
            return closing
        params = list(params)
        if grad_norm is None:
            grads = [p.grad for p in params if p.grad is not None]
            if any(g.dtype == torch.float16 for g in grads):  # finite fp16 elements whose norm passes 65504
                grads = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]  # norm of the norms
            grad_norm = total_norm(grads, grads[0].device if grads else torch.device("cpu"))
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = getattr(grad_norm, "full_tensor", lambda: grad_norm)()  # FSDP2: the whole gradient's
        norm = float(grad_norm)  # the window's one host read of its norm
        decision = verdict(None, closing.num_items, norm, nonfinite=nonfinite, has_scaler=False)
        closing = dataclasses.replace(closing, verdict=decision, grad_norm=norm)
        if decision is not Verdict.STEP:
            Gradients(params, None).drop()
        if decision is Verdict.RAISE:
            raise FloatingPointError(
                f"{who}: the gradient of window {self.state.steps + self.state.skipped + 1} of this run (after "
                f"{self.state.steps} optimizer steps and {self.state.skipped} skipped windows) has the norm {norm}, "
                "not finite: a loss or a gradient of one of its micro-batches was nan or inf. No optimizer step was "
                "taken. Lower the learning rate, or look for the batch that overflows; or pass "
                f"{who}(nonfinite='skip') to skip such windows (skipped counts them)")
        return closing

    @staticmethod
    def judged_skip_warning(who: str, closing: Closing, counted: str) -> str:
        """:meth:`record`'s ``warn_nonfinite`` for a window :meth:`judge` skipped: ``who``, the driver;
        ``counted``, how it counts such windows."""
        return (f"{who}: a window's gradient was not finite (norm {closing.grad_norm}), so it was skipped: its "
                f"gradient dropped, no optimizer or scheduler step; {counted}. Lower the learning rate, or pass "
                f"{who}(nonfinite='raise') to stop at such a window")

    def record(self, closing: Closing, *, applied: bool = True, warn_empty: Optional[str] = None,
               warn_nonfinite: Optional[str] = None, stacklevel: int = 2) -> Closing:
        """What the state learns at the boundary: one more step or skipped window, and N as the last window's (if it
        had items). ``warn_empty`` (how the driver counts a window of no item) and ``warn_nonfinite`` are each said
        once per state. A step the stepper did not apply (``applied=False``: a DeepSpeed engine that found the
        gradient not finite) counts as skipped. Returns the closing as recorded."""
        state = self.state
        assert closing.verdict is not Verdict.RAISE, "a window that raises is not recorded: the driver raised"
        if closing.steps and not applied:
            closing = dataclasses.replace(closing, verdict=Verdict.SKIP_NONFINITE)
        if closing.steps:
            state.steps += 1
        else:
            state.skipped += 1
            if closing.verdict is Verdict.SKIP_EMPTY and warn_empty is not None and state.warn_once("no_items"):
                warnings.warn("a window counted 0 items (e.g. every label is the ignore_index): it has no loss to "
                              f"step on, so it was skipped; {warn_empty}", UserWarning, stacklevel=stacklevel + 1)
            if closing.verdict is Verdict.SKIP_NONFINITE and warn_nonfinite is not None \
                    and state.warn_once("nonfinite"):
                warnings.warn(warn_nonfinite, UserWarning, stacklevel=stacklevel + 1)
        if closing.num_items > 0:
            state.last_window_items = closing.num_items
        return closing

    def abort(self) -> None:
        """The window failed part-way: its buffers fold nothing more and keep nothing."""
        if self.buffers is not None:
            self.buffers.retire()


class Gradients:
    """The window's gradient: opened with the window, read and scaled at the boundary, cleared after."""

    def __init__(self, params: Sequence[torch.nn.Parameter], buffers: Optional[AccumulationBuffers]) -> None:
        self.params, self.buffers = list(params), buffers
        folded = set() if buffers is None else {id(p) for p in buffers.params}
        #: the parameters whose gradient sums in ``.grad`` (with buffers: those already of the buffers' dtype)
        self.unbuffered = [p for p in self.params if id(p) not in folded]

    def open(self) -> None:
        """A window opens: stale gradients would leak into it; the buffers fold from here on."""
        for p in self.params:
            p.grad = None
        if self.buffers is not None:
            self.buffers.open()

    def tensors(self) -> List[torch.Tensor]:
        grads = [p.grad for p in self.unbuffered if p.grad is not None]
        return grads if self.buffers is None else grads + self.buffers.tensors()

    def materialized(self) -> List[torch.Tensor]:
        """Every trainable parameter's ``.grad``, zeros where none was made (for an explicit reduction; a frozen
        one is given none, which the optimizer would step, weight decay and all)."""
        trainable = [p for p in self.params if p.requires_grad]
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in trainable]  # type: ignore[misc]

    def finalize(self, coef: float, grads: Optional[List[torch.Tensor]] = None) -> None:
        """The window's gradient (``grads``, where the caller listed them) multiplied once by ``coef`` (the
        scale ``R / N``, any clip folded in), then the buffers rounded once into ``.grad``."""
        if coef != 1.0:
            grads = self.tensors() if grads is None else grads
            if grads:
                with torch.no_grad():
                    torch._foreach_mul_(grads, coef)
        if self.buffers is not None:
            self.buffers.write_grads_()

    def drop(self) -> None:
        """The window's gradient goes (stepped, skipped or abandoned); the buffers fold nothing until the next opens."""
        for p in self.params:
            p.grad = None
        if self.buffers is not None:
            self.buffers.retire()


def total_norm(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The gradient's total 2-norm: one fused pass for plain tensors on one device; DTensors and mixed
    devices take the general path."""
    if not grads:
        return torch.zeros((), device=device)
    if all(type(g) is torch.Tensor and g.device == device for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    norm = torch.nn.utils.get_total_norm(grads, 2.0) if hasattr(torch.nn.utils, "get_total_norm") \
        else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return full_tensor(norm)
