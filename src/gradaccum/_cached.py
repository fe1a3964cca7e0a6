"""Losses that couple the window's items (contrastive, in-batch negatives, CLIP), made exact.

A :class:`WindowLoss` maps each micro-batch to its representations (``encode``) and the whole window's
representations, every rank's included, to one loss (``loss``). Accumulating per micro-batch losses
would optimize another objective (each item would see only its micro-batch's negatives); this
computes the big batch's gradient exactly, by caching the representations (GradCache):

    z_k = encode(model, x_k)  for every micro-batch k on every rank,  z = (z_1, ..., z_K)
    grad L(z) = sum_k J_k^T g_k,   g_k = dL/dz_k,   J_k = dz_k/dtheta

1. Pass 1, without a graph: ``z_k`` for each micro-batch, the random state saved before each.
2. The ranks gather ``z`` (rank 0's items first); every rank computes the same ``L(z)`` from detached
   leaves and its gradient with respect to them, and to the loss's own parameters (a learned
   temperature, a head applied inside the loss).
3. Pass 2: each micro-batch's forward again, its random state replayed so that it draws what pass 1
   drew, and backpropagated with its slice of ``g`` (``J_k^T g_k``, a vector-Jacobian product).

In the core's terms (:mod:`gradaccum._maths`) the window's loss is one mean over its N items: it is
backpropagated with the backward weight of N items, ``N / R`` for the loss itself (whose own
parameters' gradient is the same on every rank) and ``N * W / R`` for each slice (the data-parallel
average divides by W), so that after the boundary scale ``R / N`` the step's gradient is ``grad L``:
the big batch's, never off by the world size. ``StepResult.loss`` is L; ``num_items`` is N.

Costs: one more forward per micro-batch (pass 1), one all-gather of the counts and one per
representation tensor across ranks. Peak memory: one micro-batch's activations, plus the window's
representations and the loss's own activations.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ._checks import as_number, training_batchnorms
from ._maths import backward_weight
from ._random import RandomState
from ._ranks import WindowPlan, WindowRequest
from ._window import Window, WindowContext
from .batching import Batch, _rebuild, leaves, leading_dim
from .result import StepResult
from .errors import ConfigurationError, replay_differs

__all__ = ["WindowLoss", "Constant", "run_cached_window", "check_window_loss"]

#: ``encode(model, micro_batch)`` -> representations: a tensor, or a tuple/list/dict of tensors
Encode = Callable[[nn.Module, Batch], Any]
#: ``loss(model, representations)`` -> the window's scalar loss, over every rank's representations
Loss = Callable[[nn.Module, Any], torch.Tensor]


class WindowLoss:
    """A loss over the whole window, for losses whose items depend on each other (in-batch negatives,
    contrastive and CLIP losses): ``acc.step`` and ``acc.train`` take one instead of a ``loss_fn`` and
    step on the big batch's gradient exactly.

    Args:
        encode: ``encode(model, micro_batch)`` -> the micro-batch's representations: a tensor, or a
            tuple/list/dict of tensors, each with the micro-batch's items along dim 0 (float tensors
            must depend on the model; integer ones, such as labels, ride along).
        loss: ``loss(model, representations)`` -> a scalar: the loss of the whole window, given the
            model (as ``encode`` is: the one the Accumulator holds, so its own parameters, such as a
            learned temperature, are reached through it) and the same structure with every
            micro-batch's representations on every rank joined along dim 0, in window order (rank 0's
            micro-batches first, then rank 1's, ...).
        keep_graphs: how many micro-batches' graphs pass 1 keeps, the last ones it runs: their
            forward is not run again in pass 2 (one forward saved each), at the memory of their
            activations held through the loss. Default 1; 0 for the least memory. Under DDP at most
            all but one (the last backward, which reduces, is a replayed forward), under FSDP2 and with
            BatchNorm in training mode none.

    The step equals one optimizer step on ``loss(model, encode(model, whole_window))`` whatever the
    micro-batch size, over any number of ranks; the random draws of each micro-batch's forward
    (dropout) are replayed, so its second forward equals its first. See :mod:`gradaccum._cached` for
    the maths and what it costs (one more forward per micro-batch).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
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

    def __init__(self, encode: Encode, loss: Loss, *, keep_graphs: int = 1) -> None:
        if not isinstance(keep_graphs, int) or isinstance(keep_graphs, bool) or keep_graphs < 0:
            raise ConfigurationError(f"WindowLoss(keep_graphs={keep_graphs!r}): how many micro-batches' graphs pass 1 "
                                     "keeps (their forward is not run again) is an int >= 0; 0 keeps none (the least "
                                     "memory), 1 (the default) the last one's")
        if not callable(encode):
            raise TypeError(f"WindowLoss(encode=...) must be callable as encode(model, micro_batch) -> "
                            f"representations, got {encode!r}")
        if not callable(loss):
            raise TypeError(f"WindowLoss(loss=...) must be callable as loss(model, representations) -> scalar, "
                            f"got {loss!r}")
        self.encode, self.loss, self.keep_graphs = encode, loss, keep_graphs

    def __repr__(self) -> str:
        return f"WindowLoss(encode={self.encode!r}, loss={self.loss!r}, keep_graphs={self.keep_graphs})"


