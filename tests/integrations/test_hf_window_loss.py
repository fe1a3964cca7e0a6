"""ExactTrainer with a loss that couples the batch's rows: CLIPModel and SiglipModel (their own loss,
``return_loss``) and a model of one's own through ``compute_loss_func=WindowLoss(...)``: with
gradient_accumulation_steps the step is one float64 big batch's, where the stock Trainer's is not."""
from __future__ import annotations

import copy

import torch

import pytest

pytest.importorskip("transformers")
from transformers import Trainer  # noqa: E402

from gradaccum.integrations.hf_trainer import ExactTrainer  # noqa: E402
from integrations.clip_helpers import (DualEncoder, big_batch_step, clip, distance, own_big_batch_step,  # noqa: E402
                                       own_window_loss, pairs, train)

TOL = 1e-10
LR = 0.5


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_a_contrastive_model_s_own_loss_is_one_big_batch(tmp_path, kind):
    base = clip(kind)
    rows = pairs(24)
    ref = big_batch_step(base, rows, LR)
    exact = copy.deepcopy(base)
    train(ExactTrainer, exact, rows, tmp_path, batch=6, accumulation=4, lr=LR)
    stock = copy.deepcopy(base)
    train(Trainer, stock, rows, tmp_path, batch=6, accumulation=4, lr=LR)
    assert distance(base, exact, ref) < TOL
    assert distance(base, stock, ref) > 1e-3  # the stock Trainer's accumulation: another objective


def test_a_model_of_one_s_own_through_a_window_loss(tmp_path):
    base = DualEncoder()
    rows = pairs(24, seed=3)
    ref = own_big_batch_step(base, rows, LR)
    exact = copy.deepcopy(base)
    trainer = train(ExactTrainer, exact, rows, tmp_path, batch=5, accumulation=5, lr=LR,
                    compute_loss_func=own_window_loss())
    assert distance(base, exact, ref) < TOL
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 1
    # what the window taught lives in the trainer's one AccumulatorState (saved with its checkpoint)
    state = trainer.accumulator_state
    assert (state.steps, state.skipped, state.last_window_items) == (trainer.state.global_step, 0, 24)
    assert trainer.window_loss in state.checked_replays


def test_find_unused_parameters_is_refused_with_a_window_loss(tmp_path):
    """DDP(find_unused_parameters=True) would reduce the temperature before the loss's gradient reaches it."""
    with pytest.raises(ValueError, match="ddp_find_unused_parameters=True makes DDP reduce a parameter"):
        train(ExactTrainer, DualEncoder(), pairs(8), tmp_path, batch=4, accumulation=2, lr=LR,
              compute_loss_func=own_window_loss(), ddp_find_unused_parameters=True)


def test_the_first_micro_batch_s_graph_is_kept_one_forward_saved_per_window(tmp_path):
    """5 micro-batches: 5 forwards in pass 1 (micro-batch 0's with its graph, in the Trainer's call for
    it), 4 in pass 2; the step is still the big batch's (the test above)."""
    from gradaccum import WindowLoss
    from integrations.clip_helpers import own_loss

    calls = []

    def encode(m, b):
        calls.append(torch.is_grad_enabled())
        return m(b["input_ids"], b["pixel_values"])

    train(ExactTrainer, DualEncoder(), pairs(24, seed=3), tmp_path, batch=5, accumulation=5, lr=LR,
          compute_loss_func=WindowLoss(encode, own_loss))
    assert calls == [True, False, False, False, False, True, True, True, True]


def test_a_contrastive_model_without_return_loss_has_its_eval_loss(tmp_path):
    """CLIP's batches without ``return_loss`` (ExactTrainer does not need it to train): ``evaluate()``
    still reports ``eval_loss``, the stock Trainer's with ``return_loss=True`` (once silently absent)."""
    from transformers import TrainingArguments

    from integrations.clip_helpers import collate

    def without_return_loss(rows):
        return {k: v for k, v in collate(rows).items() if k != "return_loss"}

    model, held_out = clip("clip"), pairs(10, seed=5)
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=4, report_to="none", use_cpu=True,
                             remove_unused_columns=False)
    exact = ExactTrainer(model=model, args=args, eval_dataset=held_out, data_collator=without_return_loss).evaluate()
    stock = Trainer(model=model, args=args, eval_dataset=held_out, data_collator=collate).evaluate()
    assert "eval_loss" not in Trainer(model=model, args=args, eval_dataset=held_out,
                                      data_collator=without_return_loss).evaluate()  # what the stock one does
    assert exact["eval_loss"] == pytest.approx(stock["eval_loss"], rel=1e-12)


def plain_loss(outputs, labels, num_items_in_batch=None):
    return outputs.logits.mean()


def test_a_plain_compute_loss_func_is_refused_naming_window_loss(tmp_path):
    with pytest.raises(ValueError) as refused:
        train(ExactTrainer, DualEncoder(), pairs(8), tmp_path, batch=4, accumulation=2, lr=LR,
              compute_loss_func=plain_loss)
    assert str(refused.value) == (
        "ExactTrainer(compute_loss_func=plain_loss): ExactTrainer cannot weigh a loss whose reduction it does not "
        "know. A loss that couples the batch's rows (in-batch negatives, contrastive) goes in as compute_loss_func="
        "gradaccum.WindowLoss(encode, loss), run over the whole window; for the model's own loss drop "
        "compute_loss_func (ExactTrainer computes it), or use Trainer")


