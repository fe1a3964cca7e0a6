"""A tiny float64 sentence-transformers model built from a config (no download), datasets for each loss
family, and one-step runs through a trainer: shared by tests/integrations/test_sentence_transformers.py
and the torchrun scenarios (tests/distributed/coupled_trainers_worker.py)."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(45)]
HIDDEN = 16


def tiny_model(folder: Path, seed: int = 0, write: bool = True) -> Any:
    """BERT (hidden 16, 1 layer, 50 words, no dropout) behind mean pooling, float64; ``write=False``
    loads what an earlier call wrote to ``folder``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    if write:
        _write(folder, seed)
    torch.manual_seed(seed)  # the pooler transformers adds on loading is drawn alike on every rank
    model = SentenceTransformer(modules=[Transformer(str(folder)), Pooling(HIDDEN, "mean")], device="cpu")
    return model.double()


def _write(folder: Path, seed: int) -> None:
    from transformers import BertConfig, BertModel, BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizer(vocab=str(folder / "vocab.txt")).save_pretrained(folder)  # transformers 5: vocab=, not vocab_file=
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(WORDS), hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0), add_pooling_layer=False).save_pretrained(folder)


def sentences(n: int, seed: int) -> List[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 45, (int(k),), generator=g))
            for k in torch.randint(2, 8, (n,), generator=g)]


def dataset(kind: str, n: int, seed: int = 0):
    """``n`` rows of the columns a loss family takes: pairs, scored pairs, labelled sentences,
    binary pairs, triplets."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed + 1000)
    if kind == "pairs":
        return Dataset.from_dict({"anchor": sentences(n, seed), "positive": sentences(n, seed + 1)})
    if kind == "triplets":
        return Dataset.from_dict({"anchor": sentences(n, seed), "positive": sentences(n, seed + 1),
                                  "negative": sentences(n, seed + 2)})
    if kind == "scored":
        return Dataset.from_dict({"s1": sentences(n, seed), "s2": sentences(n, seed + 1),
                                  "score": torch.rand(n, generator=g, dtype=torch.float64).tolist()})
    if kind == "binary":
        return Dataset.from_dict({"s1": sentences(n, seed), "s2": sentences(n, seed + 1),
                                  "label": torch.randint(0, 2, (n,), generator=g).tolist()})
    if kind == "classes":
        return Dataset.from_dict({"sentence": sentences(n, seed), "label": [i % 4 for i in range(n)]})
    raise ValueError(kind)


def losses(model: Any, guide: Any) -> Dict[str, Callable[[Any], Any]]:
    """Each loss named in issue #33 item 1, with its dataset kind: name -> (kind, make(model))."""
    from sentence_transformers.sentence_transformer import losses as L

    return {
        "MNRL": ("triplets", lambda m: L.MultipleNegativesRankingLoss(m)),
        "MNSRL": ("pairs", lambda m: L.MultipleNegativesSymmetricRankingLoss(m)),
        "GIST": ("pairs", lambda m: L.GISTEmbedLoss(m, guide)),
        "MegaBatchMargin": ("pairs", lambda m: L.MegaBatchMarginLoss(m, mini_batch_size=5)),
        "CoSENT": ("scored", lambda m: L.CoSENTLoss(m)),
        "AnglE": ("scored", lambda m: L.AnglELoss(m)),
        "BatchAllTriplet": ("classes", lambda m: L.BatchAllTripletLoss(m)),
        "BatchHardTriplet": ("classes", lambda m: L.BatchHardTripletLoss(m)),
        "BatchSemiHardTriplet": ("classes", lambda m: L.BatchSemiHardTripletLoss(m)),
        "OnlineContrastive": ("binary", lambda m: L.OnlineContrastiveLoss(m)),
        "Matryoshka(MNRL)": ("pairs", lambda m: L.MatryoshkaLoss(m, L.MultipleNegativesRankingLoss(m), [16, 8, 4])),
        "Matryoshka(CoSENT)": ("scored", lambda m: L.MatryoshkaLoss(m, L.CoSENTLoss(m), [16, 8])),
        "AdaptiveLayer(MNRL)": ("pairs", lambda m: L.AdaptiveLayerLoss(m, L.MultipleNegativesRankingLoss(m))),
        "Matryoshka2d(CoSENT)": ("scored", lambda m: L.Matryoshka2dLoss(m, L.CoSENTLoss(m), [16, 8])),
    }


def train_once(trainer_cls: Any, model: Any, loss: Any, data: Any, out: Path, *, batch: int, accumulation: int,
               steps: int = 1, lr: float = 0.5, **extra: Any) -> Any:
    """``steps`` optimizer steps of plain SGD (no schedule), sequential rows: the trained model."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    args = SentenceTransformerTrainingArguments(
        str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, max_steps=steps,
        learning_rate=lr, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
        report_to="none", save_strategy="no", logging_steps=1, seed=0, use_cpu=True, dataloader_drop_last=False,
        batch_sampler="batch_sampler", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model=model, args=args, train_dataset=data, loss=loss)
        trainer.train()
    return trainer


def big_batch(base: Any, make: Callable[[Any], Any], data: Any, lr: float) -> Any:
    """One SGD step of the loss on every row of ``data`` in one batch, outside any trainer: the
    reference (the model after the step, and the loss)."""
    model = fresh(base)
    loss_fn = make(model)
    columns = [c for c in data.column_names if c not in ("label", "score")]
    features = [model.tokenize(data[c]) for c in columns]
    labels = next((torch.tensor(data[c], dtype=torch.float64 if c == "score" else torch.long)
                   for c in ("label", "score") if c in data.column_names), None)
    loss = loss_fn(features, labels)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return model, loss.item()


def moved(before: Any, after: Any) -> List[torch.Tensor]:
    return [a.detach() - b.detach() for a, b in zip(after.parameters(), before.parameters())]


def distance(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    """Largest parameter difference between two steps, relative to the largest change ``b`` made."""
    scale = max(t.abs().max().item() for t in b)
    return max((x - y).abs().max().item() for x, y in zip(a, b)) / scale


def fresh(model: Any) -> Any:
    return copy.deepcopy(model)