class Constant:
    """A tensor in ``encode``'s output that is data, not a representation: joined across the window and
    the ranks like the representations, handed to ``loss`` as the tensor itself, never differentiated.
    For float labels and scores (CoSENT's similarity scores) or a frozen teacher's embeddings; integer
    and boolean tensors (class labels, masks) ride along without it.

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


def _differentiable(out: Any) -> List[bool]:
    """For each tensor of the representations, in :func:`_flat`'s order: whether ``loss`` is
    differentiated with respect to it (a float tensor that is not a :class:`Constant`)."""
    return [isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for _, leaf in leaves(out)]


def _flat(out: Any, count: int, k: int) -> List[torch.Tensor]:
    """The representations' tensors, depth first, after checking each holds the micro-batch's items."""
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
    """Pass 1 leaves BatchNorm's running statistics as it found them: they move once per micro-batch
    (in pass 2), as under plain accumulation, not twice."""
    names = set(training_batchnorms(model))
    kept = {f"{m}.{b}": t.clone() for m, mod in model.named_modules() if m in names
            for b, t in mod.named_buffers(recurse=False)}
    try:
        yield
    finally:
        if kept:
            buffers = dict(model.named_buffers())
            with torch.no_grad():
                for name, value in kept.items():
                    buffers[name].copy_(value)


def _window_loss(window_loss: WindowLoss, spec: Any, joined: List[torch.Tensor], ctx: WindowContext
                 ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The window's loss, from detached leaves (the differentiable ones require grad), and those leaves."""
    inputs = [t.detach().requires_grad_(d) for t, d in zip(joined, _differentiable(spec))]
    with ctx.precision.autocast():
        out = window_loss.loss(ctx.model, _rebuild(spec, iter(inputs)))
    if isinstance(out, (tuple, list)):
        raise ConfigurationError("WindowLoss: loss(model, representations) returned a tuple; it returns the window's loss, one "
                         "scalar, which is already over every item (a (mean, count) pair is for loss_fn)")
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigurationError(f"WindowLoss: loss(model, representations) must return a scalar tensor, got {shape}; "
                         "reduce it over the window's items (.mean())")
    if not out.requires_grad:
        raise ConfigurationError("WindowLoss: loss(model, representations) does not depend on the representations (it does not "
                         "require grad); compute it from the tensors it is given, without .detach() or .item()")
    return out, inputs


def check_window_loss(num_items: Any, micro_batch_size: Any) -> None:
    """What a :class:`WindowLoss` does not take, refused before anything runs."""
    if num_items is not None:
        raise ConfigurationError("num_items= was given with a WindowLoss: the window's loss is already over all of its "
                         "items (the representations' rows), so there are no per-micro-batch counts to weigh; "
                         "drop num_items")
    if micro_batch_size == "auto":
        raise ConfigurationError("micro_batch_size='auto' is not supported with a WindowLoss: pass an int micro_batch_size "
                         "(the cached representations of a window that ran out of memory would be recomputed "
                         "anyway)")


def run_cached_window(ctx: WindowContext, micro_batches: List[Batch], window_loss: WindowLoss, counts: Any, *,
                      micro_batch_size: Any = None, plan: Optional[WindowPlan] = None) -> StepResult:
    """One window of a :class:`WindowLoss`, in the module docstring's order: pass 1, the loss on every
    rank's representations, pass 2, the step. Every rank runs as many forwards in each pass as the
    window's padding asks (DDP's first forward and FSDP2's every forward are collectives)."""
    ranks = ctx.ranks
    sizes = [int(as_number(c)) for c in counts.each]
    request = WindowRequest(len(micro_batches), counts.total, can_pad=ranks.can_pad(bool(micro_batches)), plan=plan)
    with Window(ctx, request, micro_batch_size=micro_batch_size) as window:
        if micro_batches:
            ranks.remember(micro_batches[-1])
        keep = _graphs_to_keep(ctx, window_loss, len(micro_batches))
        first = _first_pass(ctx, window_loss, micro_batches, sizes, window.padding, keep)
        joined, offset = ctx.sync.gather_items(first.local())
        loss, slices, own = _loss_gradient(ctx, window, window_loss, first.spec, joined, offset, sum(sizes))
        fold = bool(own) and ctx.sync.folds_outside_gradients()
        if own and not fold:  # in .grad before any backward (DDP(find_unused_parameters=True) reads it there)
            torch.autograd.backward([p for p, _ in own], [g for _, g in own])
        _second_pass(ctx, window, window_loss, micro_batches, sizes, first, loss, slices, own if fold else [])
        return window.step()