def test_calling_a_window_loss_on_one_micro_batch_refuses_with_the_fix():
    """As calling an MoELoss does: a loss over the window run per micro-batch would be another objective."""
    from gradaccum import ConfigurationError

    with pytest.raises(ConfigurationError) as refused:
        own_window_loss()(DualEncoder(), pairs(4)[0])
    assert str(refused.value) == (
        "WindowLoss was called as a loss_fn on one micro-batch; its loss couples the whole window's items, so pass "
        "it to acc.step(...) or acc.train(...), or ExactTrainer(compute_loss_func=...), which run the window "
        "(encode and loss are its attributes, to call them yourself)")


def test_dropout_is_replayed_in_the_trainer_and_a_replay_that_differs_is_refused(tmp_path, monkeypatch):
    """With dropout, the reference is the window's micro-batches run as one graph from the random state
    pass 1 started from: pass 2 draws pass 1's masks. Without the replay the first window refuses."""
    from gradaccum import ReplayError, WindowLoss
    from gradaccum import _random
    from integrations.clip_helpers import own_loss

    seen = []

    def encode(m, b):
        if len(seen) < 4:  # pass 1: the random state before it, and the micro-batches in order
            seen.append((torch.get_rng_state() if not seen else None, b))
        return m(b["input_ids"], b["pixel_values"])

    base = DualEncoder(dropout=0.3)
    exact = copy.deepcopy(base)
    train(ExactTrainer, exact, pairs(16, seed=3), tmp_path, batch=4, accumulation=4, lr=LR,
          compute_loss_func=WindowLoss(encode, own_loss))
    ref = copy.deepcopy(base)
    torch.set_rng_state(seen[0][0])
    reps = [ref(b["input_ids"], b["pixel_values"]) for _, b in seen]
    own_loss(ref, [torch.cat([r[i] for r in reps]) for i in range(2)]).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    assert distance(base, exact, ref) < TOL

    monkeypatch.setattr(_random.RandomState, "restore", lambda self: None)
    broken = copy.deepcopy(base)
    with pytest.raises(ReplayError, match="second forward gave other representations"):
        train(ExactTrainer, broken, pairs(16, seed=3), tmp_path, batch=4, accumulation=4, lr=LR,
              compute_loss_func=own_window_loss())
    assert all(torch.equal(a, b) for a, b in zip(broken.parameters(), base.parameters()))  # no step


def test_the_accumulator_and_exact_trainer_run_one_implementation(tmp_path, monkeypatch):
    """Both drivers' windows are CachedPasses' steps, in the same order: pass 1, gather, the loss's
    gradient, one part per micro-batch, the replay check (the Trainer through surrogate)."""
    from gradaccum import Accumulator, _cached

    calls = []
    for name in ("first_pass", "gather", "loss_gradient", "part", "finish"):
        def spy(self, *a, _name=name, _method=getattr(_cached.CachedPasses, name), **k):
            calls.append(_name)
            return _method(self, *a, **k)
        monkeypatch.setattr(_cached.CachedPasses, name, spy)
    expected = ["first_pass", "gather", "loss_gradient"] + ["part"] * 4 + ["finish"]

    model = DualEncoder()
    batch = {k: torch.stack([r[k] for r in pairs(16, seed=3)]) for k in ("input_ids", "pixel_values")}
    Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR)).step(batch, own_window_loss(), micro_batch_size=4)
    assert calls == expected
    calls.clear()
    train(ExactTrainer, DualEncoder(), pairs(16, seed=3), tmp_path, batch=4, accumulation=4, lr=LR,
          compute_loss_func=own_window_loss())
    assert calls == expected


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_a_contrastive_model_s_window_loss_in_one_s_own_loop_is_one_big_batch(kind):
    """``gradaccum.losses.contrastive_window_loss`` is the same loss ExactTrainer trains with, for an
    Accumulator too: one step over 4 uneven micro-batches equals the model's own loss on every row,
    where averaging each micro-batch's own loss (plain accumulation) does not."""
    from gradaccum import Accumulator
    from gradaccum.losses import contrastive_window_loss
    from integrations.clip_helpers import collate

    base, rows = clip(kind), pairs(22, seed=5)
    ref = big_batch_step(base, rows, LR)
    exact = copy.deepcopy(base)
    batches = [collate(rows[a:b]) for a, b in ((0, 4), (4, 11), (11, 17), (17, 22))]
    Accumulator(exact, torch.optim.SGD(exact.parameters(), lr=LR)).step(batches, contrastive_window_loss(exact))
    stock = copy.deepcopy(base)
    for b in batches:  # each micro-batch's own loss, weighted by its rows
        (stock(**b).loss * len(b["input_ids"]) / len(rows)).backward()
    with torch.no_grad():
        for p in stock.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    assert distance(base, exact, ref) < TOL
    assert distance(base, stock, ref) > 1e-3
    assert contrastive_window_loss(torch.nn.Linear(2, 2)) is None
