"""Hugging Face ``Trainer``: exact gradient accumulation for every head, and for the trainers built on it.

    trainer = ExactTrainer(model=model, args=args, train_dataset=dataset)     # instead of Trainer(...)
    class ExactSFT(ExactTrainer, SFTTrainer): pass                            # any Trainer subclass: ExactTrainer first

Every optimizer step is on the gradient of the item-weighted mean loss over the whole window, every
micro-batch of it on every rank (one big batch). What an *item* is depends on where the loss comes
from (:func:`loss_source`): the model's head (next-token targets, token labels, sequence labels,
regression or multi-label elements), TRL's ``SFTTrainer`` (next-token targets) or a preference
trainer (pairs). The weighting, the window's count, its verdict and the skip are the core's one
:class:`gradaccum._weights.WindowWeights` (N counted first, in ``get_batch_samples``), and what windows
teach each other is one :class:`~gradaccum.AccumulatorState` saved in the Trainer's checkpoints; this
module only says what the items of a batch are and hooks the Trainer's window.

**How** (the core's one window, :class:`gradaccum._weights.WindowWeights`, driven from the Trainer's
hooks). ``get_batch_samples`` (called once per window with its micro-batches, fewer on an epoch's
short last window) counts ``N`` before any forward and all-reduces it, and opens the window's weights
with it (counted first: R = N, no rescale at the boundary) and its verdict; each micro-batch
backpropagates ``S_k * W / N`` (``sum_weight``; ``W`` processes, since DDP and FSDP2 average
gradients), and ``loss_is_scaled_for_ga = True`` keeps the Trainer from dividing again. Under FSDP2
(``fsdp_config={"fsdp_version": 2}``) every rank runs every micro-batch of a window, a skipped one
included, so the shards' collectives stay matched. A window with ``N = 0`` (every label ignored on
every rank) is skipped as the core skips it: no optimizer step (so no weight decay), no scheduler
step, ``global_step`` not advanced, no log, evaluation or checkpoint for it. The state it leaves
(steps, skipped windows, the last window's N) is ``ExactTrainer.accumulator_state``, saved in the
Trainer's checkpoints; a resume reads it back and skips the skipped windows' data too.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from .. import _maths
from ..accumulator import driver_buffers
from .._state import AccumulatorState
from .._weights import Closing, WindowWeights
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
_DECLARABLE = ("rows",)  # what a subclass may declare for a compute_loss of its own: `exact_items = "rows"`
_RL_DROP_INS = {"trl.trainer.grpo_trainer.GRPOTrainer": "ExactGRPOTrainer",  # integrations/trl_rl.py
                "trl.trainer.rloo_trainer.RLOOTrainer": "ExactRLOOTrainer"}
_NOT_PER_PAIR = ("sft", "aot", "aot_unpaired")  # DPO loss types over the whole micro-batch, not per pair


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
      weighted by ``pairs_k * W / N`` (:meth:`gradaccum._weights.WindowWeights.mean_weight`).
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
    drop_in = _RL_DROP_INS.get(_qualname(owner))
    if drop_in is not None:  # its batches are prompts until training_step generates: nothing to count here
        raise TypeError(f"class {cls.__name__}: {owner.__name__} generates its micro-batches inside training_step (a "
                        "batch is a list of prompts until then), so ExactTrainer cannot count them and exact_items = "
                        f"'rows' would fail in train(). Use the drop-in: from gradaccum.integrations.trl import {drop_in}")
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
    """The window being trained: its weighting (N counted first), the boundary's decision (known from N
    before any forward: step, or skip a window of no item), how many micro-batches it holds and how
    many have run."""

    weights: WindowWeights
    closing: Closing
    micro_batches: int
    ran: int = 0

    @property
    def items(self) -> int:
        """N, the window's items on every rank."""
        return int(self.closing.num_items)

    @property
    def skip(self) -> bool:
        return not self.closing.steps


