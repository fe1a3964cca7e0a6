"""sentence-transformers: :class:`ExactSentenceTransformerTrainer`, one big batch for any of its losses by the
cached two passes, its loss served the cached embeddings (docs/guides/sentence-transformers.md)."""
from __future__ import annotations

import contextlib
import random
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._cached import Constant, WindowLoss
from .._patching import swapped
from ..errors import ConfigurationError
from .hf_driver import TrainerDriver, serves_the_window
from ._versions import FLOORS, require
from .hf_window_loss import TrainerWindows

require("sentence-transformers", "gradaccum.integrations.sentence_transformers")  # 6.x's module layout, below
try:
    from sentence_transformers import SentenceTransformerTrainer
    from sentence_transformers.base.model import BaseModel
    from sentence_transformers.base.losses.merged_forward import column_merging_disabled
    from sentence_transformers.sentence_transformer.losses import AdaptiveLayerLoss
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("gradaccum.integrations.sentence_transformers needs sentence-transformers: "
                      f"pip install 'sentence-transformers>={FLOORS['sentence-transformers']}'") from exc

__all__ = ["ExactSentenceTransformerTrainer", "SUPPORTED", "REFUSED"]

#: the losses tested here, through the trainer, in float64 against one big batch
SUPPORTED = ("MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss", "GISTEmbedLoss",
             "MegaBatchMarginLoss", "CoSENTLoss", "AnglELoss", "BatchAllTripletLoss", "BatchHardTripletLoss",
             "BatchSemiHardTripletLoss", "OnlineContrastiveLoss", "MatryoshkaLoss", "AdaptiveLayerLoss",
             "Matryoshka2dLoss")
#: refused by name, with the fix
REFUSED = {
    "CachedMultipleNegativesRankingLoss": "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss": "MultipleNegativesSymmetricRankingLoss",
    "CachedGISTEmbedLoss": "GISTEmbedLoss",
    "DenoisingAutoEncoderLoss": None,
    "ContrastiveTensionLoss": None, "ContrastiveTensionLossInBatchNegatives": None,
}


class ExactSentenceTransformerTrainer(TrainerDriver, SentenceTransformerTrainer):
    """A ``SentenceTransformerTrainer`` whose ``gradient_accumulation_steps`` is one big batch.

    Every optimizer step is on the gradient of ``loss(features, labels)`` computed on the whole window:
    every micro-batch of ``gradient_accumulation_steps`` on every rank, joined along the batch (rank 0's
    rows first), whatever the loss couples. With ``gradient_accumulation_steps=1`` on one process it is
    the stock trainer's step (still cached).

    What each loss gets (its own ``forward``, once per window, on every rank's cached embeddings) and what is
    refused before training, with the fix: docs/guides/sentence-transformers.md ("What each loss gets").

    Example:
        >>> args = SentenceTransformerTrainingArguments("out", per_device_train_batch_size=32,
        ...                                             gradient_accumulation_steps=8)  # doctest: +SKIP
        >>> ExactSentenceTransformerTrainer(model=model, args=args, train_dataset=ds,
        ...                                 loss=MultipleNegativesRankingLoss(model)).train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refuse_windows_mixing_datasets(self.train_dataset, self.args.gradient_accumulation_steps,
                                       self.accelerator.num_processes, self.args.multi_dataset_batch_sampler)
        for loss in (self.loss.values() if isinstance(self.loss, dict) else [self.loss]):
            refuse_a_loss(loss)
        self._windows = TrainerWindows(self, self._prepare_inputs, self._window_loss)  # refuses what it cannot run

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: Optional[torch.device] = None) -> Tuple[List[Any], Any]:
        """The Trainer's micro-batches of one window, kept for pass 1."""
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._windows.begin(batch_samples)
        return batch_samples, num_items

    @serves_the_window
    def compute_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Training: micro-batch k's surrogate; evaluation: the stock per-batch loss."""
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        loss = self._windows.surrogate(model)
        return (loss, {}) if return_outputs else loss

    def _window_loss(self, module: nn.Module, batches: List[Any]) -> Tuple[WindowLoss, List[nn.Parameter], Any]:
        """The window's loss (its dataset's), served as a WindowLoss, and the loss's own parameters."""
        name = batches[0].get("dataset_name") if batches else None  # one dataset: refused at __init__ otherwise
        loss_fn = self.loss[name] if isinstance(self.loss, dict) and name else self.loss
        served = _ServedLoss(self, loss_fn, module)
        models = {id(p) for m in [served.module, *served.guides.values()] for p in m.parameters()}
        return WindowLoss(served.encode, served.loss), [p for p in loss_fn.parameters() if id(p) not in models], None


