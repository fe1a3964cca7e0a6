"""The command line's models. None has dropout or BatchNorm, so any split of a batch gives the same
gradient: accumulation is exactly one big batch on them (``gradaccum check`` confirms it)."""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigurationError
from . import MODELS

__all__ = ["MODELS", "build_model", "LeNet5", "MLP", "TinyTransformer"]


class LeNet5(nn.Module):
    """Seed 000's LeNet-5 on 32x32 inputs; other sizes are resized to 32x32 first."""

    def __init__(self, num_classes: int = 10, in_shape: Tuple[int, ...] = (1, 32, 32)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_shape[0], 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (32, 32):
            x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class MLP(nn.Module):
    """Seed 001's network: flatten, 512, 512, 10 (784 inputs on MNIST, 64 on digits)."""

    def __init__(self, num_classes: int = 10, in_shape: Tuple[int, ...] = (1, 28, 28)) -> None:
        super().__init__()
        n_in = 1
        for d in in_shape:
            n_in *= d
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(n_in, 512), nn.ReLU(), nn.Linear(512, 512),
                                 nn.ReLU(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyTransformer(nn.Module):
    """A small byte-level causal transformer (pre-norm, no dropout)."""

    def __init__(self, vocab: int = 256, max_len: int = 64, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device, dtype=h.dtype)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def build_model(name: str, task: str, **kwargs: Any) -> nn.Module:
    if name not in MODELS:
        raise ConfigurationError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")
    if (name == "transformer") != (task == "text"):
        raise ConfigurationError(f"--model {name} does not fit --task {task}: use transformer for text, "
                         "lenet5 or mlp for digits, mnist5k and mnist")
    if name == "lenet5":
        return LeNet5(kwargs["num_classes"], kwargs["in_shape"])
    if name == "mlp":
        return MLP(kwargs["num_classes"], kwargs["in_shape"])
    return TinyTransformer(kwargs["vocab"], kwargs["max_len"])
