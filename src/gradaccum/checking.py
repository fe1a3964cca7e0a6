"""check_equivalence: is accumulation on *this* model the same as one big batch? The big batch is
:mod:`gradaccum._oracle`'s, computed independently of the code it checks."""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._cached import WindowLoss
from ._checks import (ROWS, holds_ignored_labels, positive_int, positive_number, tracking_instance_norms,
                      training_batchnorms)
from ._oracle import MicroBatchFailed, window_grads
from .batching import Batch, first_tensor, leading_dim, split_batch
from .errors import SplitError
from .integrations.hf_router import balance_hint
from .moe import MoELoss

__all__ = ["EquivalenceReport", "SplitError", "check_equivalence"]


@dataclass(frozen=True)
class EquivalenceReport:
    """Outcome of :func:`check_equivalence`.

    Attributes:
        equivalent: ``max_rel_diff <= rtol``, no module draws random numbers in forward (their draws depend
            on the split, whatever this one split gave), and none in training mode updates running statistics
            once per micro-batch with a gradient the split does not change (an InstanceNorm that tracks them).
        max_rel_diff: max over parameters of ``||g_acc - g_full|| / ||g_full||``.
        suspects: ``(module name, reason)`` for each module that breaks equivalence (``""`` is the
            model itself).
        loss_full, loss_accumulated: the full-batch loss and the item-weighted window loss.
        hints: what the numbers suggest beyond the modules (a ``loss_fn`` that returns a sum).
        matched_but: why the model is not equivalent although this split's gradients matched: ``"draws"``
            (random numbers in forward) or ``"statistics"`` (running statistics updated per micro-batch); else ``""``.
    """

    equivalent: bool
    max_rel_diff: float
    suspects: List[Tuple[str, str]] = field(default_factory=list)
    loss_full: float = 0.0
    loss_accumulated: float = 0.0
    rtol: float = 0.0
    hints: List[str] = field(default_factory=list)
    matched_but: str = ""

    def __str__(self) -> str:
        difference = f"max relative gradient difference {self.max_rel_diff:.3e} (rtol {self.rtol:.1e})"
        verdict = "equivalent" if self.equivalent else "NOT equivalent"
        if self.matched_but:  # not equivalent although this split's gradients matched
            verdict += {"draws": " (the model draws random numbers in forward, which differ with the split; this "
                                 "split matched)",
                        "statistics": " (the gradients match; running statistics update once per micro-batch)"}[
                self.matched_but]
        lines = [f"{verdict}: {difference}; loss {self.loss_full:.6g} full vs {self.loss_accumulated:.6g} accumulated"]
        lines += [f"  suspect {_module(name)}: {reason}" for name, reason in self.suspects]
        lines += [f"  hint: {hint}" for hint in self.hints]
        return "\n".join(lines)


def _module(name: str) -> str:
    """A module by its name in the model, quoted: ``module '1'`` reads as a name, ``1`` as a number."""
    return f"module {name!r}" if name else "the model itself"


