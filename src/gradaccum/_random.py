"""The two-pass methods' one replay (:class:`~gradaccum.WindowLoss`'s cached passes, :class:`~gradaccum.MoELoss`'s
counting forward): a micro-batch's forward run twice, drawing the same random numbers."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from .errors import replay_differs

__all__ = ["RandomState", "Replay"]


class RandomState:
    """The CPU generator's state, and the CUDA device's when its generator is in use, to restore."""

    __slots__ = ("cpu", "device", "device_state")

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.device, self.device_state = device, None
        if device.type == "cuda" and torch.cuda.is_initialized():
            self.device_state = torch.cuda.get_rng_state(device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_state is not None:
            torch.cuda.set_rng_state(self.device_state, self.device)


class Replay:
    """One window's replay, in the order a driver calls it: :meth:`save` before each micro-batch's first forward,
    :meth:`saved_all` after the last; :meth:`replay` ``k`` before its second forward, :meth:`compare`; :meth:`check`
    on every rank alike; :meth:`finish`. ``who`` and ``what`` name the forward and what differed in the refusal;
    ``rtol``: how far a second forward may be from the first (0: exactly equal)."""

    def __init__(self, device: torch.device, sync: Any, who: str, what: str, *, rtol: float = 0.0) -> None:
        self.device, self.sync, self.who, self.what, self.rtol = device, sync, who, what, rtol
        self.states: List[RandomState] = []
        self.end: Optional[RandomState] = None
        self.differs = torch.zeros((), dtype=torch.bool, device=device)

    def save(self) -> None:
        self.states.append(RandomState(self.device))

    def saved_all(self) -> None:
        self.end = RandomState(self.device)

    def replay(self, k: int) -> None:
        self.states[k].restore()

    def compare(self, again: Sequence[torch.Tensor], first: Sequence[torch.Tensor]) -> None:
        """The second forward's tensors against the first's (NaN equal to NaN), kept for :meth:`check`."""
        for a, b in zip(again, first):
            self.differs |= ~torch.isclose(a.detach(), b, rtol=self.rtol, atol=0.0, equal_nan=True).all()

    def check(self) -> None:
        """The refusal, on every rank alike (one flag all-reduced), where any rank's second forward differed."""
        if self.sync.any_rank(bool(self.differs), self.device):
            raise replay_differs(self.who, self.what)

    def finish(self) -> None:
        """After pass 2: the random state as pass 1 left it (the window drew its random numbers once)."""
        self.end.restore()