class _StateCallback(TrainerCallback, ExportableState):
    """Owns the ExactTrainer's :class:`~gradaccum.AccumulatorState` (steps, skipped windows, the last
    window's N), saved in the Trainer's checkpoints (``TrainerState.stateful_callbacks``) and read back
    on resume (:meth:`ExactTrainer._init_training_state`); at the end of a skipped window it gives the
    Trainer back its optimizer and scheduler and keeps its flow from logging, evaluating or saving a
    step that was not taken."""

    def __init__(self) -> None:
        self.accumulator_state = AccumulatorState()
        self.held: Optional[Tuple[Any, Any]] = None  # (optimizer, scheduler) while a skipped window ends

    def state(self) -> dict:
        return {"args": {}, "attributes": {"saved": self.accumulator_state.saved()}}

    def hold(self, trainer: "ExactTrainer") -> None:
        """After a skipped window's last micro-batch: the optimizer and the scheduler the Trainer is about
        to step are stood in for, and ``global_step`` is taken back by the one the Trainer adds, so that
        the window leaves no trace but its consumed data."""
        self.held = (trainer.optimizer, trainer.lr_scheduler)
        trainer.optimizer, trainer.lr_scheduler = _NoStep(trainer.optimizer), _NoStep(trainer.lr_scheduler)  # type: ignore[assignment]
        trainer.state.global_step -= 1  # the Trainer adds 1 after the (skipped) step

    def release(self, trainer: "ExactTrainer") -> None:
        if self.held is not None:
            trainer.optimizer, trainer.lr_scheduler = self.held
            self.held = None

    def resume(self, trainer: "ExactTrainer", epochs: int, batches: int, windows_per_epoch: int) -> Tuple[int, int]:
        """The state the checkpoint saved, and the Trainer's resume position (``epochs`` done, ``batches``
        of the next to skip, counted from its optimizer steps) moved past the skipped windows' data too."""
        self.load(trainer.state.stateful_callbacks)  # type: ignore[arg-type]
        skipped = self.accumulator_state.skipped
        if skipped and not trainer.args.ignore_data_skip:
            windows = trainer.state.global_step + skipped
            epochs = windows // windows_per_epoch
            batches = (windows % windows_per_epoch) * trainer.args.gradient_accumulation_steps
        return epochs, batches

    def load(self, stateful_callbacks: Dict[str, Any]) -> None:
        """The state a checkpoint's ``stateful_callbacks`` saved (a fresh one if none; a checkpoint of an
        earlier gradaccum saved only the skipped windows, as ``_Skips``)."""
        state = self.accumulator_state
        saved, old = stateful_callbacks.get(type(self).__name__), stateful_callbacks.get("_Skips")
        if isinstance(saved, dict):
            state.load_saved(state.read_saved(saved["attributes"]["saved"]))
        else:
            state.load_saved(state.read_saved({}))
            if isinstance(old, dict):
                state.skipped = int(old["attributes"]["windows"])

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

    with ``L_k`` micro-batch k's mean loss over its ``n_k`` items; how: the module docstring. The
    logged ``loss`` is the window's mean over all ranks; ``eval_loss`` the item-weighted mean over the
    whole evaluation set. ``windows_skipped`` counts the windows of ``N = 0`` skipped.

    Where the loss comes from, and what its items are, is :func:`loss_source`'s to say: the model's
    head, TRL's SFT or DPO, a declared ``exact_items``, an MoE model's load balancing over the window,
    or a loss that couples the batch's rows (:mod:`gradaccum.integrations.hf_window_loss`).

    Args:
        *args: As for ``transformers.Trainer`` (or the subclass).
        head: One of :data:`HEADS`, where ExactTrainer computes the loss itself. Default: read from
            the model's class (:func:`head_of`).
        ignore_index: Label value that is not a target. Default -100.
        accum_dtype: where bf16/fp16 trainable parameters' window gradient is summed. ``"auto"`` (the
            default): on one process, in float32 buffers (:class:`gradaccum._gradients.AccumulationBuffers`,
            4 bytes a parameter where the bf16 ``.grad`` took 2), handed to the Trainer's clipping and
            step rounded once to the parameter's dtype; under DDP/FSDP2 the wrapper sums into ``.grad``
            and a :class:`~gradaccum.accumulator.LowPrecisionWarning` says so. ``"param"``: the opt-out,
            the sum in the parameters' own ``.grad``, rounded after every micro-batch (its error grows
            with the window: about 2x a float32 sum's over 64 micro-batches), silently. float32
            parameters: no buffers either way.
        **kwargs: As for the Trainer; ``compute_loss_func`` is refused unless it is a
            :class:`~gradaccum.WindowLoss` (a loss that couples the batch's rows, see
            :mod:`gradaccum.integrations.hf_window_loss`; ``CLIPModel`` and ``SiglipModel`` get theirs
            without it).

    Raises:
        ValueError: ``compute_loss_func`` is passed; ``label_smoothing_factor`` where ExactTrainer
            computes the loss; DataParallel over several GPUs in one process (``n_gpu > 1``);
            DeepSpeed without ``"managed_gradient_accumulation": false`` (or with an MoE router
            loss); FSDP1 (``fsdp_version=1``); FSDP2 where the loss is a
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

    def __init__(self, *args: Any, head: Optional[str] = None, ignore_index: int = -100, accum_dtype: str = "auto",
                 **kwargs: Any) -> None:
        from . import hf_window_loss  # a loss that couples the batch's rows: a WindowLoss, or CLIP's/SigLIP's

        self.window_loss = hf_window_loss.window_loss_of(kwargs, args, loss_source(type(self)))
        if kwargs.get("compute_loss_func") is not None:
            given = getattr(kwargs["compute_loss_func"], "__qualname__", type(kwargs["compute_loss_func"]).__name__)
            raise ConfigurationError(f"ExactTrainer(compute_loss_func={given}): ExactTrainer "
                                     "cannot weigh a loss whose reduction it does not know. A loss that couples the "
                                     "batch's rows (in-batch negatives, contrastive) goes in as compute_loss_func="
                                     "gradaccum.WindowLoss(encode, loss), run over the whole window; for the model's "
                                     "own loss drop compute_loss_func (ExactTrainer computes it), or use Trainer")
        if head is not None and head not in HEADS:
            raise ConfigurationError(f"ExactTrainer(head={head!r}): supported heads are {', '.join(HEADS)}")
        driver_buffers("ExactTrainer", (), accum_dtype, owns_the_sum=True, fix="")  # a bad name, before the Trainer
        self.source = loss_source(type(self))
        super().__init__(*args, **kwargs)
        _refuse_what_is_not_exact(self)
        # bf16/fp16 parameters: the window summed in float32 buffers where ExactTrainer owns the sum (one
        # process, its counted window); under DeepSpeed the engine's dtypes are checked (hf_deepspeed)
        self.buffers = None if self.is_deepspeed_enabled else driver_buffers(
            type(self).__name__, self.model.parameters(), accum_dtype,
            owns_the_sum=(self.accelerator.num_processes == 1 and not self.is_fsdp_enabled and self.args.n_gpu <= 1
                          and self.window_loss is None),
            fix="Keep float32 parameters and train with bf16=True (autocast) to sum in float32 (under DDP/FSDP2 "
                "the wrapper owns the sum), or pass accum_dtype='param' to accept it without this warning")
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
        self._window: Optional[_Window] = None
        self._state = _StateCallback()  # what windows teach each other, in the Trainer's checkpoints
        self.add_callback(self._state)
        self._evaluation = _Evaluation(self._trainer_loss)
        self._windows = (hf_window_loss.TrainerWindows(self, self.accumulator_state) if self.window_loss is not None
                         else None)

    @property
    def head(self) -> Any:
        """The head whose loss ExactTrainer computes (None where the trainer computes it)."""
        return self.items.head

    @property
    def accumulator_state(self) -> AccumulatorState:
        """What windows teach each other (steps, skipped windows, last N), in the Trainer's checkpoints."""
        return self._state.accumulator_state

    def window_steps(self) -> bool:
        """Whether the window being trained takes an optimizer step (it holds items; True before any window)."""
        return not (self._window is not None and self._window.skip)

    @property
    def windows_skipped(self) -> int:
        """Windows of no item skipped since the run began (resumed runs included): the state's ``skipped``."""
        return self.accumulator_state.skipped

    @property
    def last_window_items(self) -> Optional[int]:
        """N of the last window that held items, every rank's: ``accumulator_state.last_window_items``."""
        n = self.accumulator_state.last_window_items
        return None if n is None else int(n)

    # -- the window's count ----------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: Optional[torch.device] = None) -> Tuple[List[Any], Optional[torch.Tensor]]:
        """The window's micro-batches and ``N``, their items summed over every rank, and the window's
        verdict (step, or skip when ``N = 0``): one host synchronisation per window (the verdict needs N)."""
        batch_samples = _take(epoch_iterator, num_batches)
        if self._windows is not None:  # a WindowLoss: one mean over the window's rows, no count to hand over
            self._window = None
            self._windows.begin(batch_samples)
            return batch_samples, None
        device = device if device is not None else self.args.device
        local = sum((self.items.count(b).to(device) for b in batch_samples), torch.zeros((), dtype=torch.long, device=device))
        total = self.accelerator.gather(local.reshape(1)).sum() if self.accelerator.num_processes > 1 else local
        items = int(total)  # count first: the weights are W / N, the boundary's scale 1, its verdict known now
        weights = WindowWeights(self.accumulator_state, self.accelerator.num_processes, num_items=items)
        self._window = _Window(weights, weights.close(items), micro_batches=len(batch_samples))
        if self.router_balance is not None:  # the window's expert counts, every rank's, before any backward
            inputs = [self.items.model_inputs(self._prepare_inputs(dict(b))) for b in batch_samples]
            self._balance = WindowBalance(self.router_balance, self.accelerator.unwrap_model(self.model), inputs,
                                          device, self.model_wrapped)
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
            return self._evaluation.loss(self, model, inputs, return_outputs)
        window = self._window
        if window is None:
            raise RuntimeError("ExactTrainer.compute_loss in training before get_batch_samples counted the window "
                               "(do not override get_batch_samples away)")
        world = self.accelerator.num_processes
        weight = window.weights.sum_weight()  # W / N (0 in a skipped window)
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
            loss = loss * window.weights.mean_weight(self.items.rows(inputs))  # rows * W / N
        if part is not None and balance is not None:  # coef * this micro-batch's part of the window's LBL, times W
            loss = loss + part * (0.0 if window.skip else world)
            if window.ran == window.micro_batches - 1:  # before the last backward, every rank alike: routed as counted
                balance.check()
        return (loss, outputs) if return_outputs else loss

    def _trainer_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool,
                      num_items: Optional[int]) -> Tuple[torch.Tensor, Any]:
        """The next class's ``compute_loss`` (SFT's, DPO's, ...), with its metrics and logs."""
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items)
        return out if return_outputs else (out, None)  # type: ignore[return-value]

    # -- evaluation: the item-weighted mean over the whole set -----------------------------------

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop, with ``{prefix}_loss`` the item-weighted mean over the whole set
        (the Trainer's is a mean of batch means weighted by the batch size)."""
        self._evaluation = _Evaluation(self._trainer_loss)
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        self._evaluation.report(output.metrics, prefix)
        return output

    # -- the skipped window ----------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
        """The Trainer's step; after a window's last micro-batch the float32 buffers (bf16/fp16 parameters)
        are written back rounded once, before the Trainer clips, and the state records the window's step or
        its skip (then the Trainer's step is stood in for: :meth:`_StateCallback.hold`; a skipped window's
        buffers are cleared)."""
        window, buffers = self._window, self.buffers
        if buffers is not None and window is not None and window.ran == 0:
            buffers.clear()  # the window's first micro-batch: its bf16 gradients fold into float32 from here on
            buffers.active = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            if buffers is not None:  # their hooks stay on the parameters: fold nothing after a failed window
                buffers.active = False
                buffers.clear()
            raise
        if window is not None:
            window.ran += 1
            if self._balance is not None and window.ran == window.micro_batches:
                self._balance.finish()
            if window.ran == window.micro_batches:
                closing = window.closing
                if self.buffers is not None:  # before the Trainer clips and steps: the float32 sum, rounded once
                    self.buffers.active = False
                    if closing.steps:
                        self.buffers.write_grads_()
                    else:
                        self.buffers.clear()
                if closing.steps and self.is_deepspeed_enabled:
                    from .hf_deepspeed import step_applied

                    if not step_applied(self):  # the engine's fp16 loss scale overflowed: it took no step
                        closing = dataclasses.replace(closing, verdict=_maths.Verdict.SKIP_NONFINITE)
                window.weights.record(closing)  # one step more, or one skipped window more
                if not closing.steps:
                    self._state.hold(self)
        return loss

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        self._state.release(self)  # the skipped window's step is over: the Trainer's own objects come back
        super()._maybe_log_save_evaluate(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self._state.release(self)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, *args: Any) -> Tuple[int, int]:
        """The Trainer's resume position counts optimizer steps; skipped windows consumed data too."""
        epochs, batches = super()._init_training_state(max_steps, num_update_steps_per_epoch, *args)
        return self._state.resume(self, epochs, batches, num_update_steps_per_epoch)


class _Evaluation:
    """One evaluation loop's item-weighted mean loss over the whole set: per batch, its rows' loss sums
    and items, gathered (the Trainer's ``gather_for_metrics`` drops the rows a distributed sampler
    repeated)."""

    def __init__(self, trainer_loss: Callable[..., Tuple[torch.Tensor, Any]]) -> None:
        self.trainer_loss = trainer_loss  # the next class's compute_loss (SFT's, DPO's, ...), where it is the source
        self.tally: List[torch.Tensor] = []  # per evaluation batch: [loss sum of its rows, their items]

    def loss(self, trainer: "ExactTrainer", model: nn.Module, inputs: Dict[str, Any], return_outputs: bool) -> Any:
        """The batch's mean loss (what ``compute_loss`` returns in evaluation); its sums kept."""
        rows_items = trainer.items.rows_items(inputs)
        if trainer.source == "head":
            outputs = model(**trainer.items.model_inputs(inputs))
            rows_sums = trainer.items.rows_loss_sums(outputs, inputs)
            mean = rows_sums.sum() / rows_items.sum().clamp(min=1).to(rows_sums.dtype)
        else:  # the trainer's own batch mean, shared out over its rows by their items
            mean, outputs = self.trainer_loss(model, inputs, return_outputs, None)
            rows_sums = mean.detach() * rows_items.to(mean.dtype)
        gathered = trainer.accelerator.gather_for_metrics(torch.stack([rows_sums.detach().double(),
                                                                       rows_items.to(rows_sums.device).double()], dim=1))
        self.tally.append(gathered.sum(dim=0))
        return (mean, outputs) if return_outputs else mean

    def report(self, metrics: Dict[str, float], prefix: str) -> None:
        """``{prefix}_loss`` in ``metrics``: the set's item-weighted mean (when a batch was evaluated)."""
        if self.tally:
            loss_sum, items = torch.stack(self.tally).sum(dim=0).tolist()
            metrics[f"{prefix}_loss"] = _maths.window_mean(loss_sum, items)
        self.tally = []


def _take(epoch_iterator: Iterator, num_batches: int) -> List[Any]:
    """The window's micro-batches: ``num_batches``, or fewer at the end of the epoch."""
    batch_samples: List[Any] = []
    for _ in range(num_batches):
        try:
            batch_samples.append(next(epoch_iterator))
        except StopIteration:
            break
    return batch_samples


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

        if aux_term(getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)) is not None:
            raise NotExactError(
                f"{type(trainer).__name__} under DeepSpeed: the model's config turns on its MoE router's load-balancing "
                "loss, which ExactTrainer computes over the window with DDP or FSDP2 only (its counting pass is not "
                "tested inside a DeepSpeed engine). Train it with DDP or FSDP2 (fsdp_config={'fsdp_version': 2}), or "
                "set model.config.router_aux_loss_coef = 0.0 to train without the term")
        hf_deepspeed.prepare(trainer, trainer.window_steps)
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
