"""ExactSentenceTransformerTrainer: with gradient_accumulation_steps, each loss of issue #33 item 1 takes
the step of one big batch (float64, a tiny BERT from a config), where the stock trainer's accumulation
is another objective; the losses it cannot serve are refused by name."""
from __future__ import annotations

import math

import pytest

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


def test_a_window_mixing_datasets_is_refused_when_it_reaches_the_loss(models, tmp_path):
    """Two datasets (the proportional sampler interleaves them): a coupled loss is one dataset's big batch."""
    base, _ = models
    model = fresh(base)
    data = {"a": dataset("pairs", 8), "b": dataset("pairs", 8, seed=1)}
    loss = {"a": L.MultipleNegativesRankingLoss(model), "b": L.MultipleNegativesRankingLoss(model)}
    with pytest.raises(ValueError, match=r"one window holds micro-batches of several datasets \(this rank: \['a', 'b'\]"):
        train_once(ExactSentenceTransformerTrainer, model, loss, data, tmp_path, batch=4, accumulation=4,
                   multi_dataset_batch_sampler="round_robin")


def test_evaluation_saving_and_resuming_stay_the_trainer_s(models, tmp_path):
    """Checkpoints every step; a run resumed from step 1 ends where the uninterrupted one does; the
    evaluation loss is the stock trainer's per-batch loss."""
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
    run(resumed, 2, resume=str(tmp_path / "run" / "checkpoint-1"))
    assert distance(moved(base, resumed), moved(base, whole)) < TOL
