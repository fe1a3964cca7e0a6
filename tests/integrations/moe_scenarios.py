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


def reference(model: nn.Module, windows: Sequence[Sequence[torch.Tensor]], clip: Optional[float] = None,
              optimizer=S.make_optimizer) -> nn.Module:
    model = copy.deepcopy(model)
    opt, sched = optimizer(model.parameters())
    for window in windows:
        opt.zero_grad(set_to_none=True)
        model(**pad(window)).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    return model


def sgd(params) -> tuple:
    """SGD with momentum and a constant schedule (the Accumulator scenarios step no scheduler)."""
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
