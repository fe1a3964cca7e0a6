"""What one window did: returned by every ``step()``, so the step is never hidden."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Union

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """The outcome of one window.

    Attributes:
        loss: item-weighted mean loss over the whole window (all ranks): sum n_k L_k / sum n_k;
            nan when the window counted no item (it is then skipped).
        num_items: items in the window across all ranks (the normalizer); an int, or a float when
            the counts given were fractional weights.
        micro_batches: the micro-batches this rank **ran** in the window and counted (its forward and
            weighted backward; the zero-weight padding and flush are not counted). A short last window
            of ``train()`` runs fewer than ``accum_steps``, and shows here as fewer.
        grad_norm: total gradient norm before clipping (after normalization and unscaling), when measured: with
            ``max_grad_norm``, fp16 or ``Accumulator(compute_grad_norm=True)``; None otherwise (measuring is a pass
            over the whole gradient). inf or nan when the gradient was not finite (the window is then skipped).
        skipped: True when no optimizer step was taken (non-finite loss, non-finite measured
            gradient, fp16 overflow, or a window with 0 items).
        lr: learning rate of the first parameter group used for this window.
        step: optimizer steps taken so far, this one included.
        micro_batch_size: the split used when the window was one batch: the size of its first micro-batch, which is
            ``micro_batch_size`` or the batch's own size where that is smaller (10 rows at
            ``micro_batch_size=1000``: 10); with "auto", the size it settled on; None for a list of micro-batches.
        epoch: the epoch in ``train()``; None from ``step()``.
        window: the window's index within its epoch in ``train()`` (what a checkpoint saves to
            resume after it: ``window + 1``); None from ``step()``.
        stop_requested: some rank called ``Accumulator.request_stop()`` before this window's
            boundary; every rank sees the same value, so all can stop after this same window.
    """

    loss: float
    num_items: Union[int, float]
    micro_batches: int
    grad_norm: Optional[float]
    skipped: bool
    lr: float
    step: int
    micro_batch_size: Optional[int] = None
    epoch: Optional[int] = None
    window: Optional[int] = None
    stop_requested: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
