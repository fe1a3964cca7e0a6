"""The Hugging Face Trainer drivers' one window lifecycle, from the Trainer's hooks, and its saved state."""
from __future__ import annotations

import functools
import inspect
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._checks import Count
from .._gradients import AccumulationBuffers
from .._patching import NoStep, Swaps
from .._settings import nonfinite_choice
from .._state import AccumulatorState
from .._weights import Closing, WindowWeights
from ..errors import ConfigurationError, NotExactError
from ._versions import require
from .hf_moe import TrainerBalance

require("transformers", "gradaccum's Trainer integrations (ExactTrainer, TRL's, sentence-transformers')")
try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("gradaccum.integrations.hf_driver needs transformers: pip install 'gradaccum[hf]'") from exc

from .hf_deepspeed import accumulation_off, step_applied  # noqa: E402

__all__ = ["TrainerDriver", "TrainerWindowState", "calls_next", "refuse_untested", "serves_the_window"]


class TrainerWindowState(TrainerCallback, ExportableState):
    """Owns a Trainer driver's :class:`~gradaccum.AccumulatorState`, saved in the Trainer's checkpoints; at
    a skipped window's end it stands in for the optimizer and scheduler and stops the log, eval and save."""

    def __init__(self) -> None:
        self.accumulator_state = AccumulatorState()
        self.held: Optional[Swaps] = None  # the stand-ins, while a skipped window ends

    def state(self) -> dict:
        return {"args": {}, "attributes": {"saved": self.accumulator_state.saved()}}

    def hold(self, trainer: Any) -> None:
        self.held = self.held or Swaps()
        for name in ("optimizer", "lr_scheduler"):
            self.held.wrap(trainer, name, NoStep)
        trainer.state.global_step -= 1  # the Trainer adds 1 after the (skipped) step

    def release(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.restore()

    def load(self, stateful_callbacks: Dict[str, Any]) -> None:
        """The state a checkpoint saved (fresh if none); a pre-release gradaccum's is refused."""
        old = sorted({"_StateCallback", "_Skips"} & set(stateful_callbacks))
        if old:
            raise ConfigurationError(f"this checkpoint's TrainerState.stateful_callbacks holds {old}, the state of a "
                                     "pre-release gradaccum that this one does not read (its skipped windows would "
                                     "move the data position); resume it with the gradaccum that wrote it, or train "
                                     "from the start")
        saved = stateful_callbacks.get(type(self).__name__)
        state = self.accumulator_state
        state.load_saved(state.read_saved(saved["attributes"]["saved"] if isinstance(saved, dict) else {}))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.held is not None:  # the skipped window's step is over: the Trainer's own objects come back
            control.should_log = control.should_evaluate = control.should_save = False
            self.release()
        return control


def calls_next(function: Any, name: str) -> bool:
    """Whether ``function``'s code (nested functions included) looks ``name`` up, as ``super().name(...)`` does."""
    codes = [getattr(inspect.unwrap(function), "__code__", None)]
    while codes:
        code = codes.pop()
        if code is not None:
            if name in code.co_names:
                return True
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return False


def serves_the_window(compute_loss: Callable[..., Any], checked: Optional[type] = None) -> Callable[..., Any]:
    """A driver's ``compute_loss``, its loss kept in ``self._served``; with ``checked``, that subclass's own
    ``compute_loss``, which must return the driver's kept loss unchanged in training, or raise."""
    @functools.wraps(compute_loss)
    def serve(self: Any, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self._served = None
        out = compute_loss(self, model, inputs, *args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        if checked is None:
            self._served = loss
        elif model.training and (self._served is None or loss is not self._served):
            did = ("returned without calling super().compute_loss" if self._served is None else
                   "returned another loss than the one super().compute_loss returned")
            raise NotExactError(
                f"{checked.__name__}.compute_loss {did} in training: the driver's loss is this micro-batch's share of "
                "the window's mean, and anything else would be stepped as plain accumulation (a term changed or added "
                "per micro-batch is not weighed as one big batch's). Return super().compute_loss(...)'s loss "
                f"unchanged{checked.own_loss_fix}")
        return out
    serve.gradaccum_driver = True  # type: ignore[attr-defined]
    return serve


class TrainerDriver:
    """Mixin before the Trainer class in the MRO: the window's lifecycle, written once (docs/architecture.md,
    "The Hugging Face Trainer drivers")."""

    loss_is_scaled_for_ga = True  # compute_loss returns the window-normalized loss (read by training_step)
    router_balance: Any = None  # an MoE model's load-balancing term over the window (hf_moe), set by the subclass
    empty_window_note: Optional[str] = None  # said once with the warning for a window of no item (None: no warning)
    own_loss_fix = ""  # what a subclass may do instead with a compute_loss of its own (ExactTrainer: declare it)
    nonfinite = "skip"  # a window whose gradient is not finite: "skip" it (no step, counted, a warning) or "raise"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A user's ``compute_loss`` or ``training_step`` must call the driver's (``super()``), or the class is
        refused here; a ``compute_loss`` that calls it is checked in training to return its loss unchanged."""
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("gradaccum."):
            return
        driver = next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("gradaccum."))  # the one extended
        for name, does in (("compute_loss", "weighs each micro-batch by its share of the window's items"),
                           ("training_step", "closes the window after its last micro-batch")):
            owner = next(c for c in cls.__mro__ if name in vars(c))  # the class whose method runs: a mixin's too
            own = vars(owner)[name]
            if owner.__module__.startswith("gradaccum.") or getattr(own, "gradaccum_driver", False):
                continue
            if not calls_next(own, name):
                args = "model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch" \
                    if name == "compute_loss" else "model, inputs, num_items_in_batch"
                raise TypeError(
                    f"class {cls.__name__}: {owner.__name__ + '.' if owner is not cls else 'its '}{name} replaces "
                    f"{driver}'s, which {does}; without it each micro-batch would be stepped as plain accumulation (a "
                    f"mean loss per micro-batch: a step gradient_accumulation_steps times too large). Call super()."
                    f"{name}({args}) and return what it returns{cls.own_loss_fix if name == 'compute_loss' else ''}")
            if name == "compute_loss":
                setattr(cls, name, serves_the_window(own, checked=cls))

    def __init__(self, *args: Any, nonfinite: Optional[str] = None, **kwargs: Any) -> None:
        self.nonfinite = nonfinite_choice(type(self).__name__, type(self).nonfinite if nonfinite is None else nonfinite)
        super().__init__(*args, **kwargs)
        self._state = TrainerWindowState()
        self.add_callback(self._state)  # type: ignore[attr-defined]
        self.accumulator_state: AccumulatorState = self._state.accumulator_state  #: saved in the checkpoints
        self.grad_divisor = float(self.accelerator.num_processes)  #: W, the ranks the Trainer's reduction averages
        self._window: Optional[WindowWeights] = None  # the window being trained (counted first: R = N)
        self._sum_weight = 0.0  # W / N, the open window's sum_weight(), taken once as it opens
        self._micro_batches, self._ran = 0, 0  # the open window's micro-batches: how many, how many have run
        self._closed: Optional[Closing] = None  # a closed window whose verdict waits for the Trainer's norm
        self._balance: Optional[TrainerBalance] = None

    @property
    def skipped(self) -> int:
        """Windows skipped since the run began (resumed runs included): of no item, or not finite."""
        return self.accumulator_state.skipped

    @property
    def last_window_items(self) -> Optional[int]:
        """N of the last window that held items, every rank's: ``accumulator_state.last_window_items``."""
        n = self.accumulator_state.last_window_items
        return None if n is None else int(n)

    def open_window(self, num_items: Count, micro_batches: int, *, buffers: Optional[AccumulationBuffers] = None,
                    routed: Optional[Callable[[], List[Dict[str, Any]]]] = None) -> WindowWeights:
        """The window of N = ``num_items``, every rank's, counted first, and its float32 ``buffers``;
        ``routed()``: its micro-batches as an MoE model routes them."""
        if self._closed is not None:  # the last window stepped without its verdict: a loop that skips _get_grad_norm
            raise RuntimeError(f"{type(self).__name__}: the Trainer's loop did not step the last window (its "
                               "gradient norm, Trainer._get_grad_norm, which the window's verdict reads, was never "
                               "measured), so its gradient would carry into this one. An IterableDataset whose "
                               "micro-batches per epoch are not a multiple of gradient_accumulation_steps ends each "
                               "epoch so: make them a multiple (or give the dataset a length); else do not override "
                               "_get_grad_norm or the training loop away")
        window = self._window = WindowWeights(self.accumulator_state, self.grad_divisor, num_items=num_items,
                                              buffers=buffers)
        self._sum_weight, self._micro_batches, self._ran, self._balance = window.sum_weight(), micro_batches, 0, None
        if self.router_balance is not None and routed is not None:  # expert counts, every rank's, before a backward
            self._balance = TrainerBalance(self.router_balance, self.accelerator.unwrap_model(self.model), routed(),
                                          self.accelerator.device, self.model_wrapped, who=type(self).__name__)
        return window

    def summed_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(local, reduction="sum") if self.accelerator.num_processes > 1 else local

    def balanced(self, model: nn.Module, inputs: Dict[str, Any], forward: Callable[[], Any]
                 ) -> Tuple[Any, Optional[torch.Tensor]]:
        """``forward()`` and, for an MoE model, ``coef * W`` times this micro-batch's part of the window's
        load-balancing loss (a TRL trainer's own aux term off meanwhile); else None."""
        balance, window = self._balance, self._window  # a balance is opened with its window
        if balance is None:
            return forward(), None
        out, part = balance.run(self._ran, model, inputs, forward, self)
        if self._ran == self._micro_batches - 1:  # the window's last micro-batch
            balance.routing.check()  # every rank: the training forwards routed as counted
        # a share of a mean over the window's N items, weighed as that mean is (0 in a skipped window)
        return out, part * window.mean_weight(window.num_items)  # type: ignore[arg-type]  # counted first

    def training_step(self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's step; the window closes after its last micro-batch, before the Trainer clips."""
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        except BaseException:
            if self._window is not None:
                self._window.abort()
            raise
        window = self._window  # opened by every driver's compute_loss in training, or it raised
        self._ran += 1
        if self._ran == self._micro_batches:  # the window's last micro-batch has run
            if self._balance is not None:
                self._balance.routing.finish()  # the random state as the counting pass left it
            closing = window.hand_over()
            # the engine (DeepSpeed) or an fp16 loss scaler judges a non-finite gradient itself
            if closing.steps and not self.is_deepspeed_enabled and getattr(self.accelerator, "scaler", None) is None:
                self._closed = closing
                return loss
            self._window_ends(window.record(closing, applied=step_applied(self), warn_empty=self.empty_window_note))
        return loss

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The Trainer's norm of the window's gradient: first a window whose micro-batches did not all go through
        training_step is refused (the one hook before the step); then the closed window's verdict, and its record."""
        who = type(self).__name__
        if self._window is not None and self._ran < self._micro_batches:  # before any step: nothing moved
            raise NotExactError(
                f"{who}: the Trainer's loop reached the window's optimizer step after {self._ran} of its "
                f"{self._micro_batches} micro-batches went through {who}.training_step: a training_step override "
                "that returns without calling super() for some micro-batches leaves their items in the window's N "
                "(every step off) and the window unjudged. Drop such micro-batches in the data collator or sampler, "
                "or call super().training_step for every one")
        norm = super()._get_grad_norm(model, grad_norm)  # type: ignore[misc]
        closing, window, self._closed = self._closed, self._window, None  # a closing comes from its window
        if closing is not None:  # judged without params: the Trainer's zero_grad drops a skipped gradient
            closing = window.judge(closing, grad_norm=norm, nonfinite=self.nonfinite, who=who)
            warning = None if closing.steps else window.judged_skip_warning(
                who, closing, f"{who}.skipped counts them, global_step is not advanced")
            self._window_ends(window.record(closing, warn_nonfinite=warning))
        return norm

    def _window_ends(self, closing: Closing) -> None:
        """The window is recorded (a subclass extends it and calls this last): a skipped one is held."""
        if not closing.steps:
            self._state.hold(self)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with accumulation_off(self):  # DeepSpeed's engine built to leave the boundary to the window
                output = super().train(*args, **kwargs)  # type: ignore[misc]
            steps, planned = self.state.global_step, self.args.max_steps
            fell_short = self.skipped and 0 < planned and steps < planned and not self.control.should_training_stop
            if fell_short:
                warnings.warn(f"{type(self).__name__} took {steps} optimizer steps of max_steps={planned}: "
                              f"{self.skipped} windows were skipped (no item, or not finite), which global_step does "
                              "not count, and the epochs the Trainer planned from max_steps ran out; raise max_steps "
                              "by the skipped windows to train as many steps", UserWarning, stacklevel=2)
            return output
        finally:
            self._state.release()
            if self._window is not None:  # the last window opened may not have run
                self._window.abort()

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, *args: Any) -> Tuple[int, int]:
        """The Trainer's resume position counts optimizer steps; skipped windows consumed data too."""
        epochs, batches = super()._init_training_state(max_steps, num_update_steps_per_epoch, *args)  # type: ignore[misc]
        self._state.load(self.state.stateful_callbacks)
        if self.skipped and not self.args.ignore_data_skip:
            epochs, windows = divmod(self.state.global_step + self.skipped, num_update_steps_per_epoch)
            batches = windows * self.args.gradient_accumulation_steps
        return epochs, batches


def refuse_untested(trainer: Any, path: str, *, deepspeed: bool = True, fsdp: bool = True) -> None:
    """Refuse, before training, a stack ``path`` is not tested under: DataParallel in one process, tensor,
    context or sequence parallelism, and DeepSpeed and FSDP where asked. The fix is DDP."""
    n_gpu = trainer.args.n_gpu
    stacks = [f"n_gpu={n_gpu} (DataParallel in one process: it splits each batch without telling the loss)"
              ] if n_gpu > 1 else []
    parallel = getattr(trainer.accelerator, "parallelism_config", None)
    stacks += [f"{size}={getattr(parallel, size)} (one batch held by several processes)"
               for size in ("tp_size", "cp_size", "sp_size") if (getattr(parallel, size, None) or 1) > 1]
    stacks += [name for name, on in (("DeepSpeed", deepspeed and trainer.is_deepspeed_enabled),
                                     ("FSDP", fsdp and trainer.is_fsdp_enabled)) if on]
    if stacks:
        raise ConfigurationError(f"{type(trainer).__name__}: {path} is not tested here under {' and '.join(stacks)}; "
                                 "train with DDP (one process per device under torchrun)")
