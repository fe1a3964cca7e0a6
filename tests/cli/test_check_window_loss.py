"""gradaccum check on a loss that couples the batch's items (issue 27, item 7): --loss says the loss
is to blame and names WindowLoss; --encode with --window-loss shows WindowLoss exact on the model."""
from __future__ import annotations

import sys
import textwrap

from .test_issue19 import one_error_line

RETRIEVAL = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.ModuleDict({"query": nn.Linear(6, 8), "doc": nn.Linear(6, 8)}).double()


def sample():
    g = torch.Generator().manual_seed(1)
    return {"query": torch.randn(12, 6, generator=g, dtype=torch.float64),
            "doc": torch.randn(12, 6, generator=g, dtype=torch.float64)}


def encode(model, batch):
    return model["query"](batch["query"]), model["doc"](batch["doc"])


def loss(model, reps):  # in-batch negatives: document j is a negative of every query i != j
    q, d = (nn.functional.normalize(r, dim=-1) for r in reps)
    return nn.functional.cross_entropy(q @ d.T * 10.0, torch.arange(len(q)))


def per_micro_batch(model, batch):
    return loss(model, encode(model, batch))
"""


def test_check_names_the_coupled_loss_and_shows_window_loss_exact(tmp_path, here, monkeypatch, request):
    """In this process (``here``): what check says, not how the process ends, is the point."""
    (tmp_path / "retrieval.py").write_text(textwrap.dedent(RETRIEVAL))
    monkeypatch.setattr(sys, "path", list(sys.path))  # check puts "" in front, as `python -m` has it
    monkeypatch.syspath_prepend(str(tmp_path))  # as PYTHONPATH would
    request.addfinalizer(lambda: sys.modules.pop("retrieval", None))

    def check(*args):
        return here("check", "--model", "retrieval:build", "--batch", "retrieval:sample", "--micro-batch-size", "4",
                    "--rtol", "1e-10", *args)

    plain = check("--loss", "retrieval:per_micro_batch")
    assert plain.returncode == 1, plain.stderr
    assert "NOT equivalent" in plain.stdout and "suspect" not in plain.stdout
    assert "hint: the loss couples the batch's items" in plain.stdout and "--window-loss" in plain.stdout
    cached = check("--encode", "retrieval:encode", "--window-loss", "retrieval:loss")
    assert cached.returncode == 0, cached.stdout + cached.stderr
    assert cached.stdout.startswith("retrieval:build with WindowLoss, 12 items in 3 micro-batches of at most 4: "
                                    "equivalent"), cached.stdout
    both = check("--loss", "retrieval:per_micro_batch", "--encode", "retrieval:encode", "--window-loss", "retrieval:loss")
    assert both.returncode == 2
    one_error_line(both, "both give the loss", "keep one")
    half = check("--encode", "retrieval:encode")
    assert half.returncode == 2
    one_error_line(half, "give --window-loss too")
