"""Tiny float64 CLIP and SigLIP models from configs, an image-text dataset, and a dual encoder of one's
own with a WindowLoss: shared by tests/integrations/test_hf_window_loss.py and the torchrun scenarios
(tests/distributed/coupled_trainers_worker.py)."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

from gradaccum import WindowLoss

SEQ, IMAGE = 6, 8


def clip(kind: str, seed: int = 0) -> nn.Module:
    """``kind`` "clip" or "siglip": hidden 16, one layer per tower, 8x8 images in 4x4 patches."""
    from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

    torch.manual_seed(seed)
    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=SEQ)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=IMAGE,
                  patch_size=4)
    if kind == "clip":
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    else:
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
    return model.double()


def pairs(n: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """``n`` (caption, image) rows of equal length, so the default collator stacks them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (n, SEQ), generator=g)
    pixels = torch.randn(n, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64)
    return [{"input_ids": ids[i], "pixel_values": pixels[i]} for i in range(n)]


def collate(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, Any]:
    """Stacked rows, with ``return_loss=True``: what the stock Trainer needs for CLIP's own loss."""
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "pixel_values": torch.stack([r["pixel_values"] for r in rows]), "return_loss": True}


def big_batch_step(model: nn.Module, rows: List[Dict[str, torch.Tensor]], lr: float) -> nn.Module:
    """One SGD step of the model's own loss (``return_loss=True``) on every row in one batch."""
    model = copy.deepcopy(model)
    model(**collate(rows)).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return model


class DualEncoder(nn.Module):
    """A model of one's own: two towers and a temperature its loss reads (inside the model), and
    optionally dropout on the text tower's output."""

    def __init__(self, seed: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout  # on the text representation, when above 0
        torch.manual_seed(seed)
        self.text = nn.Sequential(nn.Embedding(40, 8), nn.Flatten(), nn.Linear(8 * SEQ, 8))
        self.image = nn.Sequential(nn.Flatten(), nn.Linear(3 * IMAGE * IMAGE, 8))
        self.log_scale = nn.Parameter(torch.tensor([1.0]))
        self.double()

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, **_: Any):
        text = self.text(input_ids)
        if self.dropout > 0:
            text = nn.functional.dropout(text, self.dropout, self.training)
        return text, self.image(pixel_values)


def own_loss(model: nn.Module, reps) -> torch.Tensor:
    text, image = (nn.functional.normalize(r, dim=-1) for r in reps)
    logits = text @ image.T * model.log_scale.exp().reshape(())
    target = torch.arange(len(text))
    return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target)) / 2


def own_window_loss() -> WindowLoss:
    return WindowLoss(lambda m, b: m(b["input_ids"], b["pixel_values"]), own_loss)


def own_big_batch_step(model: nn.Module, rows, lr: float) -> nn.Module:
    model = copy.deepcopy(model)
    batch = collate(rows)
    own_loss(model, model(batch["input_ids"], batch["pixel_values"])).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return model


def train(trainer_cls, model: nn.Module, rows, out: Path, *, batch: int, accumulation: int, lr: float,
          ddp_find_unused_parameters: Any = None, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    args = TrainingArguments(str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                             max_steps=1, learning_rate=lr, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
                             max_grad_norm=0.0, report_to="none", save_strategy="no", logging_steps=1, seed=0,
                             use_cpu=True, remove_unused_columns=False, dataloader_drop_last=False,
                             ddp_find_unused_parameters=ddp_find_unused_parameters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model=model, args=args, train_dataset=rows, data_collator=collate, **kwargs)
        trainer.train()
    return trainer


def distance(base: nn.Module, a: nn.Module, ref: nn.Module) -> float:
    """Largest parameter difference between two steps, relative to the largest change ``ref`` made."""
    step = [r.detach() - b.detach() for r, b in zip(ref.parameters(), base.parameters())]
    scale = max(t.abs().max().item() for t in step)
    return max((x.detach() - r.detach()).abs().max().item() for x, r in zip(a.parameters(), ref.parameters())) / scale
