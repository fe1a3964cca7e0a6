"""The random state a forward starts from, kept so that the same forward can run again alike.

Two-pass methods run a micro-batch's forward twice and need both to draw the same random numbers
(dropout, router jitter): :class:`~gradaccum.WindowLoss` (pass 1 caches the representations, pass 2
backpropagates them), :class:`~gradaccum.MoELoss` (a counting forward, then the training forward) and
their Trainer drivers. Each saves a :class:`RandomState` before the first forward and restores it
before the second; the state after the first pass is restored at the end, so the window draws its
random numbers once.
"""

from __future__ import annotations

import torch

__all__ = ["RandomState"]


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
