"""The MoE Trainer scenarios shared by the in-process tests (test_moe_trainer.py) and the torchrun
worker (moe_worker.py): a float64 reference that steps once per window on the model's own loss
(token loss + coef * load balancing, ``model(**batch).loss``) over every rank's micro-batches of
that window padded as one batch, with the Trainer's optimizer and schedule."""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from torch import nn

from hf_helpers import pad
from integrations import scenarios as S


def reference(model: nn.Module, windows: Sequence[Sequence[torch.Tensor]], clip: Optional[float] = None) -> nn.Module:
    model = copy.deepcopy(model)
    opt, sched = S.make_optimizer(model.parameters())
    for window in windows:
        opt.zero_grad(set_to_none=True)
        model(**pad(window)).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    return model
