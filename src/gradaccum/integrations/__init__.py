"""Exact gradient accumulation inside the training loops people already use.

* :class:`~gradaccum.integrations.lightning.ExactAccumulation`: a PyTorch Lightning ``Callback``.
* :class:`~gradaccum.integrations.hf_trainer.ExactTrainer`: a Hugging Face ``Trainer`` subclass.

Both make a step over a window of micro-batches equal to one optimizer step on the whole window: the
gradient of the item-weighted mean loss over every item of the window on every rank,

    grad = sum_{ranks, k} n_k * grad(L_k) / N_global,

where ``L_k`` is micro-batch k's mean loss over its ``n_k`` items. The frameworks are imported only
when one of these names is used, so ``import gradaccum`` never needs them."""
from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["ExactAccumulation", "ExactTrainer"]

_WHERE = {"ExactAccumulation": "lightning", "ExactTrainer": "hf_trainer"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
