"""How many micro-batches make a window, epoch by epoch, and how many optimizer steps that makes
(:func:`num_steps`: a learning-rate schedule sized before training, docs/guides/train.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Union

from ._checks import non_negative_int, positive_int
from ._maths import ceil_div
from .errors import ConfigurationError

__all__ = ["AccumSchedule", "AccumSteps", "num_steps"]

AccumSteps = Union[int, Mapping[int, int], Callable[[int], int]]


class AccumSchedule:
    """The accumulation factor per epoch: an int, ``{first_epoch: N}`` or a callable ``epoch -> N``.

    With a mapping, N holds from its epoch until the next key; epochs before the first key use 1
    (as Lightning's ``GradientAccumulationScheduler``).
    """

    def __init__(self, accum_steps: AccumSteps) -> None:
        self._fn: Callable[[int], int]
        if isinstance(accum_steps, Mapping):
            if not accum_steps:
                raise ConfigurationError("accum_steps mapping is empty; give at least {0: N}")
            for epoch, n in accum_steps.items():
                if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                    raise ConfigurationError(f"accum_steps keys must be epochs (ints >= 0), got {epoch!r}")
                positive_int(f"accum_steps[{epoch}]", n)
            points = sorted(accum_steps.items())
            self._fn = lambda e: next((n for start, n in reversed(points) if e >= start), 1)
        elif callable(accum_steps):
            self._fn = accum_steps
        else:
            positive_int("accum_steps", accum_steps)
            self._fn = lambda e: accum_steps  # type: ignore[return-value]

    def __call__(self, epoch: int) -> int:
        return positive_int(f"accum_steps for epoch {epoch}", self._fn(epoch))


def num_steps(num_micro_batches: int, accum_steps: AccumSteps, *, epochs: int = 1, drop_last: bool = False) -> int:
    """The optimizer steps ``Accumulator.train`` takes over ``epochs`` epochs of ``num_micro_batches``.

    Per epoch e with accumulation N_e: ``ceil(M / N_e)`` windows, or ``floor(M / N_e)`` with
    ``drop_last``. Under data parallelism give the largest per-rank ``len(loader)``: every rank takes
    as many steps as the rank with the most windows (the others contribute no items to the rest);
    with ``drop_last``, the smallest (the first short window on any rank ends the epoch on all). A
    loader on a :class:`~gradaccum.WindowSampler` takes ``sampler.num_windows`` steps per epoch.

    >>> num_steps(10, 4), num_steps(10, 4, drop_last=True), num_steps(10, {0: 1, 1: 5}, epochs=2)
    (3, 2, 12)
    """
    non_negative_int("num_micro_batches", num_micro_batches, hint=" (e.g. len(loader))")
    positive_int("epochs", epochs)
    schedule = AccumSchedule(accum_steps)
    if drop_last:
        return sum(num_micro_batches // schedule(e) for e in range(epochs))
    return sum(ceil_div(num_micro_batches, schedule(e)) for e in range(epochs))
