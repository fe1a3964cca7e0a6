"""ExactSentenceTransformerTrainer under torchrun, 2 gloo processes (DDP): per loss family, one window of
3 rows x 4 micro-batches on each rank (24 rows, the whole dataset) equals one float64 SGD step of the
loss on all 24 rows in one batch (the reference, computed on every rank without DDP); the replicas are
identical and the stock trainer's accumulation under DDP is off."""
from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/

import torch  # noqa: E402

from distributed.worker import main, params_equal_on_all_ranks  # noqa: E402
from integrations.st_helpers import dataset, distance, fresh, losses, moved, tiny_model, train_once  # noqa: E402

RANK, WORLD = 0, 1
TOL = 1e-10
LR = 0.5
_MODELS = {}


def _models():
    if not _MODELS:  # rank 0 writes the models (transformers saves on the main process only), both load them
        import torch.distributed as dist

        shared = [tempfile.mkdtemp(prefix="st-models-") if RANK == 0 else None]
        dist.broadcast_object_list(shared)
        folder = Path(shared[0])
        if RANK == 0:
            tiny_model(folder / "model"), tiny_model(folder / "guide", seed=1)
        dist.barrier()
        _MODELS["base"] = tiny_model(folder / "model", write=False)
        _MODELS["guide"] = tiny_model(folder / "guide", seed=1, write=False)
        _MODELS["folder"] = folder / f"rank{RANK}"
    return _MODELS["base"], _MODELS["guide"], _MODELS["folder"]


def _reference(base, make, data):
    """One SGD step of the loss on every row in one batch, in this process (no DDP)."""
    model = fresh(base)
    loss_fn = make(model)
    columns = [c for c in data.column_names if c not in ("label", "score")]
    features = [model.tokenize(data[c]) for c in columns]
    labels = next((torch.tensor(data[c], dtype=torch.float64 if c == "score" else torch.long)
                   for c in ("label", "score") if c in data.column_names), None)
    loss_fn(features, labels).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return model


def _scenario(name):
    def run():
        from sentence_transformers import SentenceTransformerTrainer

        from gradaccum.integrations.sentence_transformers import ExactSentenceTransformerTrainer

        base, guide, folder = _models()
        kind, make = losses(base, guide)[name]
        data = dataset(kind, 24)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = _reference(base, make, data)
            exact = fresh(base)
            train_once(ExactSentenceTransformerTrainer, exact, make(exact), data, folder / "out", batch=3,
                       accumulation=4, lr=LR)
            stock = fresh(base)
            train_once(SentenceTransformerTrainer, stock, make(stock), data, folder / "out", batch=3, accumulation=4,
                       lr=LR)
        step = moved(base, ref)
        d_exact, d_stock = distance(moved(base, exact), step), distance(moved(base, stock), step)
        assert params_equal_on_all_ranks(exact), "replicas differ"
        assert d_exact < TOL, f"exact {d_exact:.2e}"
        assert d_stock > 1e-3, f"the stock trainer is not measurably off ({d_stock:.2e})"
        return f"exact {d_exact:.1e}, stock trainer {d_stock:.1e}"

    run.__name__ = "st_ddp_" + name.replace("(", "_").replace(")", "")
    return run


SCENARIOS = [_scenario(name) for name in losses(None, None)]

if __name__ == "__main__":
    sys.exit(main(SCENARIOS, globals()))
