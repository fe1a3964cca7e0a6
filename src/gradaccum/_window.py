"""One window (:class:`Window`): its micro-batches' forward and weighted backward, then one boundary; and what it
needs from its Accumulator (:class:`Parts`). Walked through in docs/architecture.md ("One micro-batch's trip")."""

from __future__ import annotations

import contextlib
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._boundary import Boundary, InFlight, Totals
from ._checks import Count, batchnorms, scalar_loss, split_loss_output, tracking_instance_norms
from ._empty import clean_mean, graph_leaves, may_be_empty, weighing_nothing
from ._ranks import RankAgreement, Request, Setup
from ._settings import refuse_unscaled_fp16
from ._state import AccumulatorState
from ._weights import Gradients, WindowWeights
from .precision import MixedPrecision
from .result import StepResult
from .errors import ConfigurationError
from .sync import GradSync
from ._deepspeed import not_known_up_front
from ._autosize import is_out_of_memory

__all__ = ["Window", "Parts", "OpenWindow"]

_NOTHING = contextlib.nullcontext()  # a block that switches nothing, a backward that guards nothing
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclass(eq=False)
class OpenWindow:
    """The slot of the one window open per Accumulator: entering refuses a second, warns once of training BatchNorm."""

    window: Optional["Window"] = None
    stepping: bool = False  # the window's own optimizer step is under way

    def refuse_a_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook: a step of the caller's own while a window is open would step on a
        partial gradient, weighed by R rather than N and unclipped, and the window would step again."""
        if self.window is not None and not self.stepping:
            raise RuntimeError(
                "optimizer.step() was called while a window is open: the window takes the optimizer step itself, "
                "on the whole window's gradient, at window.step() (acc.step and acc.train call it for you). "
                "Remove your own optimizer.step() (and optimizer.zero_grad(): the window clears the gradients)")

    def check_idle(self) -> None:
        if self.window is not None:
            raise RuntimeError(
                "a window is already open on this Accumulator: finish it with window.step() before calling step(), "
                "train() or window() again (a nested window would drop the open window's gradients)")

    def enter(self, window: "Window") -> None:
        if self.window is not None:  # before anything changes: a nested window would clear the open one
            self.check_idle()
        model, state, params = window.ctx.model, window.ctx.state, window.ctx.grads.params
        trainable = tuple(map(_REQUIRES_GRAD, params))
        if trainable != state.trainable:  # frozen or unfrozen since the last window
            if window.ctx.sync.replicated_grads:
                raise ConfigurationError(
                    "a parameter's requires_grad changed since the Accumulator was built: DDP reduces the parameters "
                    "that required grad when it wrapped the model, so the replicas would drift apart without a "
                    "word. After freezing or unfreezing, wrap the model in DDP again and build a new Accumulator "
                    "over it (acc.state_dict() carries the Accumulator's state over)")
            refuse_unscaled_fp16(model, window.ctx.boundary.optimizer, window.ctx.precision.precision)
            window.ctx.boundary.watch_replicas()  # FSDP2: a plain parameter unfrozen is compared at this boundary
            state.trainable = trainable
        if model.training and "batchnorm" not in state.warned:
            if state.norms is None:
                state.norms = batchnorms(model) + tracking_instance_norms(model)
            names = [n for n, m in state.norms if m.training]
            if names and state.warn_once("batchnorm"):
                listed = f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for _, m in state.norms):
                    said = (f"the model holds BatchNorm layers in training mode {listed}: their statistics are per "
                            "micro-batch, so accumulation is not equivalent to one big batch. Check with "
                            "gradaccum.check_equivalence, or use GroupNorm/LayerNorm.")
                else:
                    said = (f"the model holds InstanceNorm layers that track running statistics {listed}: the "
                            "gradient is one big batch's, but they update those statistics once per micro-batch, so "
                            "the statistics eval() normalizes with are not. Pass track_running_stats=False, or check "
                            "with gradaccum.check_equivalence.")
                warnings.warn(said, stacklevel=4)  # acc.step's line (acc.window's block: one frame fewer)
        self.window = window


@dataclass(frozen=True)
class Parts:
    """What a window needs from its Accumulator, in one place: the parts it runs through, the state it changes."""

    model: nn.Module
    device: torch.device
    sync: GradSync
    precision: MixedPrecision
    grads: Gradients
    ranks: RankAgreement
    boundary: Boundary
    slot: "OpenWindow"  # at most one window open at a time
    state: AccumulatorState
    switches: bool = field(init=False)  #: micro-batches enter a context: the sync switch (across ranks), autocast
    direct: bool = field(init=False)  #: one process in fp32: a micro-batch's backward is the seam's own, bare
    plain: "_MicroBatch" = field(init=False)  #: the block where none enters a context: one for every window

    def __post_init__(self) -> None:
        switches = self.sync.shares_windows or self.precision.dtype is not None
        object.__setattr__(self, "switches", switches)
        object.__setattr__(self, "direct", not switches and self.precision.precision == "fp32")
        object.__setattr__(self, "plain", _MicroBatch(self.slot, False))


@dataclass(eq=False)
class _MicroBatch:
    """One micro-batch's context: the sync switch (no reduction unless ``reduces``) and autocast, where they act."""

    slot: OpenWindow
    reduces: bool
    #: the window a block that switches was made for (None: the plain block every window shares)
    owner: Optional["Window"] = None
    stack: Optional[contextlib.ExitStack] = field(default=None, init=False)

    def __enter__(self) -> None:
        window = self.slot.window
        if window is None or (self.owner is not None and self.owner is not window):  # a block kept past its window
            raise RuntimeError(_NOT_OPEN.format(what="micro_batch"))
        if window.ctx.switches:
            self.stack = stack = contextlib.ExitStack()
            stack.enter_context(window.ctx.sync.micro_batch(last=self.reduces))
            stack.enter_context(window.ctx.precision.autocast())
        window.current, window.entered_at = self, window.done

    def __exit__(self, *exc: Any) -> None:
        self.slot.window.current = None
        if self.stack is not None:
            self.stack.close()  # restores every switch, also when an exception leaves the block