def _graphs_to_keep(ctx: WindowContext, window_loss: WindowLoss, own: int) -> int:
    """How many of this window's last micro-batches keep their pass-1 graph: ``keep_graphs``, but none
    under FSDP2 (its forwards and backwards gather and free shards in order) or with BatchNorm in
    training mode (pass 1 leaves its statistics as it found them), and under DDP all but one (the
    reducing backward replays its forward) and the same on every rank (the forwards' collectives)."""
    if window_loss.keep_graphs == 0 or type(ctx.sync).__name__ == "FSDP2Sync" or training_batchnorms(ctx.model):
        return 0  # alike on every rank
    keep = min(window_loss.keep_graphs, own)
    if ctx.sync.reduces_across_ranks:  # every rank asks, one without micro-batches too
        keep = ctx.sync.min_across(min(keep, own - 1), ctx.device)
    return max(keep, 0)


def _loss_gradient(ctx: WindowContext, window: Window, window_loss: WindowLoss, spec: Any, joined: List[torch.Tensor],
                   offset: int, mine: int) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]], List[Tuple[Any, Any]]]:
    """The window's loss (the same on every rank), this rank's slice of its gradient with respect to each
    representation (times ``N * W / R``), and the loss's own parameters with their gradient (``N / R``),
    taken by ``autograd.grad``, which writes nothing into ``.grad``."""
    total = joined[0].shape[0]
    loss, inputs = _window_loss(window_loss, spec, joined, ctx)
    wrt = [t for t in inputs if t.requires_grad]  # the representations; labels and Constants ride along
    outside: List[torch.Tensor] = [p for p in ctx.grads.params if p.requires_grad]
    weighted = ctx.precision.scale(loss * backward_weight(total, window.fix_reference(total), 1.0))
    with torch.autocast(device_type=ctx.device.type, enabled=False):
        found = iter(torch.autograd.grad(weighted, wrt + outside, allow_unused=True))
    of_inputs = [next(found) if t.requires_grad else None for t in inputs]
    refuse_a_loss_without_representations(of_inputs)
    slices: List[Optional[torch.Tensor]] = [None if g is None else g[offset:offset + mine] * ctx.sync.grad_divisor
                                            for g in of_inputs]
    own = [(p, g) for p, g in zip(outside, found) if g is not None]
    return loss.detach(), slices, own


def refuse_a_loss_without_representations(grads: List[Optional[torch.Tensor]]) -> None:
    """The loss's gradient with respect to every representation is absent: the step would train only
    the loss's own parameters (a temperature), silently. Refused before any backward (every rank
    computes the same loss, so every rank refuses alike)."""
    if all(g is None for g in grads):
        raise ConfigurationError(
            "WindowLoss: loss(model, representations) does not depend on the representations encode returned "
            "(its gradient with respect to every one of them is None), so the step would train only the loss's "
            "own parameters (a temperature). Compute the loss from the representations it is given; reaching "
            "model outputs another way (model.logit_scale alone, a closure over earlier outputs) is not it. "
            "No step was taken")


def _second_pass(ctx: WindowContext, window: Window, window_loss: WindowLoss, micro_batches: List[Batch],
                 sizes: List[int], first: "_FirstPass", loss: torch.Tensor, slices: List[Optional[torch.Tensor]],
                 carried: List[Tuple[Any, Any]]) -> None:
    """The micro-batches whose graph pass 1 kept are backpropagated first; then each other one's forward
    runs again from its saved random state and is backpropagated with its slice; then the padding the
    ranks need. ``carried`` (the loss's parameters and their gradient) rides in the last backward, the
    one that reduces. The first window compares the replay with pass 1, on every rank."""
    alike, padding_batch = True, ctx.state.padding_batch
    checked = window_loss in ctx.state.checked_replays
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    kept = sorted(first.graphs)
    order: List[Optional[int]] = kept + [k for k in range(len(micro_batches)) if k not in first.graphs]
    order += [None] * window.padding
    for i, k in enumerate(order):
        own = k is not None
        n = sizes[k] if k is not None else leading_dim(padding_batch)
        with window.micro_batch():
            if k is not None and k in first.graphs:
                outs, differentiable = first.graphs.pop(k), first.differentiable
            else:
                if k is not None:
                    first.states[k].restore()
                out = window_loss.encode(ctx.model, micro_batches[k] if k is not None else padding_batch)
                outs, differentiable = _flat(out, n, k if k is not None else 0), _differentiable(out)
                if k is not None:
                    alike &= checked or _same(outs, first.cached[k])
            if i == 0 and not checked:
                _agree_outputs_require_grad(ctx, outs, differentiable)
            if k is not None:
                at = starts[k]
                pairs = [(o, g[at:at + n]) for o, g in zip(outs, slices) if g is not None]
            else:  # zero weight: it adds nothing, but runs the collectives of a backward
                pairs = [(o, torch.zeros_like(o)) for o, d in zip(outs, differentiable) if d and o.requires_grad]
            pairs += carried if i == len(order) - 1 else []
            window.backward_part([o for o, _ in pairs], [g for _, g in pairs], loss, n if own else 0)
    assert first.end is not None, "pass 1 saved where the random state stands after it"
    first.end.restore()  # as after pass 1 alone: the window drew its random numbers once
    if not checked:  # once, and on every rank alike: none raises alone
        ctx.state.checked_replays.add(window_loss)
        if ctx.sync.any_rank(not alike, ctx.device):
            raise replay_differs("WindowLoss", "gave other representations (encode's outputs)")


