"""Hugging Face ``Trainer``: exact gradient accumulation for every head, and for the trainers built on it.

    trainer = ExactTrainer(model=model, args=args, train_dataset=dataset)     # instead of Trainer(...)
    class ExactSFT(ExactTrainer, SFTTrainer): pass                            # any Trainer subclass: ExactTrainer first

Every optimizer step is on the gradient of the item-weighted mean loss over the whole window, every
micro-batch of it on every rank (one big batch). What an *item* is depends on where the loss comes
from (:func:`loss_source`): the model's head (next-token targets, token labels, sequence labels,
regression or multi-label elements), TRL's ``SFTTrainer`` (next-token targets) or a preference
trainer (pairs). The formulas are :mod:`gradaccum._maths`'; this module only says what the items
of a batch are and hooks the Trainer's window.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from .. import _maths
from ..errors import ConfigurationError, NotExactError
from ..moe import aux_term, refuse_aux_term
from .hf_moe import WindowBalance
from .hf_items import HEADS, BatchItems, head_of

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gradaccum.integrations.hf_trainer needs transformers: pip install 'gradaccum[hf]' "
        "(or pip install 'transformers>=4.46')"
    ) from exc

__all__ = ["ExactTrainer", "HEADS", "SOURCES", "head_of", "loss_source"]

#: where a Trainer's loss comes from, by the class whose ``compute_loss`` it runs: its items, and how
#: that ``compute_loss`` reduces over them ("head": ExactTrainer computes the model's loss itself;
#: "tokens": a summed next-token loss divided by ``num_items_in_batch``; "pairs"/"rows": a mean over
#: the batch's preference pairs (chosen rows then rejected rows) or its rows along dim 0)
SOURCES = {"transformers.trainer.Trainer": "head", "trl.trainer.sft_trainer.SFTTrainer": "tokens",
           "trl.trainer.dpo_trainer.DPOTrainer": "pairs"}
_DECLARABLE = ("rows",)
_NOT_PER_PAIR = ("sft", "aot", "aot_unpaired")  # DPO loss types over the whole micro-batch, not per pair  # what a subclass may declare for a compute_loss of its own: `exact_items = "rows"`


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def loss_source(cls: type) -> str:
    """How ``cls`` (a subclass of :class:`ExactTrainer`) gets its loss: the :data:`SOURCES` entry of
    the first class after ExactTrainer in its MRO that defines ``compute_loss``, or what ``cls``
    declares in ``exact_items`` for a ``compute_loss`` of its own.

    Where the loss comes from, by source:

    - ``ExactTrainer`` itself (the next ``compute_loss`` in the MRO is the Trainer's): the model runs
      without ``labels`` and ExactTrainer computes its head's loss from the logits, as the model
      defines it: next-token cross-entropy (``causal_lm``: items ``labels[:, 1:] != -100``, or a
      collator's ``shift_labels``), token cross-entropy (``token_classification``, ``masked_lm``),
      and for ``sequence_classification`` by problem type: cross-entropy over the labels that are not
      -100, squared error (``regression``, ``num_labels=1``) or binary cross-entropy
      (``multi_label_classification``) over every label element.
    - A mixture-of-experts causal LM whose config turns its router's load-balancing loss on
      (``output_router_logits``, ``router_aux_loss_coef``): ``coef`` times that loss over the whole
      window, every rank's micro-batches, is added as the model's own loss adds it over one batch
      (:mod:`gradaccum.integrations.hf_moe`; also under SFT). ``eval_loss`` stays the token loss.
    - ``class X(ExactTrainer, SFTTrainer)`` (TRL): SFT computes its loss, metrics and logs itself,
      with ``num_items_in_batch = N``; ExactTrainer undoes SFT's own factor for
      ``average_tokens_across_devices`` so that both settings are exact.
    - ``class X(ExactTrainer, DPOTrainer)``: its mean over the micro-batch's preference pairs is
      weighted by ``pairs_k * W / N`` (:func:`gradaccum._maths.backward_weight`).
    - Any other Trainer subclass whose ``compute_loss`` returns a mean of independent per-row terms: declare
      ``exact_items = "rows"`` on the class. ExactTrainer must come first among the bases; the other
      order, or an undeclared ``compute_loss``, is refused when the class is defined.
    - ``compute_loss_func=WindowLoss(...)``, or a ``CLIPModel``/``SiglipModel`` with its own loss: a loss
      that couples the batch's rows, run over the whole window (:mod:`gradaccum.integrations.hf_window_loss`).

    Raises:
        TypeError: a Trainer subclass comes before ExactTrainer in the MRO (its ``compute_loss`` or
            window would run instead of ExactTrainer's: a loss 1/W or 1/K off, silently), or the
            ``compute_loss`` that runs is one whose reduction is not known and not declared.
    """
    mro = cls.__mro__
    here = mro.index(ExactTrainer)
    wrong = [c for c in mro[:here] if issubclass(c, Trainer) and not issubclass(c, ExactTrainer)]
    if wrong:
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        raise TypeError(
            f"class {cls.__name__}({bases}): ExactTrainer must come first among the base classes, before "
            f"{wrong[0].__name__} (whose compute_loss would otherwise run with ExactTrainer's window count: a step "
            f"1/W or W times off). Write class {cls.__name__}(ExactTrainer, {wrong[0].__name__})")
    owner = next(c for c in mro[here + 1:] if "compute_loss" in vars(c))
    declared = getattr(cls, "exact_items", None)
    if _qualname(owner).startswith("sentence_transformers."):  # its losses couple the batch's rows
        raise TypeError(
            f"class {cls.__name__}: {owner.__name__}'s losses couple the batch's rows (in-batch negatives, CoSENT, "
            "triplet mining), so no weighting of micro-batches makes them one big batch, and exact_items = 'rows' "
            "would train plain accumulation. Use gradaccum.integrations.sentence_transformers."
            "ExactSentenceTransformerTrainer instead of SentenceTransformerTrainer")
    if declared is not None:
        if declared not in _DECLARABLE:
            raise TypeError(f"{cls.__name__}.exact_items={declared!r}: supported is {_DECLARABLE} (compute_loss "
                            "returns the mean over the batch's rows along dim 0)")
        return declared
    source = SOURCES.get(_qualname(owner))
    if source is None:
        known = ", ".join(name.rsplit(".", 1)[1] for name in SOURCES)
        raise TypeError(
            f"ExactTrainer cannot tell how {owner.__name__}.compute_loss reduces its loss, so it cannot weigh "
            f"micro-batches by their items. Supported: {known}. Where compute_loss returns the mean of one term per "
            f"row (dim 0), each row's term independent of the other rows, declare it: class {cls.__name__}(...): "
            "exact_items = 'rows'. A loss that couples the rows (in-batch negatives, CLIP, CoSENT, triplet mining) "
            "is not a mean of independent terms: no weighting makes it exact; pass it as a gradaccum.WindowLoss, "
            "ExactTrainer(compute_loss_func=WindowLoss(...)) (see docs/guides/contrastive.md)")
    return source


@dataclasses.dataclass
class _Window:
    """The window being trained: its global item count N, whether it is skipped (N = 0), how many
    micro-batches it holds and how many have run."""

    items: int
    skip: bool
    micro_batches: int
    ran: int = 0


class _Skips(TrainerCallback, ExportableState):
    """Counts the windows skipped for holding no item (saved in checkpoints, read back on resume) and,
    at the end of a skipped window, gives the Trainer back its optimizer and scheduler and keeps its
    flow from logging, evaluating or saving a step that was not taken."""

    def __init__(self) -> None:
        self.windows = 0
        self.held: Optional[Tuple[Any, Any]] = None  # (optimizer, scheduler) while a skipped window ends

    def state(self) -> dict:
        return {"args": {}, "attributes": {"windows": self.windows}}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.held is not None:
            control.should_log = control.should_evaluate = control.should_save = False
        return control


class _NoStep:
    """Stands in for the optimizer and the scheduler at the end of a skipped window: ``step()`` does
    nothing, everything else is the real object's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ExactTrainer(Trainer):
    """A ``transformers.Trainer`` whose gradient accumulation is exactly one big batch.

    Every optimizer step is on the gradient of the item-weighted mean loss over the window, every
    micro-batch k on every rank::

        grad = sum_{ranks, k} grad(S_k) / N,    S_k = n_k L_k,    N = sum_{ranks, k} n_k

    with ``L_k`` micro-batch k's mean loss over its ``n_k`` items. ``get_batch_samples`` (called once
    per window with its micro-batches, fewer on an epoch's short last window) counts ``N`` before any
    forward and all-reduces it; each micro-batch backpropagates ``S_k * W / N``
    (:func:`gradaccum._maths.summed_loss_weight`; ``W`` processes, since DDP and FSDP2 average
    gradients), and ``loss_is_scaled_for_ga = True`` keeps the Trainer from dividing again. Under
    FSDP2 (``fsdp_config={"fsdp_version": 2}``) every rank runs every micro-batch of a window, a
    skipped one included, so the shards' collectives stay matched. The logged ``loss`` is
    the window's mean over all ranks; ``eval_loss`` is the item-weighted mean over the whole
    evaluation set. A window with ``N = 0`` (every label ignored on every rank) is skipped as the
    core skips it: no optimizer step (so no weight decay), no scheduler step, ``global_step`` not
    advanced, no log, evaluation or checkpoint for it; ``windows_skipped`` counts them and a resume
    accounts for them.

    Where the loss comes from, and what its items are, is :func:`loss_source`'s to say: the model's
    head, TRL's SFT or DPO, a declared ``exact_items``, an MoE model's load balancing over the window,
    or a loss that couples the batch's rows (:mod:`gradaccum.integrations.hf_window_loss`).

    Args:
        *args: As for ``transformers.Trainer`` (or the subclass).
        head: One of :data:`HEADS`, where ExactTrainer computes the loss itself. Default: read from
            the model's class (:func:`head_of`).
        ignore_index: Label value that is not a target. Default -100.
        **kwargs: As for the Trainer; ``compute_loss_func`` is refused unless it is a
            :class:`~gradaccum.WindowLoss` (a loss that couples the batch's rows, see
            :mod:`gradaccum.integrations.hf_window_loss`; ``CLIPModel`` and ``SiglipModel`` get theirs
            without it).

    Raises:
        ValueError: ``compute_loss_func`` is passed; ``label_smoothing_factor`` where ExactTrainer
            computes the loss; DataParallel over several GPUs in one process (``n_gpu > 1``);
            DeepSpeed (any ZeRO stage); FSDP1 (``fsdp_version=1``); FSDP2 where the loss is a
            trainer's own (TRL's, or ``exact_items``); a batch has no ``labels``; the model
            returns no ``logits``.

    Example:
        >>> args = TrainingArguments("out", per_device_train_batch_size=8, gradient_accumulation_steps=4)  # doctest: +SKIP
        >>> ExactTrainer(model=model, args=args, train_dataset=ds, data_collator=collator).train()  # doctest: +SKIP
    """

    loss_is_scaled_for_ga = True  # compute_loss returns the window-normalized loss (read by training_step)
    exact_items: Optional[str] = None  # a subclass's declaration for a compute_loss of its own (see loss_source)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        loss_source(cls)  # refuse a wrong composition where it is written

    def __init__(self, *args: Any, head: Optional[str] = None, ignore_index: int = -100, **kwargs: Any) -> None:
        from . import hf_window_loss  # a loss that couples the batch's rows: a WindowLoss, or CLIP's/SigLIP's

        self.window_loss = hf_window_loss.window_loss_of(kwargs, args, loss_source(type(self)))
        if kwargs.get("compute_loss_func") is not None:
            raise ConfigurationError("ExactTrainer(compute_loss_func=...): ExactTrainer cannot weigh a loss whose reduction "
                             "it does not know; drop compute_loss_func (ExactTrainer computes the model's loss), or "
                             "use Trainer")
        if head is not None and head not in HEADS:
            raise ConfigurationError(f"ExactTrainer(head={head!r}): supported heads are {', '.join(HEADS)}")
        self.source = loss_source(type(self))
        super().__init__(*args, **kwargs)
        _refuse_what_is_not_exact(self)
        if "loss_is_scaled_for_ga" not in vars(Trainer):
            # transformers before 5.x: training_step divides by the accumulation steps unless the model
            # "accepts loss kwargs"
            self.model_accepts_loss_kwargs = True
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        self.items = BatchItems(self.source, head or (head_of(self.model) if self.source == "head" and  # type: ignore[arg-type]
                                                      self.window_loss is None else None),
                                ignore_index, config, self.args.device)
        # an MoE model's load-balancing term, computed over the window (integrations/hf_moe.py)
        # (a causal LM's own loss adds it; SFT's too)
        self.router_balance = aux_term(config) if self.source == "tokens" or self.items.head == "causal_lm" else None
        self._balance: Optional[WindowBalance] = None
        self.last_window_items: Optional[int] = None  # N of the last window, all ranks: for logs and tests
        self._window: Optional[_Window] = None
        self._skips = _Skips()
        self.add_callback(self._skips)
        self._eval_tally: List[torch.Tensor] = []  # per evaluation batch: [loss sums of its rows, their items]
        self._windows = hf_window_loss.TrainerWindows(self) if self.window_loss is not None else None

    @property
    def head(self) -> Any:
        """The head whose loss ExactTrainer computes (None where the trainer computes it)."""
        return self.items.head

    @property
    def windows_skipped(self) -> int:
        """Windows skipped since the run began (resumed runs included) because they held no item."""
        return self._skips.windows

    # -- the window's count ----------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: Optional[torch.device] = None) -> Tuple[List[Any], Optional[torch.Tensor]]:
        """The window's micro-batches and ``N``, their items summed over every rank, and the window's
        verdict (step, or skip when ``N = 0``). One host synchronisation per window: the verdict needs N.

        Overrides the public ``Trainer.get_batch_samples`` (one call per optimizer step)."""
        batch_samples = _take(epoch_iterator, num_batches)
        if self._windows is not None:  # a WindowLoss: one mean over the window's rows, no count to hand over
            self._window = None
            self._windows.begin(batch_samples)
            return batch_samples, None
        device = device if device is not None else self.args.device
        local = sum((self.items.count(b).to(device) for b in batch_samples), torch.zeros((), dtype=torch.long, device=device))
        total = self.accelerator.gather(local.reshape(1)).sum() if self.accelerator.num_processes > 1 else local
        items = int(total)
        decision = _maths.verdict(None, items, None, nonfinite="raise", has_scaler=False)
        self._window = _Window(items=items, skip=decision is _maths.Verdict.SKIP_EMPTY,
                               micro_batches=len(batch_samples))
        if self.router_balance is not None:  # the window's expert counts, every rank's, before any backward
            inputs = [self.items.model_inputs(self._prepare_inputs(dict(b))) for b in batch_samples]
            self._balance = WindowBalance(self.router_balance, self.accelerator.unwrap_model(self.model), inputs,
                                          device, _summed(self.accelerator))
        self.last_window_items = items
        return batch_samples, total

    # -- the loss --------------------------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        """Training: micro-batch k's share ``S_k * W / N`` of the window's mean (0 in a skipped
        window). Evaluation: the batch's mean, its rows' sums and items kept for ``eval_loss``."""
        if self._windows is not None:
            from .hf_window_loss import window_compute_loss
            return window_compute_loss(self._windows, self.window_loss, self.accelerator, model, inputs, return_outputs)
        if not model.training:
            return self._evaluation_loss(model, inputs, return_outputs)
        window = self._window
        if window is None:
            raise RuntimeError("ExactTrainer.compute_loss in training before get_batch_samples counted the window "
                               "(do not override get_batch_samples away)")
        world = self.accelerator.num_processes
        weight = 0.0 if window.skip else _maths.summed_loss_weight(window.items, world)
        balance, part = self._balance, None  # an MoE model's part of the window's load balancing (hf_moe)
        if self.source == "head":
            moe = {} if balance is None else {"output_router_logits": False}  # hooks read them (hf_moe)
            forward = lambda: model(**self.items.model_inputs(inputs), **moe)  # noqa: E731
            outputs, part = (forward(), None) if balance is None else balance.run(window.ran, model, inputs, forward)
            loss = self.items.head_loss_sum(outputs, inputs) * weight
        elif self.source == "tokens":
            # SFT returns S_k / num_items_in_batch, times W when average_tokens_across_devices (its own factor)
            trl = lambda: self._trainer_loss(model, inputs, return_outputs, max(window.items, 1))  # noqa: E731
            (loss, outputs), part = (trl(), None) if balance is None else balance.run(window.ran, model, inputs, trl, self)
            own = world if self.args.average_tokens_across_devices else 1
            loss = loss * (weight * max(window.items, 1) / own)
        else:  # a mean over the micro-batch's pairs or rows: weigh it by their count
            loss, outputs = self._trainer_loss(model, inputs, return_outputs, None)
            mean_weight = 0.0 if window.skip else _maths.backward_weight(
                self.items.rows(inputs), reference=window.items, grad_divisor=world)
            loss = loss * mean_weight
        if part is not None and balance is not None:  # coef * this micro-batch's part of the window's LBL, times W
            loss = loss + part * (0.0 if window.skip else world)
            if window.ran == window.micro_batches - 1:  # before the last backward, every rank alike: routed as counted
                summed = _summed(self.accelerator)
                balance.check(lambda flag: bool(summed(torch.tensor(float(flag), device=self.args.device)).item() > 0))
        return (loss, outputs) if return_outputs else loss

    def _trainer_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool,
                      num_items: Optional[int]) -> Tuple[torch.Tensor, Any]:
        """The next class's ``compute_loss`` (SFT's, DPO's, ...), with its metrics and logs."""
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items)
        return out if return_outputs else (out, None)  # type: ignore[return-value]

    # -- evaluation: the item-weighted mean over the whole set -----------------------------------

    def _evaluation_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool) -> Any:
        """The batch's mean loss; its rows' loss sums and items are gathered (the Trainer's
        ``gather_for_metrics`` drops the rows a distributed sampler repeated) for ``eval_loss``."""
        rows_items = self.items.rows_items(inputs)
        if self.source == "head":
            outputs = model(**self.items.model_inputs(inputs))
            rows_sums = self.items.rows_loss_sums(outputs, inputs)
            mean = rows_sums.sum() / rows_items.sum().clamp(min=1).to(rows_sums.dtype)
        else:  # the trainer's own batch mean, shared out over its rows by their items
            mean, outputs = self._trainer_loss(model, inputs, return_outputs, None)
            rows_sums = mean.detach() * rows_items.to(mean.dtype)
        gathered = self.accelerator.gather_for_metrics(torch.stack([rows_sums.detach().double(),
                                                                    rows_items.to(rows_sums.device).double()], dim=1))
        self._eval_tally.append(gathered.sum(dim=0))
        return (mean, outputs) if return_outputs else mean

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop, with ``{prefix}_loss`` the item-weighted mean over the whole set
        (the Trainer's is a mean of batch means weighted by the batch size)."""
        self._eval_tally = []
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        if self._eval_tally:
            loss_sum, items = torch.stack(self._eval_tally).sum(dim=0).tolist()
            output.metrics[f"{prefix}_loss"] = _maths.window_mean(loss_sum, items)  # type: ignore[index]
        self._eval_tally = []
        return output

    # -- the skipped window ----------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
        """The Trainer's step; after the last micro-batch of a skipped window, the optimizer and the
        scheduler the Trainer is about to step are stood in for, and ``global_step`` is taken back by
        the one the Trainer adds, so that the window leaves no trace but its consumed data."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        window = self._window
        if window is not None:
            window.ran += 1
            if self._balance is not None and window.ran == window.micro_batches:
                self._balance.finish()
            if window.skip and window.ran == window.micro_batches:
                self._skips.windows += 1
                self._skips.held = (self.optimizer, self.lr_scheduler)
                self.optimizer, self.lr_scheduler = _NoStep(self.optimizer), _NoStep(self.lr_scheduler)  # type: ignore[assignment]
                self.state.global_step -= 1  # the Trainer adds 1 after the (skipped) step
        return loss

    def _release(self) -> None:
        if self._skips.held is not None:
            self.optimizer, self.lr_scheduler = self._skips.held
            self._skips.held = None

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        self._release()  # the skipped window's step is over: the Trainer's own objects come back
        super()._maybe_log_save_evaluate(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self._release()

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, *args: Any) -> Tuple[int, int]:
        """The Trainer's resume position counts optimizer steps; skipped windows consumed data too."""
        epochs, batches = super()._init_training_state(max_steps, num_update_steps_per_epoch, *args)
        saved = self.state.stateful_callbacks.get(type(self._skips).__name__)  # type: ignore[union-attr]
        self._skips.windows = int(saved["attributes"]["windows"]) if isinstance(saved, dict) else 0
        if self._skips.windows and not self.args.ignore_data_skip:
            windows = self.state.global_step + self._skips.windows
            epochs = windows // num_update_steps_per_epoch
            batches = (windows % num_update_steps_per_epoch) * self.args.gradient_accumulation_steps
        return epochs, batches


def _take(epoch_iterator: Iterator, num_batches: int) -> List[Any]:
    """The window's micro-batches: ``num_batches``, or fewer at the end of the epoch."""
    batch_samples: List[Any] = []
    for _ in range(num_batches):
        try:
            batch_samples.append(next(epoch_iterator))
        except StopIteration:
            break
    return batch_samples


def _summed(accelerator: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor summed over the ranks (the tensor itself on one process)."""
    return (lambda t: accelerator.reduce(t, "sum")) if accelerator.num_processes > 1 else (lambda t: t)


def _refuse_what_is_not_exact(trainer: "ExactTrainer") -> None:
    """After the Trainer is built (its arguments and Accelerator read): what would not be one big batch,
    or is not tested here, refused in one line that says the fix."""
    if trainer.source == "head" and getattr(trainer.args, "label_smoothing_factor", None):
        raise ConfigurationError(f"ExactTrainer: label_smoothing_factor={trainer.args.label_smoothing_factor} is not "
                         "supported where ExactTrainer computes the model's loss; set it to 0")
    if trainer.args.n_gpu > 1:
        raise ConfigurationError(f"ExactTrainer: n_gpu={trainer.args.n_gpu} (DataParallel in one process) splits each "
                         "batch without telling the loss; launch one process per GPU (torchrun) instead")
    if trainer.is_deepspeed_enabled:  # the engine steps once per window with items (integrations/hf_deepspeed.py)
        from . import hf_deepspeed

        hf_deepspeed.prepare(trainer, lambda: not (trainer._window is not None and trainer._window.skip))
    version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) if trainer.is_fsdp_enabled else None
    if version not in (None, 2):
        raise ConfigurationError(f"ExactTrainer: FSDP with fsdp_version={version} is not supported (untested here, and "
                         "deprecated in transformers); use fsdp_version=2: fsdp_config={'fsdp_version': 2}")
    if version == 2 and trainer.source != "head":
        raise ConfigurationError(f"ExactTrainer: FSDP2 is tested where ExactTrainer computes the model's loss, not under "
                         f"{type(trainer).__name__}'s own compute_loss (items: {trainer.source}); train it with DDP "
                         "(one process per device under torchrun)")
    batch_level = sorted(set(getattr(trainer, "loss_types", ())) & set(_NOT_PER_PAIR))
    if trainer.source == "pairs" and batch_level:
        raise ConfigurationError(f"ExactTrainer: loss_type {batch_level} is not a mean of per-pair terms ({_NOT_PER_PAIR} "
                         "compare pairs across the micro-batch), so no weighting makes it one big batch; use "
                         "per-pair loss types such as 'sigmoid', 'ipo', 'hinge'")
    _refuse_moe_aux_term(trainer)


def _refuse_moe_aux_term(trainer: "ExactTrainer") -> None:
    """An MoE model whose loss adds the router's load-balancing term: refused where it is not computed
    over the window (:mod:`gradaccum.moe`). TRL rewrites the config from its own argument, so the fix is
    that argument."""
    config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    if trainer.source == "rows":  # a compute_loss of its own, which may call the model's loss
        refuse_aux_term(config, type(trainer).__name__,
                        "Set model.config.router_aux_loss_coef = 0.0 to train without it, or train with "
                        "ExactTrainer's own loss, which computes the term over the window")
    elif trainer.source == "tokens" and getattr(trainer, "aux_loss_enabled", False) and aux_term(config) is None:
        raise NotExactError(  # TRL asked for the term but the model's config does not carry it as ExactTrainer reads it
            f"{type(trainer).__name__}: router_aux_loss_coef={getattr(trainer, 'router_aux_loss_coef', None)} turns on "
            "the MoE router's load-balancing loss, which TRL would compute per micro-batch, and this model's config "
            f"does not carry it as ExactTrainer reads it (supported: mixtral, qwen2_moe, qwen3_moe, olmoe). Pass "
            f"{type(trainer.args).__name__}(..., router_aux_loss_coef=0.0) to train without it")
    elif trainer.source == "pairs" and getattr(trainer, "aux_loss_enabled", False):  # DPO: per micro-batch
        args = type(trainer.args).__name__
        raise NotExactError(
            f"{type(trainer).__name__}: router_aux_loss_coef={getattr(trainer, 'router_aux_loss_coef', None)} turns "
            "on the MoE router's load-balancing loss, which TRL computes per micro-batch (its expert fractions are "
            f"statistics of the whole batch), so the step would not be the big batch's. Pass {args}(..., "
            "router_aux_loss_coef=0.0) to train without it (TRL then sets the model's output_router_logits=False "
            "itself; setting output_router_logits=False alone is overridden by TRL)")