class Window:
    """One open window: its micro-batches, each a forward and backward, then one ``step()``. Not built directly:
    ``acc.window(micro_batches)`` opens one (the constructor's arguments are the Accumulator's parts).

    For people who keep their own loop (``step`` and ``train`` run on it). Every micro-batch runs inside
    ``micro_batch()`` (which skips the reduction before the last one, and autocasts) and hands ``backward``
    its *mean* loss and item count::

        with acc.window(len(micro_batches)) as window:
            for mb in micro_batches:
                with window.micro_batch():
                    loss = criterion(model(mb[0]), mb[1])
                    window.backward(loss, num_items=len(mb[0]))
            result = window.step()

    A rank whose data ran out opens ``acc.window(0, pad=True)`` and runs ``window.padding`` zero-weight
    micro-batches (``backward_padding``). Leaving the block without ``step()`` drops the window's gradients.
    """

    def __init__(self, ctx: Parts, request: Request, *, micro_batch_size: Optional[Any] = None) -> None:
        self.ctx, self.request, self.micro_batch_size = ctx, request, micro_batch_size
        self.setup: Optional[Setup] = None  # what the ranks decided as the window opened
        self._weights: Optional[WindowWeights] = None  # see the weights property
        self.done = 0  # micro-batches run, flush and padding included
        self.tally: List[Tuple[torch.Tensor, Count]] = []  # per micro-batch: mean loss, count
        self.current: Optional[_MicroBatch] = None  # the micro_batch() block running now, entered when
        self.entered_at = 0  # this many micro-batches were done (its backward makes it one more)
        self.reduced = False  # the backward that reduces across ranks has run
        self.in_flight: Optional[InFlight] = None  # the boundary's all-reduce, launched before that backward
        self.result: Optional[StepResult] = None
        self.abandoned = False
        self.micro_batches: Optional[int] = None  # this rank's, padding included (None: opened without a size)
        self.padding = 0  # zero-weight micro-batches the ranks ask this rank to run on top of its own

    def __enter__(self) -> "Window":
        ctx = self.ctx
        ctx.slot.enter(self)
        ctx.grads.open()
        try:
            if ctx.boundary.scheduler is not None:
                ctx.boundary.check_scheduler()
            setup = self.setup = ctx.ranks.open(self.request)
            n, self.padding = self.request.micro_batches, setup.padding
            self.micro_batches = None if n is None else n + setup.padding
            if setup.counted is None:  # R known now; else at the first backward, when the ranks' count arrives
                self._weights = WindowWeights(ctx.state, ctx.sync.grad_divisor, reference=setup.reference)
        except BaseException as error:  # the window leaves as a block an exception left
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    @property
    def reference(self) -> Optional[float]:
        """R, which divides the backward weights: known as the window opened, else fixed at its first backward."""
        return self.ctx.state.reference if self.setup is None else self._weights and self._weights.reference

    @property
    def weights(self) -> WindowWeights:
        """The window's :class:`~gradaccum._weights.WindowWeights`: made as it opens, or from the ranks' count at
        its first backward."""
        if self._weights is None:
            if self.setup is None:
                raise RuntimeError("read window.weights inside `with acc.window(...) as window:`")
            self._weights = WindowWeights(self.ctx.state, self.ctx.sync.grad_divisor,
                                          reference=self.ctx.ranks.reference(self.setup))
        return self._weights

    def micro_batch(self, *, last: Optional[bool] = None) -> _MicroBatch:
        """Context for one micro-batch's forward and backward. Only the last reduces gradients across ranks:
        ``last`` says which it is where the window was opened without a size."""
        if self.setup is None or self.ctx.slot.window is not self:
            raise RuntimeError(_NOT_OPEN.format(what="micro_batch"))
        if self.current is not None:
            raise RuntimeError(_NESTED.format(k=self.entered_at + 1))
        size = self.micro_batches
        if size is not None and self.done >= size:
            raise RuntimeError(_ALL_RAN.format(opened=_micro_batches(size)))
        if last is None:
            if size is None:
                raise ConfigurationError("pass micro_batch(last=...) when the window was opened without a size")
            last = self.done == size - 1
        if not self.ctx.switches:
            return self.ctx.plain  # no switch to flip, nothing reduces: one context serves them all
        return _MicroBatch(self.ctx.slot, last and self.ctx.sync.shares_windows and not self.request.defer, self)

    def backward(self, loss: torch.Tensor, num_items: Count) -> None:
        """Backpropagate ``loss`` with the weight ``n_k * W / R``; file it and its count in the tally.

        Args:
            loss: the **mean** loss over the micro-batch's items, a scalar tensor.
            num_items: how many items that mean is over (an int, a float weight, or a tensor left on the
                device). 0 items weigh nothing, nan mean and backward included.
        """
        if self.current is None or self.done != self.entered_at or self.reduced or type(loss) is not torch.Tensor \
                or loss.dim() or not loss.requires_grad:  # the common scalar loss in its block passes straight on
            loss = _checked(self, loss)
        counted = type(num_items) is int and num_items > 0
        if not counted:  # a mean over no item (nan) cleaned to 0
            loss = clean_mean(loss, num_items)
        weights = self._weights
        if weights is None or weights.reference is None:  # R not known as the window opened: fixed now
            self.fix_reference(num_items)
            weights = self._weights
        weight = weights.weight_of.get(num_items) if counted else None  # type: ignore[union-attr]
        if weight is None:  # n_k * W / R, once per window and Python count (mean_weight keeps it in weight_of)
            weight = weights.mean_weight(num_items, loss.dtype)  # type: ignore[union-attr]  # R is fixed
        weighted = loss * weight
        self.tally.append((loss.detach(), num_items))
        if counted and self.ctx.direct:  # one process in fp32: the seam's backward, with nothing around it
            self.ctx.sync.backward(weighted)
            self.done += 1
        else:
            self._backprop(weighted, num_items)

    def backward_padding(self, loss: torch.Tensor) -> None:
        """Backpropagate a zero-weight micro-batch: nothing to the gradient or the counts, but the collectives."""
        loss = _checked(self, loss)
        self.fix_reference(0)  # takes part in fixing R, as the ranks with data do
        self._backprop(loss.nan_to_num(0.0) * 0.0, autocast_off=True)

    def backward_part(self, outputs: List[torch.Tensor], grads: List[torch.Tensor], loss: torch.Tensor,
                      num_items: Count) -> None:
        """A window loss's part (:mod:`gradaccum._cached`): ``outputs`` backpropagated with ``grads``, weighed."""
        _checked(self, None)
        self.tally.append((loss.detach(), num_items))
        self._before_reduction()
        with torch.autocast(device_type=self.ctx.device.type, enabled=False):
            torch.autograd.backward(list(outputs), list(grads))
        self.done += 1

    def run(self, loss_fn: Callable[..., Any], micro_batches: List[Any], counts: Any, *, flush: Sequence[Any] = (),
            catch_oom: bool = False) -> bool:
        """Each micro-batch through ``loss_fn(model, micro_batch)`` and :meth:`backward` (a bare mean weighed
        by its ``counts`` entry, a ``(mean, count)`` pair by its own), after the zero-weight ``flush`` and
        before the padding the ranks ask for. False where ``catch_oom`` caught an out-of-memory error."""
        model, oom, switches = self.ctx.model, False, self.ctx.switches
        try:
            for mb in flush:
                with self.micro_batch():
                    self.backward_padding(split_loss_output(loss_fn(model, mb), 0)[0])
            for mb, count in zip(micro_batches, counts.each):
                if not switches:  # nothing to switch around it: the block is only its bookkeeping, done here
                    self.current, self.entered_at = self.ctx.plain, self.done
                with self.micro_batch() if switches else _NOTHING:
                    out = loss_fn(model, mb)
                    if type(out) is torch.Tensor:  # a bare mean loss, weighed by the count known up front
                        if counts.unchecked is not None:
                            counts.weigh_bare_mean()
                        self.backward(out, count)
                    else:
                        loss, counted = split_loss_output(out, count)
                        self.backward(loss, counted)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error to catch
            if not (catch_oom and is_out_of_memory(error)):
                raise
            oom = True
        finally:
            self.current = None  # also where loss_fn raised: no block is left open (nor a cycle through it)
        if micro_batches:
            self.ctx.ranks.remember(micro_batches[-1])  # to pad a later window where this rank has none
        if oom:
            return False
        for _ in range(self.padding):  # what the ranks' counts ask of this rank
            with self.micro_batch():
                self.backward_padding(split_loss_output(loss_fn(model, self.ctx.state.padding_batch), 0)[0])
        return True

    def _backprop(self, weighted: torch.Tensor, num_items: Count = 1, *, autocast_off: bool = False) -> None:
        """One micro-batch's backward of its weighted loss, through the loss scale and the seam. A mean over 0
        items is skipped where it runs no collective, else runs under :func:`weighing_nothing` (not under DeepSpeed)."""
        ctx = self.ctx
        empty = None if (type(num_items) is int and num_items > 0) or ctx.sync.owns_step else may_be_empty(num_items)
        if empty is True and not self.current.reduces and not ctx.sync.needs_equal_counts:
            pass  # skipped: it adds exactly nothing and runs no collective (its graph goes with it)
        elif ctx.direct and not autocast_off and empty is None:
            ctx.sync.backward(weighted)
        else:
            if ctx.switches:
                self._before_reduction()
            # FSDP2's forward ran on unsharded parameters, leaves of the graph but not the module's
            with _NOTHING if empty is None else weighing_nothing(
                    graph_leaves(weighted) if ctx.sync.sharded_grads else ctx.model.parameters(), empty):
                ctx.precision.backward(weighted, autocast_off=autocast_off, run=ctx.sync.backward)
        self.done += 1

    def _before_reduction(self) -> None:
        """Before the backward that reduces across ranks, start the boundary's all-reduce: it overlaps it."""
        if self.current.reduces:  # type: ignore[union-attr]
            self.reduced = True
            if self.ctx.boundary.launch_before_last_backward:
                self.in_flight = self.ctx.boundary.launch(self._totals(ran=True))

    def fix_reference(self, count: Count) -> float:
        """R: known as the window opened, else fixed now (:meth:`WindowWeights.fix_reference`)."""
        if self.setup is None or self.ctx.slot.window is not self:
            raise RuntimeError(_NOT_OPEN.format(what="backward"))
        weights = self.weights
        if weights.reference is None:
            if self.ctx.sync.needs_count_first:
                raise not_known_up_front()  # before any backward: nothing reached the gradient
            weights.fix_reference(count, self.ctx.ranks.largest)
        return weights.reference  # type: ignore[return-value]

    def step(self) -> StepResult:
        """Take (or skip) the window's one optimizer step (:meth:`Boundary.finish`); the ranks learn from it."""
        ctx, done = self.ctx, self.done
        if self.setup is None or ctx.slot.window is not self:
            raise RuntimeError(_NOT_OPEN.format(what="step"))
        if self.result is not None:
            raise RuntimeError("step() was already called for this window; open a new one")
        if done == 0 and not (self.setup.plan is not None and ctx.sync.shares_windows):
            raise RuntimeError(_NO_BACKWARD)
        if self.micro_batches is not None and done != self.micro_batches:
            raise RuntimeError(_MISCOUNTED.format(opened=_micro_batches(self.micro_batches), ran=done))
        totals = self._totals(ran=done > 0)  # a window that counts first has read its count by now
        if self.request.defer:
            ctx.sync.reduce_gradients_(ctx.grads.materialized())
        ctx.slot.stepping = True
        try:
            told, self.result = ctx.boundary.finish(totals, self.in_flight, micro_batch_size=self.micro_batch_size,
                                                    micro_batches=done - self.request.flush - self.padding)
        finally:
            ctx.slot.stepping = False
        ctx.ranks.learn(self.setup, told)  # type: ignore[arg-type]
        return self.result

    def _totals(self, *, ran: bool) -> Totals:
        can_pad_next = self.ctx.sync.shares_windows and self.ctx.ranks.can_pad(self.request.can_pad)  # exchanged
        weights = self._weights or self.weights  # the property only where none was made (no backward ran)
        return Totals(self.tally, weights, ran=ran, can_pad_next=can_pad_next,
                      counted_first=self.request.items is not None)

    def abandon(self) -> None:
        """Drop this window's gradients (as the block ends) and take no step (after an out-of-memory error)."""
        self.abandoned = True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leaves the Accumulator's slot. Without a step (an exception, ``abandon()``, or a forgotten
        ``step()``) the window's gradient and buffers are dropped; a forgotten ``step()`` raises."""
        self.ctx.slot.window = None  # a window refused as it opened (a second one) never reaches __exit__
        if self.result is None:
            self.ctx.grads.drop()
            if exc_type is None and not self.abandoned:
                raise RuntimeError(_NO_STEP)


