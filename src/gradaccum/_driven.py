"""One window of a loop a framework owns (the Hugging Face Trainer's, Lightning's), driven from its hooks.

The framework calls forward, backward, clipping and the optimizer; the driver (``ExactTrainer``,
``ExactAccumulation``) only hooks them. :class:`DrivenWindow` is what is the same in every such driver:
it opens the core's :class:`~gradaccum._weights.WindowWeights` (N counted first, or the running R) and the
float32 buffers, weighs each micro-batch, and at the boundary, before the framework clips, hands the
gradient over at ``R / N`` or drops it (the Accumulator's :class:`~gradaccum._gradients.Gradients` rule),
judges its norm (the Accumulator's :func:`~gradaccum._maths.verdict` and ``nonfinite=``) and records.
docs/architecture.md walks each driver's hooks through it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Iterable, Optional, Union

import torch

from ._checks import Count, as_number
from ._gradients import AccumulationBuffers, Gradients, total_norm
from ._maths import Verdict, verdict
from ._settings import NONFINITE
from ._state import AccumulatorState
from ._maths import Closing
from ._weights import WindowWeights
from ._empty import may_be_empty, weighing_nothing
from .errors import ConfigurationError

__all__ = ["DrivenWindow", "nonfinite_choice"]


class DrivenWindow:
    """The window being trained by a framework's loop: its weighting, the float32 buffers it folds
    into, how many micro-batches it holds (when known) and how many have run, and the items this rank
    has weighed (the running count, for a driver that learns N only at the boundary).

    Args:
        state: the driver's :class:`~gradaccum.AccumulatorState`.
        grad_divisor: W, the ranks the framework's reduction averages over.
        num_items: the window's global N, counted before its first backward; None: the running R.
        micro_batches: how many micro-batches the window holds, when the driver knows it up front.
        buffers: the driver's float32 buffers (None: the sum is in ``.grad``); opened now.
        second_items: the window's global count of a second mean its loss holds (GRPO's entropy bonus,
            a token mean over the step whose loss may average over sequences): weighed by ``second``,
            ``W / max(count, 1)`` (a mean over no item weighs a zero sum).
        nonfinite: ``"skip"`` or ``"raise"`` a window whose gradient is not finite (:meth:`judge`).
        who: the driver, as its user wrote it (``"ExactTrainer"``), named in the warning and the error.
    """

    def __init__(self, state: AccumulatorState, grad_divisor: float, *, num_items: Optional[Count] = None,
                 micro_batches: Optional[int] = None, buffers: Optional[AccumulationBuffers] = None,
                 second_items: Optional[Count] = None, nonfinite: str = "skip", who: str = "the driver") -> None:
        self.nonfinite, self.who = nonfinite, who
        self.weights = WindowWeights(state, grad_divisor, num_items=num_items)
        self.second = None if second_items is None else WindowWeights(state, grad_divisor,
                                                                      num_items=max(as_number(second_items), 1.0))
        #: the boundary's decision, known at the opening where N was counted first
        self.closing: Optional[Closing] = None if num_items is None else self.weights.close(num_items)
        #: the window is known at its opening to take no step (N = 0)
        self.skip = self.closing is not None and not self.closing.steps
        #: N, the window's items on every rank (counted first), and W / N, what one item's summed loss weighs
        #: (0 in a skipped window): asked by every micro-batch, computed once
        self.items = int(self.weights.num_items or 0)
        self.item_weight = None if num_items is None else self.weights.sum_weight()
        self.micro_batches, self.ran, self.count = micro_batches, 0, 0  # count: sum of n_k weighed here
        self.buffers = buffers
        if buffers is not None:  # the window's bf16 gradients fold into float32 from here on
            buffers.clear()
            buffers.active = True

    @property
    def last(self) -> bool:
        """The micro-batch running now is the window's last."""
        return self.micro_batches is not None and self.ran == self.micro_batches - 1

    def ran_one(self) -> bool:
        """One micro-batch more has run; whether it was the window's last."""
        self.ran += 1
        return self.micro_batches is not None and self.ran == self.micro_batches

    def weigh(self, loss: torch.Tensor, num_items: Count, leaves: Callable[[], Iterable[torch.Tensor]], *,
              divided_by: float = 1.0) -> ContextManager[None]:
        """Micro-batch k's weight ``n_k W / R`` on the gradient of ``loss``, which the framework itself
        backpropagates after dividing it by ``divided_by`` (Lightning: ``accumulate_grad_batches``), and
        ``n_k`` added to the running count. Returns the context its backward runs in: where ``n_k`` may be
        0 (:func:`~gradaccum._empty.may_be_empty`), :func:`~gradaccum._empty.weighing_nothing` over
        ``leaves()``, since a mean over no item is ``0 / 0 = nan``, which no weight on the loss cleans."""
        self.count = self.count + num_items
        if not loss.requires_grad:
            return contextlib.nullcontext()
        weight = self.weights.weight_of.get(num_items) if type(num_items) is int else None
        if weight is None:  # n_k * W / R, once per window and Python count (mean_weight keeps it in weight_of)
            weight = self.weights.mean_weight(num_items, loss.dtype)
        c = divided_by * weight
        loss.register_hook(lambda grad: (grad * c).to(grad.dtype))
        empty = None if type(num_items) is int and num_items > 0 else may_be_empty(num_items)
        return contextlib.nullcontext() if empty is None else weighing_nothing(leaves(), empty)

    def close(self, num_items: Optional[Count] = None, params: Iterable[torch.nn.Parameter] = ()) -> Closing:
        """The boundary, before the framework clips and steps: the verdict (from ``num_items``, the
        window's global N, where it was not counted first) and the window's gradient handed over at its
        scale ``R / N``, the buffers rounded once into ``.grad``; for a skipped window the buffers and
        the ``.grad`` of ``params`` are dropped."""
        closing = self.closing if self.closing is not None else self.weights.close(num_items if num_items is not None
                                                                                     else self.count)
        if not closing.steps:  # the Accumulator's boundary's rules for the gradient and its buffers
            Gradients(list(params), self.buffers).drop()
        elif closing.scale != 1.0 or self.buffers is not None:  # else nothing to scale or write back
            Gradients(list(params), self.buffers).hand_over(closing.scale)
        return closing

    def judge(self, closing: Closing, params: Iterable[torch.nn.Parameter] = (),
              grad_norm: Union[None, float, torch.Tensor] = None) -> Closing:
        """The verdict on the gradient :meth:`close` handed over, before the framework's optimizer steps:
        from ``grad_norm``, its norm where the framework measured it anyway (the Hugging Face Trainer's,
        for clipping and its log; a tensor), else measured here over the ``.grad`` of ``params`` (one
        fused pass). Read on the host once. The rule is the ``Accumulator``'s
        (:func:`~gradaccum._maths.verdict`): a norm that is not finite (nan or inf in a loss or a gradient
        of any micro-batch: every rank holds the same reduced gradient, so every rank decides the same)
        skips the window under ``nonfinite="skip"``, its ``.grad`` of ``params`` dropped (the driver
        keeps the optimizer and the scheduler from stepping, and :meth:`record` counts the skip), and
        raises ``FloatingPointError`` under ``"raise"``, naming the window and the fix. A window that
        already takes no step is returned as it was."""
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
        decision = verdict(None, closing.num_items, norm, nonfinite=self.nonfinite, has_scaler=False)
        closing = dataclasses.replace(closing, verdict=decision, grad_norm=norm)
        if decision is Verdict.STEP:
            return closing
        for p in params:
            p.grad = None
        if decision is Verdict.RAISE:
            state = self.weights.state
            raise FloatingPointError(
                f"{self.who}: the gradient of window {state.steps + state.skipped + 1} of this run (after "
                f"{state.steps} optimizer steps and {state.skipped} skipped windows) has the norm {norm}, not "
                "finite: a loss or a gradient of one of its micro-batches was nan or inf. No optimizer step was "
                "taken. Lower the learning rate, or look for the batch that overflows; or pass "
                f"{self.who}(nonfinite='skip') to skip such windows (skipped counts them)")
        return closing

    def record(self, closing: Closing, *, applied: bool = True, warn_empty: Optional[str] = None,
               warn_nonfinite: Optional[str] = None) -> Closing:
        """What the state learns: one step more, or one skipped window more (also a step the framework
        did not apply: an fp16 loss scale that overflowed). ``warn_nonfinite``, when given, is said once
        per state with the warning for a window skipped for a gradient that was not finite (how the
        driver counts them)."""
        nonfinite = closing.verdict is Verdict.SKIP_NONFINITE or (closing.steps and not applied)
        said = None if warn_nonfinite is None or not nonfinite else (
            f"{self.who}: a window's gradient was not finite (norm {closing.grad_norm}), so it was skipped: its "
            f"gradient dropped, no optimizer or scheduler step; {warn_nonfinite}. Lower the learning rate, or pass "
            f"{self.who}(nonfinite='raise') to stop at such a window")
        return self.weights.record(closing, applied=applied, warn_empty=warn_empty, warn_nonfinite=said, stacklevel=3)

    def abort(self) -> None:
        """The window failed part-way: its buffers fold nothing more and keep nothing."""
        if self.buffers is not None:
            self.buffers.retire()


def nonfinite_choice(who: str, value: Any) -> str:
    """``nonfinite=`` as a driver was given it, once it is one of ``"skip"`` and ``"raise"``."""
    if not isinstance(value, str) or value not in NONFINITE:
        raise ConfigurationError(
            f"{who}(nonfinite={value!r}): nonfinite must be 'skip' (a window whose loss or gradient is not finite "
            "takes no optimizer or scheduler step, is counted in skipped, with a warning) or 'raise' (training "
            f"stops with FloatingPointError at that window); pass {who}(nonfinite='skip') or nonfinite='raise'")
    return value

