"""Exact gradient accumulation inside the training loops people already use.

* :class:`~gradaccum.integrations.lightning.ExactAccumulation`: a PyTorch Lightning ``Callback``.
* :class:`~gradaccum.integrations.hf_trainer.ExactTrainer`: a Hugging Face ``Trainer`` subclass.

Both make a step over a window of micro-batches one optimizer step on the whole window (the maths: each
class's docstring). The frameworks are imported only when one of these names is used, so ``import gradaccum``
never needs them.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["ExactAccumulation", "ExactTrainer"]

_WHERE = {"ExactAccumulation": "lightning", "ExactTrainer": "hf_trainer"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