def _checked(window: "Window", loss: Any) -> Any:
    """``loss`` (when given) checked, once ``window`` is inside a block and before its reducing backward."""
    if window.current is not None and window.done != window.entered_at:
        raise RuntimeError(_TWICE.format(k=window.entered_at + 1))
    if window.reduced:
        raise RuntimeError(_AFTER_REDUCTION)
    if window.current is None:
        raise RuntimeError(_OUTSIDE)
    return None if loss is None else scalar_loss(loss, where="window.micro_batch()")


_NOT_OPEN = "use window.{what}() inside `with acc.window(...) as window:`"
_NO_STEP = ("the window was closed without step(); call window.step() inside the `with acc.window(...)` block to "
            "take its optimizer step")
_NO_BACKWARD = ("step() on a window where window.backward() never ran: call window.backward(loss, num_items=...) "
                "inside `with window.micro_batch():` for each micro-batch (a plain loss.backward() is not counted, so "
                "the step could not be normalized)")
_MISCOUNTED = ("the window was opened for {opened} but {ran} ran; under data parallelism the last one is the one that "
               "reduces gradients, so the counts must match")
_ALL_RAN = ("the window was opened for {opened} and all have run; call window.step(), or open it with the right "
            "micro_batches")
_NESTED = ("window.micro_batch() opened inside another micro_batch() (micro-batch {k} of the window is still "
           "open): each micro-batch is one block, one after the other; close the open block before opening the "
           "next, and run one window.backward in each")
_OUTSIDE = ("window.backward() must run inside `with window.micro_batch():`, which also wraps the forward pass "
            "(DDP decides in forward whether the backward reduces)")
_TWICE = ("window.backward called twice in one micro-batch (micro-batch {k} of the window): each "
          "`with window.micro_batch():` block runs one forward and one window.backward(loss, num_items=...); add the "
          "losses into one before its backward, or give each its own micro_batch() block (and the window as many "
          "micro-batches)")
_AFTER_REDUCTION = ("window.backward() after the backward of the micro-batch that reduces across ranks (the last): the "
                    "window's gradient was already reduced and its counts fixed. Run one backward per micro_batch() "
                    "block, and mark only the last micro-batch with micro_batch(last=True)")


def _micro_batches(n: int) -> str:
    return f"{n} micro-batch" if n == 1 else f"{n} micro-batches"
