"""Hugging Face ``Trainer``: :class:`ExactTrainer`, every optimizer step one big batch, for every head and for the
trainers built on it (``class ExactSFT(ExactTrainer, SFTTrainer)``, ExactTrainer first). This module says what a
batch's items are; the window is :class:`~gradaccum.integrations.hf_driver.TrainerDriver`'s."""
from __future__ import annotations

import itertools
import numbers
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from .._batch_items import HEADS, BatchItems, SetMean, check_head
from .._cached import window_loss_of_batch
from ..accumulator import driver_buffers
from ..errors import ConfigurationError, NotExactError
from .hf_driver import TrainerDriver, TrainerWindowState, calls_next, refuse_untested, serves_the_window
from transformers import Trainer  # after hf_driver, which refuses a transformers too old or missing with the fix

from . import hf_deepspeed, hf_window_loss
from .hf_moe import trl_aux_refusal, trl_router_balance
from .hf_router import aux_term, refuse_aux_term

__all__ = ["ExactTrainer", "HEADS", "SOURCES", "TrainerWindowState", "head_of", "loss_source"]

#: where a Trainer's loss comes from, by the class whose ``compute_loss`` it runs: its items, and how
#: that ``compute_loss`` reduces over them ("head": ExactTrainer computes the model's loss itself;
#: "tokens": a summed next-token loss divided by ``num_items_in_batch``; "pairs"/"rows": a mean over
#: the batch's preference pairs (chosen rows then rejected rows) or its rows along dim 0)
SOURCES = {"transformers.trainer.Trainer": "head", "trl.trainer.sft_trainer.SFTTrainer": "tokens",
           "trl.trainer.dpo_trainer.DPOTrainer": "pairs"}
_GENERATES = (" generates its micro-batches inside training_step (a batch is a list of prompts until then), so "
              "ExactTrainer cannot count them")
#: the Trainers ExactTrainer cannot weigh (by the compute_loss owner's qualified name, or its package): why, the drop-in
_DROP_INS = {"trl.trainer.grpo_trainer.GRPOTrainer": (_GENERATES, "gradaccum.integrations.trl import ExactGRPOTrainer"),
             "trl.trainer.rloo_trainer.RLOOTrainer": (_GENERATES, "gradaccum.integrations.trl import ExactRLOOTrainer"),
             "sentence_transformers.": ("'s losses couple the batch's rows (in-batch negatives, CoSENT, triplet mining), so "
                                        "no weighting of micro-batches makes them one big batch", "gradaccum.integrations."
                                        "sentence_transformers import ExactSentenceTransformerTrainer")}
_NOT_PER_PAIR = ("sft", "aot", "aot_unpaired")  # DPO loss types over the whole micro-batch, not per pair


def loss_source(cls: type) -> str:
    """How ``cls`` (a subclass of :class:`ExactTrainer`) gets its loss: the :data:`SOURCES` entry of the first
    class after ExactTrainer in its MRO that defines ``compute_loss``, or what ``cls`` declares in ``exact_items``
    for a ``compute_loss`` of its own, whose mean ExactTrainer weighs (docs/guides/hf-trainer.md, "What it computes").

    Raises:
        TypeError: a Trainer subclass comes before ExactTrainer in the MRO, or the ``compute_loss`` that runs
            is one whose reduction is not known and not declared.
    """
    mro, here = cls.__mro__, cls.__mro__.index(ExactTrainer)
    wrong = [c for c in mro[:here] if issubclass(c, Trainer) and not issubclass(c, ExactTrainer)]
    if wrong:
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        raise TypeError(
            f"class {cls.__name__}({bases}): ExactTrainer must come first among the base classes, before "
            f"{wrong[0].__name__} (whose compute_loss would otherwise run with ExactTrainer's window count: a step "
            f"1/W or W times off). Write class {cls.__name__}(ExactTrainer, {wrong[0].__name__})")
    owner = next(c for c in mro[here + 1:] if "compute_loss" in vars(c))
    qualname = f"{owner.__module__}.{owner.__qualname__}"
    declared = getattr(cls, "exact_items", None)
    drop_in = _DROP_INS.get(qualname) or _DROP_INS.get(owner.__module__.split(".")[0] + ".")
    if drop_in:
        raise TypeError(f"class {cls.__name__}: {owner.__name__}{drop_in[0]}, and "
                        f"exact_items = 'rows' would not make it exact. Use the drop-in: from {drop_in[1]}")
    if declared is not None:
        if cls.own_loss is None and qualname in SOURCES:
            raise TypeError(
                f"{cls.__name__}.exact_items={declared!r} declares a compute_loss of its own, but the compute_loss that "
                f"runs is {owner.__name__}'s, whose items ExactTrainer knows ({SOURCES[qualname]}): weighed "
                f"as {declared!r} they would be weighed wrong. Drop exact_items, or define the compute_loss it declares")
        if declared not in ("head", "rows"):  # what a subclass may declare
            raise TypeError(f"{cls.__name__}.exact_items={declared!r}: supported are 'head' (compute_loss returns the "
                            "mean over the items the model's head counts, as model(**inputs).loss) and 'rows' (the "
                            "mean over the batch's rows along dim 0)")
        return declared
    source = SOURCES.get(qualname)
    if source is None:
        known = ", ".join(name.rsplit(".", 1)[1] for name in SOURCES)
        raise TypeError(
            f"ExactTrainer cannot tell how {owner.__name__}.compute_loss reduces its loss, so it cannot weigh "
            f"micro-batches by their items. Supported: {known}. Where compute_loss returns the mean of one term per "
            f"row (dim 0), each row's term independent of the other rows, declare it: class {cls.__name__}(...): "
            "exact_items = 'rows' ('head' for the mean over the items the model's head counts). A weighted mean "
            "(cross_entropy(weight=class_weights) divides by the batch's summed weights) and a loss that couples the "
            "rows (in-batch negatives, CLIP, CoSENT, triplet mining) are not means of independent terms per row: "
            "weighed by rows they are not one big batch; pass such a loss as a gradaccum.WindowLoss, "
            "ExactTrainer(compute_loss_func=WindowLoss(...)) (see docs/guides/contrastive.md)")
    return source


