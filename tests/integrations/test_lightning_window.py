"""Lightning, one process: the manual-optimization recipe for a loss that couples the window's items is
one float64 big batch per window, with global_step counted; ExactAccumulation refuses a WindowLoss
returned from training_step (issue #33 item 3)."""
from __future__ import annotations

import pytest

pl = pytest.importorskip("pytorch_lightning")

from contrastive import big_batch_step, largest_difference, pair_batch, twin  # noqa: E402
from integrations.lightning_window import Contrastive, fit  # noqa: E402

TOL = 1e-12


def test_the_recipe_is_one_big_batch_per_window_with_global_step_counted():
    windows = [pair_batch(10, seed=w) for w in range(3)]
    module = Contrastive()
    ref, _, ref_opt = twin(module.encoder, "sgd")
    trainer = fit(module, windows)
    for window in windows:
        big_batch_step(ref, ref_opt, [window], max_grad_norm=0.5)
    assert largest_difference(module.encoder, ref) < TOL
    assert trainer.global_step == 3
    assert "loss" in trainer.callback_metrics


def test_exact_accumulation_refuses_a_window_loss_returned_from_training_step():
    from gradaccum.integrations.lightning import ExactAccumulation

    class Returning(Contrastive):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = True

        def on_train_start(self):
            pass

        def training_step(self, batch, batch_idx):
            return self.window_loss

    with pytest.raises(ValueError, match="training_step returned a WindowLoss.*manual optimization"):
        fit(Returning(), [pair_batch(4, seed=0)], accumulate_grad_batches=2, callbacks=[ExactAccumulation()])


def test_a_fit_resumed_from_a_checkpoint_ends_where_the_uninterrupted_one_does(tmp_path):
    """One window per epoch, a checkpoint after each; the fit resumed after epoch 2 runs epoch 3 only
    and ends bit for bit where 3 epochs in one fit end (the optimizer's momentum and the Accumulator's
    state come back from the checkpoint)."""
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint

    window = [pair_batch(10, seed=4)]
    whole = Contrastive()
    fit(whole, window, max_epochs=3)
    first = Contrastive()
    fit(first, window, max_epochs=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)])
    resumed = Contrastive()
    trainer = fit(resumed, window, max_epochs=3, ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.global_step == 3 and resumed.acc.steps == 3
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), whole.parameters()))