def refuse_windows_mixing_datasets(train_dataset: Any, accumulation: int, world: int, sampler: Any) -> None:
    """Several training datasets and a window of more than one batch: refused (one batch over several datasets)."""
    if not isinstance(train_dataset, dict) or len(train_dataset) < 2 or accumulation * world == 1:
        return
    names = ", ".join(repr(str(name)) for name in train_dataset)
    first = str(next(iter(train_dataset)))
    raise ConfigurationError(
        f"ExactSentenceTransformerTrainer: train_dataset holds {len(train_dataset)} datasets ({names}) and a window "
        f"holds gradient_accumulation_steps={accumulation} x {world} process(es) batches, which the "
        f"multi_dataset_batch_sampler ({getattr(sampler, 'value', sampler)}) draws from different datasets: one window "
        "would be one big batch over several datasets (in-batch negatives across them), which sentence-transformers "
        f"never trains (each of its batches is one dataset's). Train one dataset per run (train_dataset=train_dataset"
        f"[{first!r}]), concatenate them into one Dataset if a batch should mix them (datasets.concatenate_datasets), "
        "or set gradient_accumulation_steps=1 on one process")


def refuse_a_loss(loss: nn.Module) -> None:
    """A loss this trainer cannot make one big batch, refused by name with the fix."""
    for module in loss.modules():
        name = type(module).__name__
        if isinstance(module, AdaptiveLayerLoss) and module is not loss:
            raise ConfigurationError(f"ExactSentenceTransformerTrainer: {name} inside another loss is not supported; "
                                     "make it the outermost loss")
        if name in REFUSED:
            twin = REFUSED[name]
            fix = (f"use {twin}: ExactSentenceTransformerTrainer caches the embeddings of the whole window "
                   "(gradient_accumulation_steps micro-batches, every rank) itself") if twin else (
                "it reads more than the sentence embeddings (token or layer outputs); train it with "
                "SentenceTransformerTrainer and gradient_accumulation_steps=1")
            raise ConfigurationError(f"ExactSentenceTransformerTrainer: loss {name} is not supported: {fix}")
        if getattr(module, "must_retokenize", False):
            raise ConfigurationError(f"ExactSentenceTransformerTrainer: {name}'s guide re-tokenizes the text (its "
                                     "tokenizer differs from the model's), which cached embeddings cannot serve; "
                                     "use a guide with the model's tokenizer")
        if getattr(module, "uses_gradient_cache", False) and not hasattr(module, "forward_non_mini_batched"):
            raise ConfigurationError(f"ExactSentenceTransformerTrainer: loss {name} caches mini-batches itself; use "
                                     "its non-cached twin, which this trainer caches over the whole window")


def _is_model(child: Any) -> bool:
    return isinstance(child, (BaseModel, nn.parallel.DistributedDataParallel))


def _loss_modules(module: nn.Module) -> List[nn.Module]:
    """The loss and the losses it wraps, not the models they hold."""
    return [module] + [m for child in module.children() if not _is_model(child) for m in _loss_modules(child)]