class _Snapshot:
    def __init__(self, model: nn.Module) -> None:
        self.tensors = [(v, v.detach().clone()) for v in [*model.parameters(), *model.buffers()]]
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
        self.modes = [(m, m.training) for m in model.modules()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.generators = [(g, g.get_state()) for m in model.modules() for g in vars(m).values()
                           if isinstance(g, torch.Generator)]  # a module's own random numbers

    def restore(self) -> None:
        with torch.no_grad():
            for v, saved in self.tensors:
                v.copy_(saved)
        for m, training in self.modes:
            m.training = training
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for generator, state in self.generators:
            generator.set_state(state)
        for p, grad in self.grads:  # before a pass too: window_grads clears them first
            p.grad = grad


class _Recorder:
    """Forward hooks: each module's first input and output tensor, and which modules draw random numbers."""

    def __init__(self, model: nn.Module) -> None:
        self.io: Dict[str, List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]] = {}
        self.random: set = set()
        self._stack: List[List[Any]] = []  # [name, RNG state when last seen]
        self._handles = [hook for name, module in model.named_modules()
                         for hook in (module.register_forward_pre_hook(functools.partial(self._pre, name)),
                                      module.register_forward_hook(functools.partial(self._post, name)))]

    def _pre(self, name: str, module: nn.Module, args: Any) -> None:
        state = torch.get_rng_state()
        if self._stack and not torch.equal(self._stack[-1][1], state):
            self.random.add(self._stack[-1][0])  # the parent drew before calling this child
        self._stack.append([name, state])

    def _post(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        _, before = self._stack.pop()
        now = torch.get_rng_state()
        if not torch.equal(before, now):
            self.random.add(name)
        if self._stack:
            self._stack[-1][1] = now  # the child's draws are not the parent's
        self.io.setdefault(name, []).append(
            tuple(None if t is None else t.detach().clone() for t in (first_tensor(args), first_tensor(output))))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _one_item_error(model: nn.Module, failed: MicroBatchFailed, micro_batch_size: int, items: int,
                    count: int) -> Optional[SplitError]:
    """A micro-batch of one item that BatchNorm in training mode cannot normalize, in words, or None."""
    batchnorms = training_batchnorms(model)
    if failed.items != 1 or not batchnorms:
        return None
    # the largest size below micro_batch_size that splits the items into 2 or more micro-batches of 2 or more
    size = next((m for m in range(min(micro_batch_size, items // 2), 1, -1) if items % m != 1), None)
    fix = f"pass micro_batch_size={size}, which leaves 2 or more in each" if size else "give a larger batch"
    return SplitError(
        f"micro_batch_size={micro_batch_size} on a batch of {items} items leaves micro-batch {failed.index + 1} "
        f"of {count} with 1 item, which BatchNorm in training mode ({', '.join(_module(n) for n in batchnorms)}) "
        f"cannot normalize (torch: {failed.error}); {fix}. BatchNorm in training mode makes accumulation NOT "
        "equivalent to one big batch anyway (its statistics are per micro-batch): eval() it, or use "
        "GroupNorm/LayerNorm", micro_batch_size=micro_batch_size, items=items, suggestion=size)


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor], rtol: float) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return True  # nothing comparable: not evidence against the module
    a, b = a.double(), b.double()
    scale = max(a.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() <= rtol * scale


def check_equivalence(model: nn.Module, loss_fn: Any, batch: Batch, micro_batch_size: int, *,
                      rtol: float = 1e-5, num_items: Any = None) -> EquivalenceReport:
    """Compare one big batch's gradient with the accumulated one, ``sum_k n_k grad L_k / sum_k n_k``,
    from the same state, parameter by parameter. The report names the modules that break the equivalence
    (BatchNorm or dropout in training mode, a module that draws random numbers in forward, one whose
    output for an item depends on the other items) and, in a hint, the likeliest cause in the loss. The
    model is left exactly as found: parameters, buffers, gradients, train/eval modes and the RNG state.

    Args:
        model: the model, in the mode you train it in (training mode, usually).
        loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss or ``(mean_loss, num_items)``; or a
            :class:`~gradaccum.WindowLoss`, for a loss that couples the batch's items: its loss on the
            whole batch is compared with the Accumulator's cached accumulation of it; or an
            :class:`~gradaccum.MoELoss` (``MoELoss.for_hf_model(model)``): its token loss plus the whole
            batch's load-balancing term against the Accumulator's window.
        batch: one batch, split along dim 0 into chunks of ``micro_batch_size``.
        micro_batch_size: items per micro-batch; the split must give at least 2 micro-batches.
        rtol: the largest relative gradient difference still called equivalent; float32 models
            round differently for different splits at about 1e-6.
        num_items: as ``Accumulator.step`` takes it: ``num_items(micro_batch)`` -> how many items a bare
            mean loss is over (e.g. ``lambda mb: gradaccum.count_targets(mb["labels"])``), or ``"rows"``;
            None weighs a bare loss by its rows.

    Raises:
        SplitError: the split gives one micro-batch, or a micro-batch the model cannot run (a
            ValueError naming the micro-batch size and one that works).

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> fn = lambda m, b: m(b).pow(2).mean()
        >>> report = check_equivalence(m, fn, torch.randn(8, 4), 2)
        >>> report.equivalent, report.suspects[0][0]
        (False, '1')
    """
    positive_int("micro_batch_size", micro_batch_size)
    positive_number("rtol", rtol)
    if num_items is not None and num_items != ROWS and not callable(num_items):
        raise TypeError(f"num_items must be a function micro_batch -> count or 'rows', got {num_items!r}")
    micro_batches = split_batch(batch, micro_batch_size)
    items = leading_dim(batch)
    if len(micro_batches) < 2:
        fix = (f"pass micro_batch_size={items // 2} or less" if items >= 2 else "give a batch of 2 items or more")
        raise SplitError(f"micro_batch_size={micro_batch_size} on a batch of {items} item{'s' if items != 1 else ''} "
                         f"gives one micro-batch, which is only compared with itself; {fix}",
                         micro_batch_size=micro_batch_size, items=items, suggestion=items // 2 or None)
    full, acc = _both_passes(model, loss_fn, batch, micro_batches, micro_batch_size, num_items)
    max_rel = max(((acc.grads.get(name, torch.zeros_like(gf)) - gf).norm().item() / max(gf.norm().item(), 1e-30)
                   for name, gf in full.grads.items()), default=0.0)
    matched = max_rel <= rtol
    suspects, drawn = _suspects(model, full, acc, len(micro_batches), rtol, matched)
    hint = None if matched else _hint(model, loss_fn, full, acc, batch, micro_batches, num_items, bool(suspects), rtol)
    tracking = any(m.training for _, m in tracking_instance_norms(model))
    but = "" if not matched else "draws" if drawn else "statistics" if tracking else ""
    return EquivalenceReport(equivalent=matched and not drawn and not tracking, max_rel_diff=max_rel, suspects=suspects,
                             loss_full=full.loss, loss_accumulated=acc.loss, rtol=rtol, hints=[hint] if hint else [],
                             matched_but=but)


def _hint(model: nn.Module, loss_fn: Any, full: "_Pass", acc: "_Pass", batch: Batch, micro_batches: List[Batch],
          num_items: Any, suspected: bool, rtol: float) -> Optional[str]:
    """What the numbers suggest where the gradients differ, the likeliest cause first."""
    if num_items in (None, ROWS) and full.bare and holds_ignored_labels([batch]):
        return ("loss_fn returns a bare mean loss and the batch's 'labels' hold the ignore index -100, so the mean is "
                "likely over the targets (as a Hugging Face model's outputs.loss is), while the micro-batches are "
                "weighed by their rows: count the targets, check_equivalence(..., num_items=lambda mb: "
                "gradaccum.count_targets(mb['labels'])) and the same num_items= to Accumulator.step/train, or return "
                "(mean, count) from loss_fn (gradaccum.causal_lm_loss)")
    if not full.bare and not all(float(p.items).is_integer() for p in (full, acc)):
        return (f"loss_fn returns a pair, whose second value is taken as the count of items its mean is over: it "
                f"summed to {full.items:.6g} over the batch, not a whole number (an accuracy or another metric?). "
                "If it is a metric, return (mean_loss, num_items), or the mean loss alone, and log the metric from "
                "inside loss_fn (a sum of weights is a count too)")
    finite = math.isfinite(full.loss) and math.isfinite(acc.loss)
    sizes = [leading_dim(mb) for mb in micro_batches]
    # a loss_fn that returns the sum over its items: the full batch's loss is then about N^2 / sum n_k^2 times the
    # accumulated one (the number of micro-batches, for equal ones)
    expected = sum(sizes) ** 2 / sum(n * n for n in sizes)
    if finite and acc.loss != 0 and abs(full.loss / acc.loss / expected - 1) <= 0.05:
        return (f"the full batch's loss is {full.loss / acc.loss:.3g} times the accumulated one, as a sum over the "
                f"items gives on {len(sizes)} micro-batches: loss_fn must return the mean over the micro-batch's "
                "items (e.g. reduction='mean'), or (sum / count, count)")
    if isinstance(loss_fn, MoELoss) and loss_fn.mode != "exact":
        return (f"MoELoss(mode={loss_fn.mode!r}) computes the load-balancing term from part of the window, which is "
                "another objective than the big batch's: mode='exact' computes it over the whole window")
    balance = None if isinstance(loss_fn, MoELoss) else balance_hint(model)  # the term over the batch (moe)
    if balance is not None:
        return balance
    agree = abs(full.loss - acc.loss) <= rtol * max(abs(full.loss), abs(acc.loss), 1e-30)
    if suspected or isinstance(loss_fn, WindowLoss) or not finite or agree:
        return None
    return (f"the loss couples the batch's items: {full.loss:.6g} on the whole batch, {acc.loss:.6g} as the "
            "item-weighted mean of its values on the micro-batches, while every module gives each item the same "
            "output on both, so an item's loss depends on the other items of its batch (in-batch negatives, a "
            "contrastive or ranking loss) and accumulating micro-batch losses optimizes another objective. "
            "gradaccum.WindowLoss(encode, loss) is exact for such a loss: check it with "
            "check_equivalence(model, WindowLoss(encode, loss), batch, micro_batch_size) (gradaccum check "
            "--encode MODULE:FUNCTION --window-loss MODULE:FUNCTION)")


def _suspects(model: nn.Module, full: "_Pass", acc: "_Pass", k: int, rtol: float, matched: bool
              ) -> Tuple[List[Tuple[str, str]], List[str]]:
    """The suspect modules with their reasons (modes read on the model as found again), by name, the model
    itself last; and the modules that drew random numbers (the dropouts with them)."""
    reasons: Dict[str, List[str]] = defaultdict(list)  # each (module, reason) is found once
    modules = dict(model.named_modules())
    for name in training_batchnorms(model):
        reasons[name].append(f"{type(modules[name]).__name__} in training mode normalizes with per-micro-batch "
                             "statistics (and updates its running statistics once per micro-batch)")
    for name, module in tracking_instance_norms(model):
        if module.training:
            reasons[name].append(f"{type(module).__name__}(track_running_stats=True) in training mode updates its "
                                 "running statistics once per micro-batch, not once per batch (the gradient is the "
                                 "big batch's; the statistics eval() uses are not)")
    dropouts = [name for name, module in modules.items()
                if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0]
    for name in dropouts:
        reasons[name].append(f"{type(modules[name]).__name__} (p={modules[name].p}) in training mode draws its "
                             "masks per forward, so they depend on how the batch is split (turn it off, with eval() "
                             "or p=0, to check the rest)")
    random = full.recorder.random | acc.recorder.random
    for name in sorted(random - set(dropouts)):
        reasons[name].append("draws random numbers in forward, so another split sees other draws")
    drawn = sorted(set(dropouts) | random)
    for name in drawn if matched else []:
        reasons[name].append("its draws matched on this split by chance: one dropout layer on the CPU draws its "
                             "masks item after item, so micro-batches in order draw the full batch's; several "
                             "layers, or CUDA's generator, draw others")
    for name in _mixing(full.recorder, acc.recorder, k, rtol) - random:  # draws explain those
        reasons[name].append("its output for an item depends on the other items of the micro-batch")
    ordered = sorted(reasons.items(), key=lambda kv: (kv[0] == "", kv[0]))
    return [(name, "; ".join(said)) for name, said in ordered], drawn


@dataclass
class _Pass:
    """One pass of the oracle: its float64 gradient, its item-weighted loss, what each module saw."""

    grads: Dict[str, torch.Tensor]
    loss: float
    bare: bool  # loss_fn returned a bare loss (weighed by num_items, or by rows)
    items: float  # sum n_k
    recorder: _Recorder


def _both_passes(model: nn.Module, loss_fn: Any, batch: Batch, micro_batches: List[Batch],
                 micro_batch_size: int, num_items: Any) -> Tuple[_Pass, _Pass]:
    """The full batch, then its micro-batches, from the same state; the model left as found. Only a
    micro-batch's failure may be the split's (BatchNorm on one item: :class:`SplitError`)."""
    snapshot, passes = _Snapshot(model), []
    try:
        for batches in ([batch], micro_batches):
            snapshot.restore()
            recorder = _Recorder(model)
            try:
                passes.append(_Pass(*window_grads(model, loss_fn, batches, num_items), recorder))
            except MicroBatchFailed as failed:
                error = None if batches is not micro_batches else _one_item_error(
                    model, failed, micro_batch_size, leading_dim(batch), len(micro_batches))
                raise (failed.error if error is None else error) from None
            finally:
                recorder.remove()
    finally:
        snapshot.restore()
    return passes[0], passes[1]


def _mixing(full: _Recorder, acc: _Recorder, k: int, rtol: float) -> set:
    """The deepest modules whose output for the concatenated micro-batches differs from the full
    batch's while their input does not (a parent that differs only because its child does is not named)."""
    mixing: List[str] = []
    for name, calls in full.io.items():
        acc_calls = acc.io.get(name, [])
        if len(calls) != 1 or len(acc_calls) != k:
            continue
        inp_f, out_f = calls[0]
        try:
            inp_a = None if inp_f is None else torch.cat([c[0] for c in acc_calls])  # type: ignore[misc]
            out_a = None if out_f is None else torch.cat([c[1] for c in acc_calls])  # type: ignore[misc]
        except (RuntimeError, TypeError):
            continue
        if _same(inp_f, inp_a, rtol) and not _same(out_f, out_a, rtol):
            mixing.append(name)
    return {name for name in mixing
            if not any(other != name and (name == "" or other.startswith(name + ".")) for other in mixing)}