def _agree_outputs_require_grad(ctx: WindowContext, outs: List[torch.Tensor], differentiable: List[bool]) -> None:
    """In the first window, before any backward: every float representation requires grad, on every rank
    (one rank raising alone would leave the others waiting in the reduction)."""
    detached = [i for i, (o, d) in enumerate(zip(outs, differentiable)) if d and not o.requires_grad]
    if ctx.sync.any_rank(bool(detached), ctx.device):
        raise ConfigurationError("WindowLoss: a representation encode returned does not require grad (on this rank or "
                         "another): it ran under torch.no_grad() or was detached. Return the model's outputs as "
                         "they are")


class _FirstPass:
    """What pass 1 leaves: each micro-batch's representations, the random state before each and after
    all, their structure, and zero-row tensors of their shapes (for a rank that has none)."""

    def __init__(self) -> None:
        self.cached: List[List[torch.Tensor]] = []
        self.states: List[RandomState] = []
        self.spec: Any = None
        self.empty: List[torch.Tensor] = []
        self.end: Optional[RandomState] = None
        #: micro-batch index -> its representations with their graph (pass 1 kept it), and which of them
        #: are differentiable
        self.graphs: dict = {}
        self.differentiable: List[bool] = []

    def local(self) -> List[torch.Tensor]:
        """This rank's representations joined along dim 0, one tensor per position in the structure."""
        if self.cached:
            return [torch.cat(column) for column in zip(*self.cached)]
        if not self.empty:
            raise ConfigurationError("WindowLoss: this rank has no micro-batch in the window and none to pad with: "
                             "give it one with acc.set_padding(micro_batch)")
        return self.empty


def _first_pass(ctx: WindowContext, window_loss: WindowLoss, micro_batches: List[Batch], sizes: List[int],
                padding: int, keep: int = 0) -> _FirstPass:
    """Pass 1: each micro-batch's representations, and the random state before each; without a graph
    but for the last ``keep`` micro-batches, whose graph is kept for pass 2 (their forward under the
    data-parallel wrapper's "do not reduce", as any micro-batch's but the last)."""
    first = _FirstPass()
    keep_from = len(micro_batches) - keep
    with torch.no_grad(), _batchnorm_stats_kept(ctx.model), ctx.precision.autocast():
        for k, (mb, n) in enumerate(zip(micro_batches, sizes)):
            first.states.append(RandomState(ctx.device))
            if k >= keep_from:
                with torch.enable_grad(), ctx.sync.micro_batch(last=False):
                    out = window_loss.encode(ctx.model, mb)
                outs = _flat(out, n, k)
                first.graphs[k], first.differentiable = outs, _differentiable(out)
                first.cached.append([o.detach() for o in outs])
            else:
                out = window_loss.encode(ctx.model, mb)
                first.cached.append(_flat(out, n, k))
            first.spec = out if first.spec is None else first.spec
        for _ in range(padding):  # the forwards' collectives, as the ranks with data run them
            out = window_loss.encode(ctx.model, ctx.state.padding_batch)
            if first.spec is None:
                first.spec, first.empty = out, [t[:0] for t in _flat(out, leading_dim(ctx.state.padding_batch), 0)]
    first.end = RandomState(ctx.device)
    return first


def _same(again: List[torch.Tensor], first: List[torch.Tensor]) -> bool:
    """Pass 2's representations are pass 1's (to float rounding: 1e-5 relative)."""
    return all(torch.allclose(a.detach(), b, rtol=1e-5, atol=0.0, equal_nan=True) for a, b in zip(again, first))
