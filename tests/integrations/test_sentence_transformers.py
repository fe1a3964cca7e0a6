"""ExactSentenceTransformerTrainer: with gradient_accumulation_steps, each loss of issue #33 item 1 takes
the step of one big batch (float64, a tiny BERT from a config), where the stock trainer's accumulation
is another objective; the losses it cannot serve are refused by name."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")

from sentence_transformers import SentenceTransformerTrainer  # noqa: E402
from sentence_transformers.sentence_transformer import losses as L  # noqa: E402

from gradaccum.integrations.sentence_transformers import ExactSentenceTransformerTrainer  # noqa: E402
from integrations.st_helpers import big_batch, dataset, distance, fresh, losses, moved, tiny_model, train_once  # noqa: E402

TOL = 1e-10  # float64: the order of additions only


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("st")
    return tiny_model(folder / "model"), tiny_model(folder / "guide", seed=1)


NAMES = list(losses(None, None))


@pytest.mark.parametrize("name", NAMES)
def test_each_loss_is_one_big_batch_where_the_stock_trainer_is_not(models, tmp_path, name):
    """6 rows x 4 micro-batches against one batch of 24 (outside any trainer), one SGD step each."""
    base, guide = models
    kind, make = losses(base, guide)[name]
    data = dataset(kind, 24)
    big, big_loss = big_batch(base, make, data, lr=0.5)
    exact = fresh(base)
    ours = train_once(ExactSentenceTransformerTrainer, exact, make(exact), data, tmp_path, batch=6, accumulation=4)
    stock = fresh(base)
    train_once(SentenceTransformerTrainer, stock, make(stock), data, tmp_path, batch=6, accumulation=4)
    step = moved(base, big)
    assert distance(moved(base, exact), step) < TOL
    assert distance(moved(base, stock), step) > 1e-3  # the stock trainer's accumulation: another objective
    logged = [h["loss"] for h in ours.state.log_history if "loss" in h]
    assert math.isclose(logged[0], big_loss, rel_tol=1e-3)  # the Trainer logs it rounded to 4 digits


def test_several_windows_and_a_short_last_window(models, tmp_path):
    """3 steps over 40 pairs in windows of 16 (the last one holds 8): each window is its own big batch."""
    base, _ = models
    data = dataset("pairs", 40)
    exact = fresh(base)
    train_once(ExactSentenceTransformerTrainer, exact, L.MultipleNegativesRankingLoss(exact), data, tmp_path,
               batch=4, accumulation=4, steps=3)
    big = fresh(base)
    train_once(SentenceTransformerTrainer, big, L.MultipleNegativesRankingLoss(big), data, tmp_path,
               batch=16, accumulation=1, steps=3)
    assert distance(moved(base, exact), moved(base, big)) < TOL


@pytest.mark.parametrize("make, match", [
    (lambda m: L.CachedMultipleNegativesRankingLoss(m), "CachedMultipleNegativesRankingLoss is not supported: use "
                                                        "MultipleNegativesRankingLoss"),
    (lambda m: L.MatryoshkaLoss(m, L.AdaptiveLayerLoss(m, L.MultipleNegativesRankingLoss(m)), [16]),
     "AdaptiveLayerLoss inside another loss is not supported; make it the outermost loss"),
])
def test_a_loss_it_cannot_serve_is_refused_by_name_before_training(models, tmp_path, make, match):
    base, _ = models
    model = fresh(base)
    with pytest.raises(ValueError, match=match):
        train_once(ExactSentenceTransformerTrainer, model, make(model), dataset("pairs", 8), tmp_path,
                   batch=4, accumulation=2)


MIXED = ("ExactSentenceTransformerTrainer: train_dataset holds 2 datasets ('a', 'b') and a window holds "
         "gradient_accumulation_steps=4 x 1 process(es) batches, which the multi_dataset_batch_sampler ({}) draws "
         "from different datasets: one window would be one big batch over several datasets (in-batch negatives "
         "across them), which sentence-transformers never trains (each of its batches is one dataset's). Train one "
         "dataset per run (train_dataset=train_dataset['a']), concatenate them into one Dataset if a batch should mix "
         "them (datasets.concatenate_datasets), or set gradient_accumulation_steps=1 on one process")


@pytest.mark.parametrize("sampler", ["round_robin", "proportional"])
@pytest.mark.parametrize("one_loss", [True, False])
def test_several_datasets_in_windows_of_several_batches_are_refused_before_training(models, tmp_path, sampler,
                                                                                    one_loss):
    """Two datasets: the multi-dataset sampler interleaves their batches, so a window would be one big batch
    over both (in-batch negatives across datasets), which sentence-transformers never trains. With one
    loss for both (no ``dataset_name`` column) this trained silently before; refused before any step."""
    base, _ = models
    model = fresh(base)
    before = [p.detach().clone() for p in model.parameters()]
    data = {"a": dataset("pairs", 8), "b": dataset("pairs", 8, seed=1)}
    loss = (L.MultipleNegativesRankingLoss(model) if one_loss else
            {"a": L.MultipleNegativesRankingLoss(model), "b": L.MultipleNegativesRankingLoss(model)})
    with pytest.raises(ValueError) as refused:
        train_once(ExactSentenceTransformerTrainer, model, loss, data, tmp_path, batch=4, accumulation=4,
                   multi_dataset_batch_sampler=sampler)
    assert str(refused.value) == MIXED.format(sampler)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_several_datasets_one_batch_per_window_train_as_the_stock_trainer(models, tmp_path):
    """gradient_accumulation_steps=1 on one process: each window is one batch of one dataset, as the stock
    trainer's; not refused, and the step is the stock trainer's."""
    base, _ = models
    data = {"a": dataset("pairs", 8), "b": dataset("pairs", 8, seed=1)}
    ran = {}
    for cls in (ExactSentenceTransformerTrainer, SentenceTransformerTrainer):
        model = fresh(base)
        train_once(cls, model, L.MultipleNegativesRankingLoss(model), data, tmp_path / cls.__name__, batch=4,
                   accumulation=1, steps=2, multi_dataset_batch_sampler="round_robin")
        ran[cls] = moved(base, model)
    assert distance(ran[ExactSentenceTransformerTrainer], ran[SentenceTransformerTrainer]) < TOL


def test_evaluation_saving_and_resuming_stay_the_trainer_s(models, tmp_path):
    """Checkpoints every step; a run resumed from step 1 ends where the uninterrupted one does, bit for bit,
    its AccumulatorState read back from the checkpoint (the steps before the resume counted); the evaluation
    loss is the stock trainer's per-batch loss."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    base, _ = models
    data, held_out = dataset("pairs", 32), dataset("pairs", 8, seed=7)

    def run(model, steps, resume=None):
        args = SentenceTransformerTrainingArguments(
            str(tmp_path / "run"), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=steps,
            learning_rate=0.5, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, report_to="none",
            save_strategy="steps", save_steps=1, use_cpu=True, seed=0, batch_sampler="batch_sampler")
        trainer = ExactSentenceTransformerTrainer(model=model, args=args, train_dataset=data, eval_dataset=held_out,
                                                  loss=L.MultipleNegativesRankingLoss(model))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = fresh(base)
    trainer = run(whole, 2)
    stock_eval = SentenceTransformerTrainer(model=whole, args=trainer.args, eval_dataset=held_out,
                                            loss=L.MultipleNegativesRankingLoss(whole)).evaluate()["eval_loss"]
    assert math.isclose(trainer.evaluate()["eval_loss"], stock_eval, rel_tol=1e-12)
    resumed = fresh(base)
    again = run(resumed, 2, resume=str(tmp_path / "run" / "checkpoint-1"))
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), whole.parameters()))  # bit for bit
    assert (again.accumulator_state.steps, again.accumulator_state.last_window_items) == (2, 8.0)  # 1 read back
    assert trainer.accumulator_state.saved() == again.accumulator_state.saved()
    assert max(t.abs().max().item() for t in moved(base, whole)) > 1e-3  # the steps moved it


