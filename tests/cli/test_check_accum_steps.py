"""gradaccum check --accum-steps N on your own model (issue #40 item 10): it was listed for check and
refused with one's own --model; it now splits --batch into N micro-batches of one size, as a user runs
it (a subprocess), and an N that cannot be honoured is refused naming one that can."""
from __future__ import annotations

import sys
import textwrap

import pytest

from distributed.launch import run_cli

from .test_issue19 import one_error_line

MODEL = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).double()


def sample():
    g = torch.Generator().manual_seed(1)
    return torch.randn(10, 5, generator=g, dtype=torch.float64), torch.randn(10, 1, generator=g, dtype=torch.float64)


def loss_fn(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])
"""
OWN = ("check", "--model", "mynet:build", "--batch", "mynet:sample", "--loss", "mynet:loss_fn", "--rtol", "1e-10")


@pytest.fixture
def mynet(tmp_path, monkeypatch, request):
    (tmp_path / "mynet.py").write_text(textwrap.dedent(MODEL))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: sys.modules.pop("mynet", None))
    return tmp_path


def test_accum_steps_splits_your_batch_as_a_user_runs_it(mynet):
    proc = run_cli([*OWN, "--accum-steps", "4"], cwd=mynet, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("mynet:build, 10 items in 4 micro-batches of at most 3: equivalent"), proc.stdout


@pytest.mark.parametrize("n, size", [(2, 5), (5, 2), (10, 1)])
def test_accum_steps_gives_n_micro_batches(mynet, here, n, size):
    proc = here(*OWN, "--accum-steps", str(n), cwd=mynet)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"mynet:build, 10 items in {n} micro-batches of at most {size}: equivalent"), \
        proc.stdout


@pytest.mark.parametrize("args, words", [
    (["--accum-steps", "6"], ("--accum-steps 6 does not split 10 items into 6 micro-batches of one size",
                              "at most 2 each makes 5", "pass --accum-steps 5")),
    (["--accum-steps", "11"], ("--accum-steps 11 is more micro-batches than --batch mynet:sample's 10 items",
                               "pass --accum-steps 10 or less")),
    (["--accum-steps", "0"], ("--accum-steps must be 1 or more", "got 0")),
    (["--accum-steps", "1"], ("gives one micro-batch", "pass --accum-steps 2 or more")),
    (["--accum-steps", "4", "--micro-batch-size", "5"], ("--micro-batch-size 5 and --accum-steps 4 disagree",
                                                         "give one of the two")),
])
def test_an_accum_steps_that_cannot_be_honoured_is_refused_with_one_that_can(mynet, here, args, words):
    proc = here(*OWN, *args, cwd=mynet)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    one_error_line(proc, *words)


def test_agreeing_accum_steps_and_micro_batch_size_are_one_split(mynet, here):
    proc = here(*OWN, "--accum-steps", "4", "--micro-batch-size", "3", cwd=mynet)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 items in 4 micro-batches of at most 3" in proc.stdout
