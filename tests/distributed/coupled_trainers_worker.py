"""Trainers with a loss that couples the batch's rows, under torchrun on 2 gloo processes (DDP), in one
launch (transformers, sentence-transformers and Lightning import once):

* ExactSentenceTransformerTrainer, per loss family: one window of 3 rows x 4 micro-batches on each rank
  (24 rows, the whole dataset) equals one float64 SGD step of the loss on all 24 rows in one batch
  (the reference, computed on every rank without DDP); the stock trainer's accumulation is off;
* ExactTrainer with CLIP's and SigLIP's own loss and with a WindowLoss of one's own, the same way;
* the Lightning recipe (manual optimization, an Accumulator over Lightning's DDP wrapper): one float64
  big batch per window on the union of both ranks' uneven shares, global_step counting windows.

Every scenario also checks that the replicas are identical.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/


from contrastive import big_batch_step as pairs_big_batch_step, largest_difference, pair_batch, twin  # noqa: E402
from distributed.launch import run_modules  # noqa: E402
from distributed.worker import params_equal_on_all_ranks  # noqa: E402
from integrations.clip_helpers import (DualEncoder, big_batch_step, clip, distance as clip_distance,  # noqa: E402
                                       own_big_batch_step, own_window_loss, pairs, train)
from integrations.st_helpers import big_batch, dataset, distance, fresh, losses, moved, tiny_model, train_once  # noqa: E402

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


def _scenario(name):
    def run():
        from sentence_transformers import SentenceTransformerTrainer

        from gradaccum.integrations.sentence_transformers import ExactSentenceTransformerTrainer

        base, guide, folder = _models()
        kind, make = losses(base, guide)[name]
        data = dataset(kind, 24)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref, _ = big_batch(base, make, data, LR)
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


def _run_hf(base, ref, **kwargs):
    from transformers import Trainer

    from gradaccum.integrations.hf_trainer import ExactTrainer

    out = Path(tempfile.mkdtemp(prefix=f"hfwl-{RANK}-"))
    rows = pairs(24, seed=5)
    exact = copy.deepcopy(base)
    train(ExactTrainer, exact, rows, out, batch=3, accumulation=4, lr=LR, **kwargs)
    d_exact = clip_distance(base, exact, ref)
    assert params_equal_on_all_ranks(exact), "replicas differ"
    assert d_exact < TOL, f"exact {d_exact:.2e}"
    note = f"exact {d_exact:.1e}"
    if not kwargs:
        stock = copy.deepcopy(base)
        train(Trainer, stock, rows, out, batch=3, accumulation=4, lr=LR)
        d_stock = clip_distance(base, stock, ref)
        assert d_stock > 1e-3, f"the stock Trainer is not measurably off ({d_stock:.2e})"
        note += f", stock Trainer {d_stock:.1e}"
    return note


def hf_ddp_clip_own_loss():
    base = clip("clip")
    return _run_hf(base, big_batch_step(base, pairs(24, seed=5), LR))


def hf_ddp_siglip_own_loss():
    base = clip("siglip")
    return _run_hf(base, big_batch_step(base, pairs(24, seed=5), LR))


def hf_ddp_window_loss_of_one_s_own():
    base = DualEncoder()
    return _run_hf(base, own_big_batch_step(base, pairs(24, seed=5), LR), compute_loss_func=own_window_loss())


SHARES = [{0: 7, 1: 4}, {0: 5, 1: 6}]  # each rank's rows per window


def lightning_ddp_window_loss_recipe():
    from pytorch_lightning.strategies import DDPStrategy

    from integrations.lightning_window import Contrastive, fit

    data = [{r: pair_batch(n, seed=10 * w + r) for r, n in shares.items()} for w, shares in enumerate(SHARES)]
    module = Contrastive()
    ref, _, ref_opt = twin(module.encoder, "sgd")
    trainer = fit(module, [window[RANK] for window in data], strategy=DDPStrategy(process_group_backend="gloo"),
                  devices=WORLD, use_distributed_sampler=False)
    for window in data:
        pairs_big_batch_step(ref, ref_opt, [window[r] for r in range(WORLD)], max_grad_norm=0.5)
    worst = largest_difference(module.encoder, ref)
    assert worst < 1e-12, worst
    assert params_equal_on_all_ranks(module.encoder)
    assert trainer.global_step == len(SHARES), trainer.global_step
    return f"2 windows, uneven shares, clipped: {worst:.1e} from one big batch"


def st_ddp_datasets_split_across_ranks_are_refused_on_every_rank():
    """Two datasets, round robin, one batch per rank per window: Accelerate gives batch i to rank i % 2, so
    rank 0's windows hold only dataset a and rank 1's only b. Each rank alone sees one dataset; together
    the gathered window would mix them. Refused on both ranks alike before training (the window is
    gradient_accumulation_steps x the processes' batches), so that no rank waits in a collective."""
    import sentence_transformers.losses as L

    from gradaccum import ConfigurationError
    from gradaccum.integrations.sentence_transformers import ExactSentenceTransformerTrainer

    base, _, folder = _models()
    model = fresh(base)
    data = {"a": dataset("pairs", 12), "b": dataset("pairs", 12, seed=1)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train_once(ExactSentenceTransformerTrainer, model, L.MultipleNegativesRankingLoss(model), data,
                       folder / "datasets", batch=3, accumulation=1, lr=LR, multi_dataset_batch_sampler="round_robin")
    except ConfigurationError as refused:
        assert "a window holds gradient_accumulation_steps=1 x 2 process(es) batches" in str(refused), refused
        return "refused on this rank"
    raise AssertionError("a window mixing datasets across the ranks was trained")


SCENARIOS = ([_scenario(name) for name in losses(None, None)]
             + [hf_ddp_clip_own_loss, hf_ddp_siglip_own_loss, hf_ddp_window_loss_of_one_s_own,
                lightning_ddp_window_loss_recipe, st_ddp_datasets_split_across_ranks_are_refused_on_every_rank])

if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