def test_a_window_whose_loss_is_not_finite_is_skipped(models, tmp_path):
    """The first forward of the only window gives nan embeddings (so the window's loss and gradient are nan):
    ExactSentenceTransformerTrainer skips it (the Trainer drivers' one verdict, on the Trainer's norm), so the
    model is the one it started from, bit for bit, and skipped counts it; the stock trainer steps on it and
    ends with nan parameters. Under nonfinite='raise' it stops there with the fix."""
    from integrations.scenarios import NanOnCall, all_finite

    base, _ = models
    data = dataset("pairs", 16)
    runs = {}
    for name, cls in (("exact", ExactSentenceTransformerTrainer), ("stock", SentenceTransformerTrainer)):
        model = fresh(base)
        model[0].auto_model.embeddings.register_forward_hook(NanOnCall(0))
        runs[name] = (model, train_once(cls, model, L.MultipleNegativesRankingLoss(model), data, tmp_path, batch=4,
                                        accumulation=4))
    exact, trainer = runs["exact"]
    assert all(torch.equal(p, q) for p, q in zip(exact.parameters(), base.parameters()))
    assert trainer.skipped == 1 and trainer.state.global_step == 0
    assert not all_finite(runs["stock"][0])

    class Raising(ExactSentenceTransformerTrainer):
        nonfinite = "raise"

    model = fresh(base)
    model[0].auto_model.embeddings.register_forward_hook(NanOnCall(0))
    with pytest.raises(FloatingPointError, match=r"Raising: the gradient of window 1 .*Raising\(nonfinite='skip'\)"):
        train_once(Raising, model, L.MultipleNegativesRankingLoss(model), data, tmp_path, batch=4, accumulation=4)
