"""A :class:`WindowLoss`'s big-batch gradient in two passes, the representations cached (GradCache): steps
and cost in docs/guides/contrastive.md, weights in docs/architecture.md ("The cached two passes")."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._checks import as_number, batchnorms, training_batchnorms
from ._weights import backward_weight
from ._random import Replay
from ._ranks import Plan, Request
from ._window import Window, Parts
from .batching import Batch, rebuild, leaves, leading_dim
from .result import StepResult
from .errors import ConfigurationError

__all__ = ["WindowLoss", "Constant", "CachedPasses", "run_cached_window", "check_window_loss",
           "window_loss_of_batch"]

class WindowLoss:
    """A loss over the whole window, for losses whose items depend on each other (in-batch negatives,
    contrastive and CLIP losses): ``acc.step`` and ``acc.train`` take one instead of a ``loss_fn`` and step on
    the big batch's gradient exactly: ``loss(model, encode(model, whole_window))``, whatever the micro-batch
    size, over any number of ranks. docs/guides/contrastive.md has the maths and the cost (one more forward per
    micro-batch, its random draws, dropout's, replayed so that it equals the first).

    Args:
        encode: ``encode(model, micro_batch)`` -> the micro-batch's representations: a tensor, or a
            tuple/list/dict of tensors, each with the micro-batch's items along dim 0 (float tensors
            must depend on the model; integer ones, such as labels, ride along).
        loss: ``loss(model, representations)`` -> a scalar: the whole window's loss, given the model
            ``encode`` gets (its own parameters, such as a learned temperature, are reached through it)
            and the same structure with every micro-batch's representations on every rank joined along
            dim 0, in window order (rank 0's micro-batches first, then rank 1's, ...).
        keep_graphs: how many micro-batches' graphs pass 1 keeps, the first ones (pass 2 runs in order, so
            they are backpropagated before any forward runs again): each saves its forward in pass 2, at the
            memory of its activations held through the loss. Default 1; 0 for the least memory. Under DDP at most
            all but one (the last backward, which reduces, is a replayed forward); under FSDP2 and with BatchNorm in
            training mode none.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> from gradaccum import Accumulator
        >>> model = nn.Linear(4, 3)
        >>> def in_batch_negatives(model, reps):
        ...     q, d = reps["q"], reps["d"]
        ...     return nn.functional.cross_entropy(q @ d.T, torch.arange(len(q)))
        >>> clip = WindowLoss(lambda m, b: {"q": m(b[0]), "d": m(b[1])}, in_batch_negatives)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> acc.step((torch.randn(10, 4), torch.randn(10, 4)), clip, micro_batch_size=4).num_items
        10
    """

    def __init__(self, encode: Callable[[nn.Module, Batch], Any], loss: Callable[[nn.Module, Any], torch.Tensor], *,
                 keep_graphs: int = 1) -> None:
        if not isinstance(keep_graphs, int) or isinstance(keep_graphs, bool) or keep_graphs < 0:
            raise ConfigurationError(f"WindowLoss(keep_graphs={keep_graphs!r}): how many micro-batches' graphs pass 1 "
                                     "keeps (their forward is not run again) is an int >= 0; 0 keeps none (the least "
                                     "memory), 1 (the default) the first one's")
        if not callable(encode):
            raise TypeError(f"WindowLoss(encode=...) must be callable as encode(model, micro_batch) -> "
                            f"representations, got {encode!r}")
        if not callable(loss):
            raise TypeError(f"WindowLoss(loss=...) must be callable as loss(model, representations) -> scalar, "
                            f"got {loss!r}")
        self.encode, self.loss, self.keep_graphs = encode, loss, keep_graphs

    def __call__(self, model: nn.Module, micro_batch: Any) -> Any:
        raise ConfigurationError(
            "WindowLoss was called as a loss_fn on one micro-batch; its loss couples the whole window's items, so "
            "pass it to acc.step(...) or acc.train(...), or ExactTrainer(compute_loss_func=...), which run the "
            "window (encode and loss are its attributes, to call them yourself)")

    def __repr__(self) -> str:
        return f"WindowLoss(encode={self.encode!r}, loss={self.loss!r}, keep_graphs={self.keep_graphs})"


class Constant:
    """A tensor in ``encode``'s output that is data, not a representation: joined across the window and the ranks
    like the representations, handed to ``loss`` as the tensor itself, never differentiated. For float labels and
    scores (CoSENT's similarity scores) or a frozen teacher's embeddings; integer and boolean tensors (class labels,
    masks) ride along without it.

    Example:
        >>> encode = lambda m, b: {"pair": m(b["x"]), "score": Constant(b["score"])}  # doctest: +SKIP
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Constant(tensor) takes a tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Constant({tuple(self.tensor.shape)}, {self.tensor.dtype})"


def _flat(out: Any, count: Optional[int], k: int) -> List[torch.Tensor]:
    """The representations' tensors, depth first, each checked to hold ``count`` rows (None: the first's)."""
    flat = []
    for path, leaf in leaves(out):
        if isinstance(leaf, Constant):
            leaf = leaf.tensor.detach()
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            what = "a 0-d tensor" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ConfigurationError(
                f"WindowLoss: encode(model, micro_batch) returned {what} at representations{path}; every "
                "representation must be a tensor with the micro-batch's items along dim 0 (a tensor, or a "
                "tuple/list/dict of them)")
        count = leaf.shape[0] if count is None else count
        if leaf.shape[0] != count:
            raise ConfigurationError(
                f"WindowLoss: representations{path} of micro-batch {k} have leading size {leaf.shape[0]}, but "
                f"the micro-batch holds {count} items: each representation needs one row per item, along "
                "dim 0 (several negatives per query go in one row: shape (items, negatives, dim))")
        flat.append(leaf)
    if not flat:
        raise ConfigurationError("WindowLoss: encode(model, micro_batch) returned no tensor; return the micro-batch's "
                         "representations (a tensor, or a tuple/list/dict of tensors)")
    return flat


@contextlib.contextmanager
def _batchnorm_stats_kept(model: nn.Module) -> Iterator[None]:
    """BatchNorm's running statistics put back after pass 1: they move once per micro-batch, not twice."""
    kept = [(t, t.clone()) for _, m in batchnorms(model) if m.training for t in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:  # BatchNorm updates its statistics in place
                buffer.copy_(value)


def _checked_loss(out: Any, *, needs_grad: bool = True) -> torch.Tensor:
    """``loss``'s result, refused unless a scalar that depends on them (if ``needs_grad``: not under no_grad)."""
    if isinstance(out, (tuple, list)):
        raise ConfigurationError("WindowLoss: loss(model, representations) returned a tuple; it returns the window's "
                                 "loss, one scalar, which is already over every item (a (mean, count) pair is for "
                                 "loss_fn)")
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigurationError(f"WindowLoss: loss(model, representations) must return a scalar tensor, got {shape}; "
                                 "reduce it over the window's items (.mean())")
    if needs_grad and not out.requires_grad:
        raise ConfigurationError("WindowLoss: loss(model, representations) does not depend on the representations (it "
                                 "does not require grad); compute it from the tensors it is given, without .detach() "
                                 "or .item()")
    return out


def check_window_loss(num_items: Any, micro_batch_size: Any) -> None:
    """What a :class:`WindowLoss` does not take, refused before anything runs."""
    if num_items is not None:
        raise ConfigurationError("num_items= was given with a WindowLoss: the window's loss is already over all of its "
                         "items (the representations' rows), so there are no per-micro-batch counts to weigh; "
                         "drop num_items")
    if micro_batch_size == "auto":
        raise ConfigurationError("micro_batch_size='auto' is not supported with a WindowLoss: pass an int "
                                 "micro_batch_size (the cached representations of a window that ran out of memory "
                                 "would be recomputed anyway)")


def run_cached_window(ctx: Parts, micro_batches: List[Batch], window_loss: WindowLoss, counts: Any, *,
                      micro_batch_size: Any = None, plan: Optional[Plan] = None) -> StepResult:
    """The Accumulator's driver of :class:`CachedPasses`: one window, in its order."""
    sizes = [int(as_number(c)) for c in counts.each]
    request = Request(len(micro_batches), counts.total, can_pad=ctx.ranks.can_pad(bool(micro_batches)), plan=plan)
    with Window(ctx, request, micro_batch_size=micro_batch_size) as window:
        if micro_batches:
            ctx.ranks.remember(micro_batches[-1])
        passes = CachedPasses(window_loss, micro_batches, sync=ctx.sync, device=ctx.device, sizes=sizes,
                              padding=window.padding, padding_batch=ctx.state.padding_batch,
                              checked=ctx.state.checked_replays, autocast=ctx.precision.autocast)
        passes.first_pass(ctx.model)
        total = passes.gather()
        window.fix_reference(total)
        passes.loss_gradient(ctx.model, ctx.grads.params, weight=window.weights.window_loss_weight(total),
                             scale=ctx.precision.scale)
        for k in range(passes.parts):
            with window.micro_batch():
                outputs, grads, items = passes.part(k, ctx.model)
                window.backward_part(outputs, grads, passes.loss, items)
        passes.finish()  # in the first window a WindowLoss runs, its replay compared (then marked checked)
        return window.step()


class CachedPasses:
    """One window of a :class:`WindowLoss`, in the order every driver calls it (docs/architecture.md):
    :meth:`first_pass`, :meth:`gather`, :meth:`loss_gradient`, :meth:`part` (or :meth:`surrogate`) for ``k`` in
    ``range(parts)``, :meth:`finish`. ``sizes``: each micro-batch's items, or None (read from the representations).
    ``checked``: the driver's ``checked_replays`` (None: never check); in a loss's
    first window pass 2 is compared with pass 1 (to float rounding: one has a graph)."""

    def __init__(self, window_loss: WindowLoss, micro_batches: Sequence[Batch], *, sync: Any, device: torch.device,
                 sizes: Optional[List[int]] = None, padding: int = 0, padding_batch: Any = None, checked: Any = None,
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        self.window_loss, self.micro_batches = window_loss, list(micro_batches)
        self.sync, self.device, self.sizes, self.autocast, self.checked = sync, device, sizes, autocast, checked
        self.check = checked is not None and window_loss not in checked
        self.replay = Replay(device, sync, "WindowLoss", "gave other representations (encode's outputs)", rtol=1e-5)
        self.padding, self.padding_batch = padding, padding_batch
        self.cached: List[List[torch.Tensor]] = []
        self.spec: Any = None
        self.empty: List[torch.Tensor] = []
        self.graphs: Dict[int, List[torch.Tensor]] = {}  # micro-batch -> its representations with their graph
        self.differentiable: List[bool] = []
        self.joined: List[torch.Tensor] = []
        self.offset = self.total = self.ran = 0
        self.loss: Optional[torch.Tensor] = None  # the window's loss L, detached (after loss_gradient)
        self.slices: List[Optional[torch.Tensor]] = []
        self.carried: List[Tuple[Any, Any]] = []

    @property
    def parts(self) -> int:
        """Backward parts this rank runs in pass 2."""
        return len(self.micro_batches) + self.padding

    def graphs_to_keep(self, model: nn.Module) -> int:
        """``keep_graphs`` as this window can keep them (:class:`WindowLoss`): none under FSDP2 (its forwards gather
        and free shards in order) or training BatchNorm (pass 1 restores its statistics); under DDP all but the last
        (its forward runs under the wrapper's sync), the same on every rank (a kept forward is a collective)."""
        own = len(self.micro_batches)
        if self.window_loss.keep_graphs == 0 or self.sync.sharded_grads or training_batchnorms(model):
            return 0
        keep = min(self.window_loss.keep_graphs, own)
        if self.sync.shares_windows:  # every rank asks, one without micro-batches too
            keep = self.sync.min_across(min(keep, own - 1), self.device)
        return max(keep, 0)

    def first_pass(self, model: nn.Module, *, graph_model: Optional[nn.Module] = None) -> None:
        """Each micro-batch's representations without a graph, the random state saved before each; the first
        :meth:`graphs_to_keep` with their graph, on ``graph_model`` if given (a Trainer's data-parallel wrapper)."""
        keep = self.graphs_to_keep(model)
        with torch.no_grad(), _batchnorm_stats_kept(model), self.autocast():
            for k, mb in enumerate(self.micro_batches):
                self.replay.save()
                if k < keep:
                    with torch.enable_grad(), self.sync.micro_batch(last=False):
                        out = self.window_loss.encode(graph_model if graph_model is not None else model, mb)
                else:
                    out = self.window_loss.encode(model, mb)
                outs = _flat(out, None if self.sizes is None else self.sizes[k], k)
                if k < keep:
                    self.graphs[k] = outs
                self.cached.append([o.detach() for o in outs])
                self.spec = out if self.spec is None else self.spec
            for _ in range(self.padding):
                out = self.window_loss.encode(model, self.padding_batch)
                if self.spec is None:
                    self.spec, self.empty = out, [t[:0] for t in _flat(out, leading_dim(self.padding_batch), 0)]
        self.replay.saved_all()
        self.sizes = [c[0].shape[0] for c in self.cached]
        # per tensor, in _flat's order: whether the loss is differentiated by it (a float, not a Constant)
        self.differentiable = [isinstance(t, torch.Tensor) and t.is_floating_point() for _, t in leaves(self.spec)]

    def gather(self) -> int:
        """Every rank's representations, joined (rank 0's first); returns the window's N, every rank's."""
        if not self.cached and not self.empty:
            raise ConfigurationError("WindowLoss: this rank has no micro-batch in the window and none to pad with: "
                                     "give it one with acc.set_padding(micro_batch)")
        local = [torch.cat(column) for column in zip(*self.cached)] if self.cached else self.empty
        self.joined, self.offset = self.sync.gather_items(local)
        self.total = int(self.joined[0].shape[0])
        return self.total

    def loss_gradient(self, loss_model: Any, params: Sequence[torch.Tensor], *, weight: float = 1.0,
                      scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
        """The window's loss ``L`` (the same on every rank), returned, and the gradient of ``scale(weight * L)``
        (``L`` in float32 at least; ``scale``: the Accumulator's GradScaler, a Trainer's scales the surrogate):
        this rank's slices of the representations' (times ``W``), the loss's own parameters' (in ``.grad``
        now, or carried by the last part: :attr:`gradaccum.sync.GradSync.folds_outside_gradients`)."""
        inputs = [t.detach().requires_grad_(d) for t, d in zip(self.joined, self.differentiable)]
        with self.autocast():
            loss = _checked_loss(self.window_loss.loss(loss_model, rebuild(self.spec, iter(inputs))))
        wrt = [t for t in inputs if t.requires_grad]  # the representations; labels and Constants ride along
        outside = [p for p in params if p.requires_grad]  # those the loss reaches itself get a gradient
        weighted = scale(loss.to(torch.promote_types(loss.dtype, torch.float32)) * weight)
        with torch.autocast(device_type=self.device.type, enabled=False):
            found = iter(torch.autograd.grad(weighted, wrt + outside, allow_unused=True))
        of_inputs = [next(found) if t.requires_grad else None for t in inputs]
        if all(g is None for g in of_inputs):  # refused before any backward, on every rank alike (the same loss)
            raise ConfigurationError(
                "WindowLoss: loss(model, representations) does not depend on the representations encode returned "
                "(its gradient with respect to every one of them is None), so the step would train only the loss's "
                "own parameters (a temperature). Compute the loss from the representations it is given; reaching "
                "model outputs another way (model.logit_scale alone, a closure over earlier outputs) is not it. "
                "No step was taken")
        end = self.offset + sum(self.sizes)  # this rank's rows
        self.slices = [None if g is None else g[self.offset:end] * self.sync.grad_divisor for g in of_inputs]
        own = [(p, g) for p, g in zip(outside, found) if g is not None]
        if own and not self.sync.folds_outside_gradients:  # in .grad before any backward (DDP reads it there)
            torch.autograd.backward([p for p, _ in own], [g for _, g in own])
        else:
            self.carried = own
        self.loss = loss.detach()
        return self.loss

    def part(self, k: int, model: nn.Module) -> Tuple[List[torch.Tensor], List[torch.Tensor], int]:
        """Part ``k`` of pass 2, inside the driver's micro-batch context: micro-batch k's representations
        (pass 1's kept graph, or its forward replayed) and their gradients, with its item count; past the
        micro-batches, a padding forward with zero gradients. The last part carries the loss's own."""
        own = k < len(self.micro_batches)
        if own and k in self.graphs:
            outs = self.graphs.pop(k)
        elif own:
            self.replay.replay(k)
            outs = _flat(self.window_loss.encode(model, self.micro_batches[k]), self.sizes[k], k)
            if self.check:
                self.replay.compare(outs, self.cached[k])
        else:
            outs = _flat(self.window_loss.encode(model, self.padding_batch), leading_dim(self.padding_batch), 0)
        detached = any(d and not o.requires_grad for o, d in zip(outs, self.differentiable))
        if k == 0 and self.check and self.sync.any_rank(detached, self.device):  # every rank refuses alike
            raise ConfigurationError("WindowLoss: a representation encode returned does not require grad (on this "
                                     "rank or another): it ran under torch.no_grad() or was detached. Return the "
                                     "model's outputs as they are; wrap data that is no output of the model (a float "
                                     "label or score) in gradaccum.Constant")
        if own:
            at = sum(self.sizes[:k])
            pairs = [(o, g[at:at + self.sizes[k]]) for o, g in zip(outs, self.slices) if g is not None]
        else:  # zero weight: it adds nothing, but runs the collectives of a backward
            pairs = [(o, torch.zeros_like(o)) for o, d in zip(outs, self.differentiable) if d and o.requires_grad]
        self.ran = k + 1
        pairs += self.carried if self.ran == self.parts else []
        return [o for o, _ in pairs], [g for _, g in pairs], self.sizes[k] if own else 0

    def surrogate(self, k: int, model: nn.Module) -> torch.Tensor:
        """Part ``k`` as one scalar for a framework that calls ``.backward()`` itself: its gradient is
        :meth:`part`'s (``sum <z, g>``, half-precision terms summed in float32), its value ``L * n_k * W / N``
        (summed over the window and averaged over the ranks: ``L``, which the framework logs)."""
        outs, grads, items = self.part(k, model)
        dtype = torch.promote_types(self.loss.dtype, torch.float32)
        terms = [(o * g.to(o.dtype)).sum().to(dtype) for o, g in zip(outs, grads)]
        total = torch.stack(terms).sum() if terms else self.loss.to(dtype) * 0
        value = self.loss.to(dtype) * backward_weight(items, max(self.total, 1), self.sync.grad_divisor)
        return total - total.detach() + value

    def finish(self) -> None:
        """The random state put back as pass 1 left it; in a checked window, the refusal where a replay differed."""
        self.replay.finish()
        if self.check:
            self.replay.check()
            self.checked.add(self.window_loss)


def window_loss_of_batch(window_loss: WindowLoss, model: nn.Module, loss_model: Any, batch: Batch) -> torch.Tensor:
    """The loss of one batch alone (evaluation): ``loss(loss_model, encode(model, batch))``, checked."""
    out = window_loss.encode(model, batch)
    return _checked_loss(window_loss.loss(loss_model, rebuild(out, iter(_flat(out, None, 0)))),
                         needs_grad=torch.is_grad_enabled())

