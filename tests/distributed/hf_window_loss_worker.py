"""ExactTrainer with a loss that couples the batch's rows under torchrun, 2 gloo processes (DDP): CLIP's
and SigLIP's own loss and a model of one's own through a WindowLoss; one window of 3 rows x 4
micro-batches per rank (24 rows, the whole dataset) equals one float64 SGD step on all 24 rows in one
batch, computed on every rank without DDP; the replicas are identical; the stock Trainer is off."""
from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/

from distributed.worker import main, params_equal_on_all_ranks  # noqa: E402
from integrations.clip_helpers import (DualEncoder, big_batch_step, clip, distance, own_big_batch_step,  # noqa: E402
                                       own_window_loss, pairs, train)

RANK, WORLD = 0, 1
TOL = 1e-10
LR = 0.5


def _run(base, ref, **kwargs):
    from transformers import Trainer

    from gradaccum.integrations.hf_trainer import ExactTrainer

    out = Path(tempfile.mkdtemp(prefix=f"hfwl-{RANK}-"))
    rows = pairs(24, seed=5)
    exact = copy.deepcopy(base)
    train(ExactTrainer, exact, rows, out, batch=3, accumulation=4, lr=LR, **kwargs)
    d_exact = distance(base, exact, ref)
    assert params_equal_on_all_ranks(exact), "replicas differ"
    assert d_exact < TOL, f"exact {d_exact:.2e}"
    note = f"exact {d_exact:.1e}"
    if not kwargs:
        stock = copy.deepcopy(base)
        train(Trainer, stock, rows, out, batch=3, accumulation=4, lr=LR)
        d_stock = distance(base, stock, ref)
        assert d_stock > 1e-3, f"the stock Trainer is not measurably off ({d_stock:.2e})"
        note += f", stock Trainer {d_stock:.1e}"
    return note


def hf_ddp_clip_own_loss():
    base = clip("clip")
    return _run(base, big_batch_step(base, pairs(24, seed=5), LR))


def hf_ddp_siglip_own_loss():
    base = clip("siglip")
    return _run(base, big_batch_step(base, pairs(24, seed=5), LR))


def hf_ddp_window_loss_of_one_s_own():
    base = DualEncoder()
    return _run(base, own_big_batch_step(base, pairs(24, seed=5), LR), compute_loss_func=own_window_loss())


SCENARIOS = [hf_ddp_clip_own_loss, hf_ddp_siglip_own_loss, hf_ddp_window_loss_of_one_s_own]

if __name__ == "__main__":
    sys.exit(main(SCENARIOS, globals()))
