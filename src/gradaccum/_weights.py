"""One window's weighting, from its opening to its record: the one window core every driver holds.

:class:`WindowWeights` composes the formulas of :mod:`gradaccum._maths` into the window every loop runs:
the Accumulator's (:class:`~gradaccum._window.Window` and :class:`~gradaccum._boundary.Boundary`), the
pipeline's, and the windows a framework's loop runs from its hooks (``ExactTrainer`` and the other Trainer
drivers, Lightning's ``ExactAccumulation``, through :class:`~gradaccum._driven.DrivenWindow`), step by step:

1. **open** it: ``WindowWeights(state, W, num_items=N)`` when the window's global N is known before the
   first backward (count first: R = N, the boundary scale is 1; N = 0 is known to be skipped,
   :attr:`~WindowWeights.empty`), else ``WindowWeights(state, W)`` with the running R of
   ``state.reference``, fixed once by the first backward (:meth:`~WindowWeights.fix_reference`) and kept
   in the state (a driver that cannot see the window ahead);
2. **weigh** micro-batch k: a mean loss over n_k items by :meth:`~WindowWeights.mean_weight`
   (``n_k * W / R``, kept per Python count in :attr:`~WindowWeights.weight_of`), a summed loss by
   :meth:`~WindowWeights.sum_weight` (``W / R``); W is the number of ranks the reduction averages over;
3. at the **boundary**: :meth:`~WindowWeights.close` gives the :class:`~gradaccum._maths.Closing` (the
   verdict, from N and, where the driver measured them, the loss and the norm; the scale ``R / N``);
4. :meth:`~WindowWeights.record` writes what the window taught into the
   :class:`~gradaccum._state.AccumulatorState`: one more step, or one more skipped window (with a one-time
   warning), and N as the last window's count.

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

docs/architecture.md ("One window, whoever runs the loop") walks each driver's hooks through it.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Dict, Optional, Union

import torch

from ._checks import Count
from ._maths import Closing, Verdict, backward_weight, boundary_scale, running_reference, verdict
from ._state import AccumulatorState

__all__ = ["WindowWeights"]


class WindowWeights:
    """One window's weighting from its opening to its record (the module docstring's order).

    Args:
        state: the driver's :class:`~gradaccum._state.AccumulatorState`: the running R is read from it
            and fixed into it, and :meth:`record` writes the window's lesson into it.
        grad_divisor: W, the ranks the gradient reduction averages over (1 on one process).
        num_items: the window's global N, when known before its first backward (count first).
        reference: R, when the driver knows it up front (the Accumulator's: N times the last window's
            ratio of the items ``loss_fn`` counted to those counted up front, 1 when they are the same
            items). Default: ``num_items``, else the running R.
    """

    __slots__ = ("state", "grad_divisor", "num_items", "reference", "weight_of")

    def __init__(self, state: AccumulatorState, grad_divisor: float, *, num_items: Optional[Count] = None,
                 reference: Optional[float] = None) -> None:
        self.state, self.grad_divisor = state, float(grad_divisor)
        #: the window's global N, when known before the first backward; else None
        self.num_items: Optional[float] = None if num_items is None else float(num_items)
        if reference is None:
            reference = self.num_items if self.num_items is not None and self.num_items > 0 else state.reference
        #: R: known when the window opened, else the running R (None until its first backward fixes it)
        self.reference: Optional[float] = reference
        #: ``n_k * W / R`` by Python count n_k, as :meth:`mean_weight` gave it: a micro-batch's caller reads
        #: ``weight_of.get(n_k)`` first, so that the weight of each count is computed once per window
        self.weight_of: Dict[int, float] = {}

    @property
    def empty(self) -> bool:
        """The window is known before its first backward to hold no item: it weighs nothing, is skipped."""
        return self.num_items == 0

    def fix_reference(self, estimate: Count, agree: Callable[[float], float] = float) -> float:
        """R for this window: known, or the running R; fixed now, once per state, from ``estimate`` (the
        driver's guess at a window's N from its first backward, :func:`~gradaccum._maths.running_reference`)
        made the same on every rank by ``agree`` (a max across ranks; the identity where the estimate is
        already agreed)."""
        if self.reference is None:
            if self.state.reference is None:
                self.state.reference = float(agree(running_reference(float(estimate))))
            self.reference = self.state.reference
        return self.reference

    def _r(self) -> float:
        if self.reference is None:
            self.reference = self.state.reference  # fixed since this window opened, if at all
            if self.reference is None:
                raise RuntimeError("WindowWeights: a weight asked for before R was fixed; call fix_reference(count) "
                                   "at the window's first backward")
        return self.reference

    # -- weigh each micro-batch ---------------------------------------------------------------------------

    def mean_weight(self, num_items: Union[Count, torch.Tensor], loss_dtype: torch.dtype = torch.float64
                    ) -> Union[float, torch.Tensor]:
        """What micro-batch k's **mean** loss over ``num_items`` = n_k items is multiplied by:
        ``n_k * W / R`` (:func:`~gradaccum._maths.backward_weight`); 0 in a window known to be empty. The
        weight of a Python count is kept in :attr:`weight_of` (the same for any ``loss_dtype``)."""
        if self.num_items == 0:  # known empty
            weight: Union[float, torch.Tensor] = 0.0
        else:
            weight = backward_weight(num_items, self.reference if self.reference is not None else self._r(),
                                     self.grad_divisor, loss_dtype)
        if type(num_items) is int:
            self.weight_of[num_items] = weight  # type: ignore[assignment]  # a Python count: a Python float
        return weight

    def sum_weight(self) -> float:
        """What micro-batch k's **summed** loss ``S_k = n_k L_k`` is multiplied by: ``W / R`` (the mean
        weight of one item; where N was counted first, ``W / N``); 0 in a window known to be empty."""
        if self.num_items == 0:  # known empty
            return 0.0
        r = self.reference if self.reference is not None else self._r()
        return float(backward_weight(1, r, self.grad_divisor))

    def window_loss_weight(self, num_items: Count) -> float:
        """What the gradient of a loss over the **whole window** (a ``WindowLoss``: one mean over the
        window's ``num_items`` = N rows, the cached two passes) is multiplied by: ``N / R``
        (:func:`~gradaccum._maths.backward_weight` with ``W`` = 1: the ranks' divisor rides in the
        representations' gradient slices), 1 where N was counted first."""
        return 0.0 if self.empty else float(backward_weight(float(num_items), self._r(), 1.0))

    # -- the boundary ---------------------------------------------------------------------------------------

    def close(self, num_items: Count, *, loss_sum: Optional[float] = None, raw_norm: Optional[float] = None,
              nonfinite: str = "raise", has_scaler: bool = False) -> Closing:
        """The boundary's decision from the window's global N (summed over its micro-batches and ranks),
        and where the driver measured them its global loss sum and the reduced gradient's norm before
        the scale (:func:`~gradaccum._maths.verdict`, :func:`~gradaccum._maths.boundary_scale`). Changes
        nothing: :meth:`record` does, once the driver has stepped or skipped."""
        n = float(num_items)
        r = self.reference  # None only where no weighted backward ran: then any R scales a zero gradient
        scale = boundary_scale(r if r is not None else 1.0, n)
        grad_norm = raw_norm * scale if raw_norm is not None else None
        return Closing(verdict(loss_sum, n, grad_norm, nonfinite=nonfinite, has_scaler=has_scaler), scale, n,
                       grad_norm)

    # -- what the state learns ------------------------------------------------------------------------------

    def record(self, closing: Closing, *, applied: bool = True, warn_empty: Optional[str] = None,
               warn_nonfinite: Optional[str] = None, stacklevel: int = 2) -> Closing:
        """What the state learns at the boundary: one more optimizer step, or one more skipped window
        (``warn_empty``, when given, is said once per state for a window of no item: how the driver
        counts them; ``warn_nonfinite``, the driver's whole warning, once per state for a window skipped
        as not finite), and the window's N as the last window's (windows with items only: it is an R). A step the stepper did not apply (``applied=False``: an fp16 loss scale
        that overflowed, a DeepSpeed engine that found the gradient not finite) is a window skipped as
        not finite. Returns the closing as recorded."""
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
