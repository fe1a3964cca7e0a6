"""Shared test fixtures: small float64 models and the full-batch reference step."""
from __future__ import annotations

import copy
from typing import Callable, List

import torch
from torch import nn

RTOL = 1e-10


def regression_model(seed: int = 0, d_in: int = 5, d_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out)).double()


def regression_batch(n: int, seed: int = 1, d_in: int = 5, d_out: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=torch.float64), torch.randn(n, d_out, generator=g, dtype=torch.float64)


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)  # mean over items (and outputs)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    raise ValueError(name)


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, full_loss: Callable[[], torch.Tensor],
                   max_grad_norm=None) -> float:
    """One optimizer step on the whole window's mean loss; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = full_loss()
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return loss.item()


def assert_params_close(a: nn.Module, b: nn.Module, rtol: float = RTOL, atol: float = 1e-13) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def clone_pair(model: nn.Module, opt_name: str):
    ref = copy.deepcopy(model)
    return ref, make_optimizer(opt_name, model.parameters()), make_optimizer(opt_name, ref.parameters())


def concat(batches: List) -> tuple:
    return tuple(torch.cat(parts) for parts in zip(*batches))