def head_of(model: nn.Module, head: Optional[str] = None) -> str:
    """The :data:`HEADS` entry of a Hugging Face model, from its class (PEFT and compile unwrapped); ``head``
    where given, once it fits that entry.

    Raises:
        ConfigurationError: the class is none of the Auto mappings' causal-LM, masked-LM, token- or
            sequence-classification classes (pass ``head=`` to ExactTrainer), or ``head`` does not fit it.
    """
    from transformers.models.auto import modeling_auto as auto

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    base = getattr(base, "_orig_mod", base)
    name = type(base).__name__

    heads = [known for known, mapping in (
        ("causal_lm", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("sequence_classification", auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
        ("token_classification", auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
        ("masked_lm", auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES))
        if any(name in ((v,) if isinstance(v, str) else v) for v in mapping.values())]
    if head is None and not heads:
        raise ConfigurationError(f"ExactTrainer cannot tell the head of {name}; pass head= one of {', '.join(HEADS)} "
                                 "(ExactTrainer computes that head's standard loss from the model's logits; a loss the "
                                 "model's own forward computes, with class weights, an extra term or labels of its own "
                                 "such as question answering's start_positions, is not what it trains: compute it in a "
                                 "compute_loss of your own and declare exact_items)")
    if head is not None and heads and head not in heads:
        raise ConfigurationError(
            f"ExactTrainer(head={head!r}) does not fit the model, a {name}, whose head is {heads[0]} (its logits "
            f"and labels are shaped for that head, not for {head}): pass head={heads[0]!r}, or leave head= out "
            "(ExactTrainer reads it from the model's class)")
    return heads[0] if head is None else head


class ExactTrainer(TrainerDriver, Trainer):
    """A ``transformers.Trainer`` whose gradient accumulation is exactly one big batch.

    Every optimizer step is on the gradient of the item-weighted mean loss over the window, every
    micro-batch k on every rank::

        grad = sum_{ranks, k} grad(S_k) / N,    S_k = n_k L_k,    N = sum_{ranks, k} n_k

    with ``L_k`` micro-batch k's mean loss over its ``n_k`` items (how, and what an item is by loss
    source: :func:`loss_source` and docs/guides/hf-trainer.md). The logged ``loss`` is the window's
    mean over all ranks; ``eval_loss`` the item-weighted mean over the whole evaluation set.
    ``skipped`` counts the windows skipped: of ``N = 0``, or whose gradient was not finite.

    Args:
        *args: As for ``transformers.Trainer`` (or the subclass).
        head: One of :data:`HEADS`, where ExactTrainer computes the loss itself. Default: read from
            the model's class (:func:`head_of`).
        ignore_index: Label value that is not a target. Default -100.
        accum_dtype: ``"auto"`` (default) or ``"param"``: where bf16/fp16 parameters sum the window
            (docs/guides/deepspeed.md, "bf16 and fp16 parameters").
        nonfinite: ``"skip"`` (default) a window whose loss or gradient is not finite (a nan or inf in any
            micro-batch, read from the gradient norm the Trainer measures before it steps): no optimizer or
            scheduler step, ``global_step`` not advanced, ``skipped`` counts it, a warning once; or ``"raise"``
            ``FloatingPointError`` at that window. None: the class attribute ``nonfinite`` (``"skip"``). With an
            fp16 loss scaler the scaler skips an overflowing step itself; under DeepSpeed the engine.
        **kwargs: As for the Trainer; ``compute_loss_func`` only as a :class:`~gradaccum.WindowLoss`
            (``CLIPModel`` and ``SiglipModel`` get theirs without it: docs/guides/hf-trainer.md, "CLIP,
            SigLIP and other losses that couple the batch").

    Raises:
        ValueError: a set-up that would not be one big batch, or is not tested here, with the fix, before
            training (docs/guides/hf-trainer.md, "Limits" and "Sharded training"); a batch without
            ``labels``, a model that returns no ``logits``.

    Example:
        >>> args = TrainingArguments("out", per_device_train_batch_size=8, gradient_accumulation_steps=4)  # doctest: +SKIP
        >>> ExactTrainer(model=model, args=args, train_dataset=ds, data_collator=collator).train()  # doctest: +SKIP
    """

    exact_items: Optional[str] = None  # a subclass's declaration for a compute_loss of its own (see loss_source)
    own_loss: Optional[Callable[..., Any]] = None  # a subclass's compute_loss that it declared, called by ExactTrainer
    own_loss_fix = (", or compute the whole loss yourself without super() and declare what it is a mean over: "
                    "exact_items = 'head' (the items the model's head counts, as model(**inputs).loss does) or "
                    "'rows' (the batch's rows; not for a class-weighted mean, which divides by the summed weights: "
                    "pass that loss as a gradaccum.WindowLoss)")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        owner = next(c for c in cls.__mro__ if "compute_loss" in vars(c))  # the class whose compute_loss runs
        own = vars(owner)["compute_loss"]
        if cls.exact_items is not None and not getattr(own, "gradaccum_driver", False):  # not a driver's
            if calls_next(own, "compute_loss"):
                raise TypeError(
                    f"class {cls.__name__} declares exact_items = {cls.exact_items!r} and {owner.__name__}.compute_loss "
                    "calls super().compute_loss: ExactTrainer calls a declared compute_loss itself, in training and "
                    "in evaluation, and weighs the mean it returns, so it must not call ExactTrainer's. Remove the "
                    "super() call (eval_loss is then your loss, item-weighted over the set), or drop exact_items and "
                    "return super().compute_loss(...)'s loss unchanged")
            cls.own_loss = own  # the mean it declares, weighed by ExactTrainer's compute_loss, which runs instead
            cls.compute_loss = vars(ExactTrainer)["compute_loss"]  # type: ignore[method-assign]
        super().__init_subclass__(**kwargs)  # refuses other overrides that would step plain accumulation
        loss_source(cls)  # refuse a wrong composition where it is written

    def __init__(self, *args: Any, head: Optional[str] = None, ignore_index: int = -100, accum_dtype: str = "auto",
                 nonfinite: Optional[str] = None, **kwargs: Any) -> None:
        source = loss_source(type(self))
        self.window_loss = hf_window_loss.window_loss_of(kwargs, args, source)  # CLIP's, SigLIP's, a WindowLoss
        check_head(head)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
            raise ConfigurationError(f"ExactTrainer(ignore_index={ignore_index!r}) must be an int: the label value "
                                     "the data collator pads with (default -100)")
        ignore_index = int(ignore_index)
        driver_buffers("ExactTrainer", (), accum_dtype, owns_the_sum=True, fix="")  # a bad name, before the Trainer
        super().__init__(*args, nonfinite=nonfinite, **kwargs)
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        _refuse_what_is_not_exact(self, config, source, accum_dtype)
        owns = self.accelerator.num_processes == 1 and not self.is_fsdp_enabled and self.window_loss is None
        self.buffers = None if self.is_deepspeed_enabled else driver_buffers(
            type(self).__name__, self.model.parameters(), accum_dtype, owns_the_sum=owns,
            fix="Keep float32 parameters and train with bf16=True (autocast) to sum in float32 (under DDP/FSDP2 the "
                "wrapper owns the sum), or pass accum_dtype='param' to accept it without this warning")
        counted_head = source == "head" and self.window_loss is None
        self.items = BatchItems(source, head_of(self.model, head) if counted_head else head, ignore_index, config,
                                self.args.device)
        # an MoE model's load-balancing term over the window: a causal LM's own loss adds it; SFT's as TRL turns it on
        # (its router_aux_loss_coef rewrites the config, so that argument is the fix a refusal names)
        self.router_balance = (trl_router_balance(self) if source == "tokens" else
                               aux_term(config) if self.items.head == "causal_lm" and self.own_loss is None else None)
        self._first_counts: List[Any] = []  # the first window's items per micro-batch, as get_batch_samples counted them
        self._inputs_unchecked = True
        self._evaluation = SetMean(self.items, self.accelerator.gather_for_metrics)
        self._windows = None if self.window_loss is None else hf_window_loss.TrainerWindows(
            self, self._prepare_inputs, lambda module, batches: (self.window_loss, list(module.parameters()), module))

    @property
    def head(self) -> Any:
        """The head whose loss ExactTrainer computes (None where the trainer computes it)."""
        return self.items.head

    def window_steps(self) -> bool:
        """Whether the window being trained takes an optimizer step (it holds items; True before any window)."""
        return not (self._window is not None and self._window.empty)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: Optional[torch.device] = None) -> Tuple[List[Any], Optional[torch.Tensor]]:
        """The window's micro-batches and ``N``, their items summed over every rank: the window opens counted."""
        batch_samples = list(itertools.islice(epoch_iterator, num_batches))
        if self._windows is not None:  # a WindowLoss: one mean over the window's rows, no count to hand over
            self._windows.begin(batch_samples)
            return batch_samples, None
        if self._inputs_unchecked:  # counted now: an override may mask the same label tensors in place later
            self._first_counts = [self.items.count([b], device or self.args.device) for b in batch_samples]
        total = self.summed_over_ranks(self.items.count(batch_samples, device or self.args.device))
        self.open_window(int(total), len(batch_samples), buffers=self.buffers, routed=lambda: [
            self.items.model_inputs(self._prepare_inputs(dict(b))) for b in batch_samples])
        return batch_samples, total

    @serves_the_window
    def compute_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        """Training: micro-batch k's share ``S_k * W / N`` of the window's mean (0 in a skipped window), with an
        MoE model's part of the window's load balancing. Evaluation: the batch's mean, kept for ``eval_loss``."""
        if self._windows is not None:  # a WindowLoss: micro-batch k's surrogate, or the eval batch's loss
            loss = self._windows.surrogate(model) if model.training else window_loss_of_batch(
                self.window_loss, model, self.accelerator.unwrap_model(model), inputs)
            return (loss, {"loss": loss}) if return_outputs else loss
        items, window = self.items, self._window
        if not model.training:
            if items.source == "head" and self.own_loss is None:
                outputs = model(**items.model_inputs(inputs))
                loss = self._evaluation.head_mean(outputs, inputs)
            else:  # the trainer's own batch mean, shared out over its rows by their items
                loss, outputs = self._trainer_loss(model, inputs, return_outputs, None)
                self._evaluation.keep_mean(loss, inputs)
            return (loss, outputs) if return_outputs else loss
        if window is None:
            raise RuntimeError("ExactTrainer.compute_loss in training before get_batch_samples counted the window "
                               "(do not override get_batch_samples away)")
        part = None
        if self.own_loss is not None or items.source in ("pairs", "rows"):  # a mean over the head's items, pairs, rows
            loss, outputs = self._trainer_loss(model, inputs, return_outputs, None)
            loss = loss * window.mean_weight(items.count([inputs]) if items.source == "head" else items.rows(inputs))
        elif items.source == "head":
            if self._inputs_unchecked:  # once, at the first micro-batch: the labels are those counted
                self._check_inputs(inputs)
            moe = {} if self.router_balance is None else {"output_router_logits": False}  # hooks read them
            outputs, part = self.balanced(model, inputs, lambda: model(**items.model_inputs(inputs), **moe))
            loss = items.loss_sum(outputs, inputs) * self._sum_weight  # W / N
        else:  # SFT's tokens: S_k / num_items_in_batch, times W where it averages tokens across devices itself
            n = max(int(window.num_items or 0), 1)
            (loss, outputs), part = self.balanced(model, inputs,
                                                  lambda: self._trainer_loss(model, inputs, return_outputs, n))
            loss = loss * (self._sum_weight * n / (self.grad_divisor if self.args.average_tokens_across_devices
                                                   else 1.0))
        loss = loss if part is None else loss + part  # coef * this micro-batch's part of the window's LBL, times W
        return (loss, outputs) if return_outputs else loss

    def _check_inputs(self, inputs: Dict[str, Any]) -> None:
        """The handed inputs' items against those counted (one host synchronisation, once): an override that masks
        labels before calling ``super().compute_loss`` would have every step off by their ratio."""
        self._inputs_unchecked = False
        counted, self._first_counts = self._first_counts[self._ran], []
        got = self.items.count([inputs], self.args.device)
        if int(got) != int(counted):
            raise NotExactError(
                f"{type(self).__name__}.compute_loss was handed {int(got)} items where the window counted {int(counted)} "
                "for this micro-batch: its labels were changed after the data collator (in a compute_loss or "
                "training_step override, before super()), and the window's N, counted from the collated labels, "
                "would weigh every step by the wrong total. Change the labels in the data collator instead")

    def _trainer_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool,
                      num_items: Optional[int]) -> Tuple[torch.Tensor, Any]:
        """The next class's ``compute_loss`` (SFT's, DPO's, ...), or the subclass's own declared one."""
        loss = super().compute_loss if self.own_loss is None else self.own_loss
        out = loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items)
        return out if return_outputs else (out, None)  # type: ignore[return-value]

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop, with ``{prefix}_loss`` the item-weighted mean over the whole set."""
        output = super().evaluation_loop(*args, **kwargs)
        self._evaluation.report(output.metrics, kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval"))
        return output


def _refuse_what_is_not_exact(trainer: "ExactTrainer", config: Any, source: str, accum_dtype: str) -> None:
    """After the Trainer is built: what would not be one big batch, or is not tested here, refused with the fix."""
    own_loss = source != "head" or trainer.own_loss is not None  # a trainer's compute_loss runs
    if not own_loss and getattr(trainer.args, "label_smoothing_factor", None):
        raise ConfigurationError(f"ExactTrainer: label_smoothing_factor={trainer.args.label_smoothing_factor} is not "
                                 "supported where ExactTrainer computes the model's loss; set it to 0")
    refuse_untested(trainer, "training", deepspeed=False, fsdp=False)  # DeepSpeed and FSDP2: below
    if trainer.is_deepspeed_enabled:  # the engine steps once per window with items (integrations/hf_deepspeed.py)
        if aux_term(config) is not None:
            raise NotExactError(
                f"{type(trainer).__name__} under DeepSpeed: the model's config turns on its MoE router's load-balancing "
                "loss, which ExactTrainer computes over the window with DDP or FSDP2 only (its counting pass is not "
                "tested inside a DeepSpeed engine). Train it with DDP or FSDP2 (fsdp_config={'fsdp_version': 2}), or "
                "set model.config.router_aux_loss_coef = 0.0 to train without the term")
        hf_deepspeed.prepare(trainer, trainer.window_steps, accum_dtype)
    version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) if trainer.is_fsdp_enabled else None
    if version not in (None, 2):
        raise ConfigurationError(f"ExactTrainer: FSDP with fsdp_version={version} is not supported (untested here, and "
                                 "deprecated in transformers); use fsdp_version=2: fsdp_config={'fsdp_version': 2}")
    if version == 2 and own_loss:
        raise ConfigurationError(f"ExactTrainer: FSDP2 is tested where ExactTrainer computes the model's loss, not "
                                 f"under {type(trainer).__name__}'s own compute_loss (items: {source}); train "
                                 "it with DDP (one process per device under torchrun)")
    batch_level = sorted(set(getattr(trainer, "loss_types", ())) & set(_NOT_PER_PAIR))
    if source == "pairs" and batch_level:
        raise ConfigurationError(f"ExactTrainer: loss_type {batch_level} is not a mean of per-pair terms ({_NOT_PER_PAIR} "
                                 "compare pairs across the micro-batch), so no weighting makes it one big batch; use "
                                 "per-pair loss types such as 'sigmoid', 'ipo', 'hinge'")
    # an MoE model's router term where it is not computed over the window (SFT's: hf_moe.trl_router_balance)
    if source == "rows" or trainer.own_loss is not None:  # a compute_loss of its own may call the model's
        refuse_aux_term(config, type(trainer).__name__,
                        "Set model.config.router_aux_loss_coef = 0.0 to train without it, or train with "
                        "ExactTrainer's own loss, which computes the term over the window")
    elif source == "pairs" and getattr(trainer, "aux_loss_enabled", False):  # DPO: per micro-batch
        raise trl_aux_refusal(trainer, "which TRL computes per micro-batch (its expert fractions are statistics of the "
                              "whole batch), so the step would not be the big batch's", then=(
                                  " (TRL then sets the model's output_router_logits=False itself; setting "
                                  "output_router_logits=False alone is overridden by TRL)"))