class _Served(nn.Module):
    """A model inside the loss: ``model(features)`` returns the cached embeddings of the rows ``features``
    names (AdaptiveLayerLoss: of the ``layer``, every one served recorded for its KL term)."""

    def __init__(self, columns: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.table = torch.cat(list(columns))
        self.layer: Optional[int] = None
        self.served: List[torch.Tensor] = []

    def forward(self, features: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        try:
            rows = self.table[features["gradaccum_rows"]]
        except KeyError:
            raise ConfigurationError("ExactSentenceTransformerTrainer: the loss runs the model on features of its "
                                     "own making (not the batch's), which cached embeddings cannot serve") from None
        embedding = rows if self.layer is None else rows[:, self.layer]
        self.served.append(embedding)
        return {"sentence_embedding": embedding}

    def get_embedding_dimension(self) -> int:
        return int(self.table.shape[-1])


class _ServedLoss:
    """A sentence-transformers loss as a WindowLoss's ``encode`` and ``loss``."""

    def __init__(self, trainer: ExactSentenceTransformerTrainer, loss_fn: nn.Module, module: nn.Module) -> None:
        self.trainer, self.loss_fn, self.module = trainer, loss_fn, module
        #: where the loss holds a model: ``(owner, attribute, key)``, key "model" for the trained one (or its DDP
        #: wrapper), else the attribute's name (GIST's guide)
        self.held = [(owner, name, "model" if child is module or getattr(child, "module", None) is module else name)
                     for owner in _loss_modules(loss_fn) for name, child in owner._modules.items() if _is_model(child)]
        # models the loss runs besides the trained one (GIST's frozen guide), by key
        self.guides = {key: getattr(owner, attr) for owner, attr, key in self.held if key != "model"}
        self.adaptive = loss_fn if isinstance(loss_fn, AdaptiveLayerLoss) else None

    def _every_layer(self, model: nn.Module, features: Dict[str, Any]) -> torch.Tensor:
        """Every layer's sentence embedding, ``(rows, layers, dim)``, as AdaptiveLayerLoss computes them."""
        with swapped(self.module[0].auto_model.config, "output_hidden_states", True):
            out = model(features)
        layers = []
        for hidden in out["all_layer_embeddings"][:-1]:
            x = {**out, "token_embeddings": hidden}
            for later in list(self.module)[1:]:
                x = later(x)
            layers.append(x["sentence_embedding"])
        return torch.stack(layers + [out["sentence_embedding"]], dim=1)

    def encode(self, model: nn.Module, inputs: Dict[str, Any]) -> Dict[str, Any]:
        inputs = {k: v for k, v in inputs.items() if k != "dataset_name"}
        features, labels = self.trainer.collect_features(inputs)
        embed = self._every_layer if self.adaptive is not None else (lambda m, f: m(f)["sentence_embedding"])
        out: Dict[str, Any] = {"model": [embed(model, dict(f)) for f in features]}
        if self.guides:
            with torch.no_grad():
                out["guides"] = {name: [Constant(g(dict(f))["sentence_embedding"]) for f in features]
                                 for name, g in self.guides.items()}
        if isinstance(labels, torch.Tensor):
            out["labels"] = Constant(labels) if labels.is_floating_point() else labels
        return out

    def loss(self, _: Any, reps: Dict[str, Any]) -> torch.Tensor:
        columns = reps["model"]
        n = columns[0].shape[0]  # column c's rows in the joined table: c * n to (c + 1) * n
        features = [{"gradaccum_rows": torch.arange(c * n, (c + 1) * n, device=columns[0].device)}
                    for c in range(len(columns))]
        served = {key: _Served(cols) for key, cols in {"model": columns, **reps.get("guides", {})}.items()}
        with contextlib.ExitStack() as stack:
            stack.enter_context(column_merging_disabled())
            for owner, name, key in self.held:
                stack.enter_context(swapped(owner, name, served[key]))
            for owner in _loss_modules(self.loss_fn):
                if getattr(owner, "gather_across_devices", False):  # the embeddings are every rank's already
                    stack.enter_context(swapped(owner, "gather_across_devices", False))
            if self.adaptive is not None:
                out = self._adaptive_layers(self.adaptive, served["model"], features, reps.get("labels"))
            else:  # a loss that caches mini-batches itself has a non-cached forward (refuse_a_loss)
                fn = self.loss_fn
                out = (fn.forward_non_mini_batched if getattr(fn, "uses_gradient_cache", False) else fn)(
                    features, reps.get("labels"))
        return torch.stack(list(out.values())).sum() if isinstance(out, dict) else out

    @staticmethod
    def _adaptive_layers(ad: Any, served: _Served, features: List[Dict[str, Any]], labels: Any) -> torch.Tensor:
        """AdaptiveLayerLoss's forward on the served layers."""
        inner, layers = ad.loss, served.table.shape[1]
        served.layer, served.served = layers - 1, []
        loss = inner(features, labels) * ad.last_layer_weight
        final = (nn.functional.softmax(torch.cat(served.served) / ad.kl_temperature, dim=-1).detach()
                 if ad.kl_temperature > 0 else None)
        indices = list(range(layers - 1))
        if 0 < ad.n_layers_per_step < layers - 1:
            indices = random.sample(indices, ad.n_layers_per_step)
        for index in indices:
            served.layer, served.served = index, []
            loss = loss + inner(features, labels) * ad.get_layer_weight(index) / len(indices) * ad.prior_layers_weight
            if final is not None:
                kl = nn.functional.kl_div(nn.functional.log_softmax(torch.cat(served.served) / ad.kl_temperature,
                                                                    dim=-1), final, reduction="batchmean")
                loss = loss + kl * ad.kl_temperature * ad.kl_div_weight
        return loss
