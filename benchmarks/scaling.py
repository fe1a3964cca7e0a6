"""Sections 5 and 6: accumulation against one big batch when both fit, bf16 numerics, the floor."""
from __future__ import annotations

import copy
from typing import List

import torch
from torch import nn

from common import QUICK, ce, data, median, mlp, side_by_side

from gradaccum import Accumulator

REPEATS = 2 if QUICK else 5


def throughput() -> List[dict]:
    """One window of B items split into N micro-batches, against N = 1 in the same run."""
    rows = []
    for name, width, d_in, batch in (("compute-bound (784-2048-2048-10, B=256)", 2048, 784, 256),
                                     ("weight-bound (4096-1024-1024-10, B=32)", 1024, 4096, 32)):
        x, y = data(batch, d_in)
        fns = {}
        for n in ((1, 4, 16) if QUICK else (1, 2, 4, 8, 16, 32)):
            model = mlp(width, d_in)
            acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-4))
            fns[n] = (lambda a=acc, m=batch // n: a.step((x, y), ce, micro_batch_size=m))
        s = side_by_side({str(k): f for k, f in fns.items()}, REPEATS)
        one = median(s["1"])
        for n in fns:
            t = median(s[str(n)])
            rows.append({"model": name, "N": n, "micro_batch": batch // n, "window_ms": 1e3 * t,
                         "throughput_vs_one_batch": one / t})
    return rows


def numerics() -> List[dict]:
    """Relative gradient error against float64, micro-batches of 4 items, plain bf16 and bf16 with
    float32 accumulation buffers."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 16))
    rows = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(4 * n, 64, generator=g), torch.randn(4 * n, 16, generator=g)
        row: dict = {"N": n}
        for label, dtype, accum in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                    ("bf16 + fp32 buffers", torch.bfloat16, torch.float32)):
            model = copy.deepcopy(base).to(dtype)
            ref = copy.deepcopy(model).double()
            nn.functional.mse_loss(ref(x.to(dtype).double()), y.to(dtype).double()).backward()
            captured = {}

            class Capture(torch.optim.SGD):
                def step(self, closure=None, _m=model):  # noqa: ANN001
                    captured["g"] = torch.cat([p.grad.double().flatten() for p in _m.parameters()])

            acc = Accumulator(model, Capture(model.parameters(), lr=0.0), accum_dtype=accum)
            acc.step((x.to(dtype), y.to(dtype)), lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1].float()),
                     micro_batch_size=4)
            r = torch.cat([p.grad.flatten() for p in ref.parameters()])
            row[label] = ((captured["g"] - r).norm() / r.norm()).item()
        rows.append(row)
    return rows


def bandwidth() -> float:
    """Bytes per second of ``a += b`` on 128 MiB tensors (read a, read b, write a)."""
    a, b = torch.randn(32 * 2**20), torch.randn(32 * 2**20)
    t = median(side_by_side({"add": lambda: a.add_(b)}, 5 if QUICK else 11)["add"])
    return 3 * a.numel() * 4 / t
