"""gradaccum's refusals: one base class, and the few kinds a user would catch.

Every refusal says the argument, the value and the fix, and is raised before anything changes (no
gradient, counter or file touched). Each is a ``ValueError``, so code that catches ``ValueError``
keeps working; catch :class:`GradaccumError` to tell gradaccum's refusals from a bug of one's own::

    GradaccumError (ValueError)
     ├── ConfigurationError    an argument, or a combination of them, that gradaccum refuses
     │    └── NotExactError    a route that cannot be one big batch (yet): refused, never run inexactly
     │         └── ReplayError a forward replayed with its random state gave other results: no step taken
     ├── SplitError            a batch or window that cannot be split, joined or counted as asked
     └── RankAgreementError    the ranks cannot agree on a window: raised on every rank alike, none waits in a
                               collective
"""

from __future__ import annotations

from typing import Optional

__all__ = ["GradaccumError", "ConfigurationError", "NotExactError", "ReplayError", "SplitError", "RankAgreementError",
           "replay_differs"]


class GradaccumError(ValueError):
    """A refusal of gradaccum's: the message names what was refused and the fix."""


class ConfigurationError(GradaccumError):
    """An argument, or a combination of arguments, that gradaccum refuses (``epochs must be a positive
    int, got 0``; ``accum_dtype`` under DDP; two ``ExactAccumulation`` callbacks)."""


class NotExactError(ConfigurationError):
    """A model, loss or stack that accumulation cannot make one big batch (yet), refused with the fix
    instead of trained as plain accumulation: a loss that couples the batch's items without a
    :class:`~gradaccum.WindowLoss`, an MoE router's load-balancing loss where it is not computed over
    the window, a loss type that is not a mean of per-item terms."""


class ReplayError(NotExactError):
    """A two-pass method (a :class:`~gradaccum.WindowLoss`'s cached passes, an MoE router's counting pass)
    ran a micro-batch's forward a second time with its random state replayed and got other results, so
    the step would not be the big batch's. Raised on every rank alike, before the window's step: no
    step is taken and the window's gradients are dropped."""


def replay_differs(who: str, what: str) -> ReplayError:
    """The one refusal of a forward that is not a function of its micro-batch, the model and the random
    state: ``who`` ran it (``"WindowLoss"``, ``"MoELoss"``, ``"ExactTrainer"``), ``what`` differed.

    >>> print(replay_differs("MoELoss", "routed its tokens to other experts"))  # doctest: +ELLIPSIS
    MoELoss: a micro-batch's second forward routed its tokens to other experts than its first, ...
    """
    return ReplayError(
        f"{who}: a micro-batch's second forward {what} than its first, although its random state was "
        "replayed, so the step would not be the big batch's: the forward is not a function of the micro-batch "
        "and the model alone (a random generator of its own, a module that keeps state between calls, or "
        "non-deterministic kernels: call torch.use_deterministic_algorithms(True)). No step was taken")


class SplitError(GradaccumError):
    """A batch or window that cannot be split, joined or counted as asked (tensors that disagree on
    their leading dimension, a window that is neither a list nor a batch with ``micro_batch_size``).

    From :func:`~gradaccum.check_equivalence`, ``micro_batch_size`` and ``items`` are the split asked for,
    ``suggestion`` a micro-batch size that works (None: none does, or not known)."""

    def __init__(self, message: str, *, micro_batch_size: Optional[int] = None, items: Optional[int] = None,
                 suggestion: Optional[int] = None) -> None:
        super().__init__(message)
        self.micro_batch_size = micro_batch_size
        self.items = items
        self.suggestion = suggestion


class RankAgreementError(GradaccumError):
    """The ranks cannot agree on a window (a rank that must pad and cannot, shares that disagree with
    the sampler's plan): every rank raises it alike, before any collective it would wait in."""
