"""The Lightning recipe for a loss that couples the window's items (docs/guides/lightning.md): manual
optimization, an Accumulator over Lightning's own DDP wrapper, a WindowLoss, global_step and logging
as Lightning counts them. Shared by the one-process test and the torchrun scenario (tests/distributed/coupled_trainers_worker.py)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: the contrastive helpers

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

from contrastive import DualEncoder, in_batch_negatives  # noqa: E402
from gradaccum import Accumulator, WindowLoss  # noqa: E402
from gradaccum.integrations.lightning import count_step, strategy_model  # noqa: E402


class Contrastive(pl.LightningModule):
    """Each batch Lightning hands over is this rank's share of one window, split into micro-batches."""

    def __init__(self, micro_batch_size: int = 3, max_grad_norm: float = 0.5) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = DualEncoder()
        self.micro_batch_size, self.max_grad_norm = micro_batch_size, max_grad_norm
        self.window_loss = WindowLoss(lambda model, batch: model(*batch),  # Lightning's DDP -> self.forward
                                      lambda model, reps: in_batch_negatives(*reps, self.encoder.log_scale))

    def forward(self, queries, docs):
        return self.encoder(queries, docs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def on_train_start(self):
        self.acc = Accumulator(strategy_model(self), self.optimizers().optimizer, max_grad_norm=self.max_grad_norm)
        if getattr(self, "_acc_state", None) is not None:  # resumed: the checkpoint's Accumulator state
            self.acc.load_state_dict(self._acc_state)

    def training_step(self, batch, batch_idx):
        result = self.acc.step(batch, self.window_loss, micro_batch_size=self.micro_batch_size)
        count_step(self, result)
        self.log("loss", result.loss, prog_bar=True)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["gradaccum"] = self.acc.state_dict()

    def on_load_checkpoint(self, checkpoint):
        self._acc_state = checkpoint.get("gradaccum")


def fit(module: Contrastive, windows, **trainer_kwargs) -> pl.Trainer:
    """``windows``: this rank's batches, one per window (a DataLoader with batch_size=None)."""
    import warnings

    loader = torch.utils.data.DataLoader(windows, batch_size=None)
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    trainer_kwargs.setdefault("max_epochs", 1)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer
