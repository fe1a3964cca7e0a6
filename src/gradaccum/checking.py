"""check_equivalence: is accumulation on *this* model the same as one big batch?

It computes the full-batch gradient ``grad L(batch)`` and the accumulated one
``sum_k n_k grad L_k / sum_k n_k`` from the same starting state, compares them parameter by
parameter, and names the modules that break the equivalence:

* BatchNorm in training mode (statistics per micro-batch), dropout in training mode;
* any leaf module that draws random numbers in forward;
* any module whose output differs between the full batch and the concatenated micro-batches
  while its input does not (its output for one item depends on the other items).

The model is left exactly as found: parameters, buffers (running statistics), gradients,
train/eval modes and the RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._checks import positive_int, positive_number, scalar_loss, split_loss_output, training_batchnorms
from .batching import Batch, leading_dim, split_batch

__all__ = ["EquivalenceReport", "check_equivalence"]


@dataclass(frozen=True)
class EquivalenceReport:
    """Outcome of :func:`check_equivalence`.

    Attributes:
        equivalent: ``max_rel_diff <= rtol``.
        max_rel_diff: max over parameters of ``||g_acc - g_full|| / ||g_full||``.
        suspects: ``(module name, reason)`` for each module that breaks equivalence.
        loss_full, loss_accumulated: the full-batch loss and the item-weighted window loss.
    """

    equivalent: bool
    max_rel_diff: float
    suspects: List[Tuple[str, str]] = field(default_factory=list)
    loss_full: float = 0.0
    loss_accumulated: float = 0.0
    rtol: float = 0.0

    def __str__(self) -> str:
        verdict = "equivalent" if self.equivalent else "NOT equivalent"
        lines = [f"{verdict}: max relative gradient difference {self.max_rel_diff:.3e} "
                 f"(rtol {self.rtol:.1e}); loss {self.loss_full:.6g} full vs "
                 f"{self.loss_accumulated:.6g} accumulated"]
        if self.equivalent and self.suspects:  # e.g. dropout whose draws fell alike on this split
            lines.append("  equal on this batch and split, but these modules can make another differ:")
            lines += [f"  watch {name or '<model>'}: {reason}" for name, reason in self.suspects]
        else:
            lines += [f"  suspect {name or '<model>'}: {reason}" for name, reason in self.suspects]
        return "\n".join(lines)


class _Snapshot:
    """Everything check_equivalence may touch, to put back afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tensors = {k: v.detach().clone() for k, v in _state_tensors(model)}
        self.grads = {n: None if p.grad is None else p.grad.detach().clone()
                      for n, p in model.named_parameters()}
        self.modes = {n: m.training for n, m in model.named_modules()}
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore_values(self) -> None:
        with torch.no_grad():
            for k, v in _state_tensors(self.model):
                v.copy_(self.tensors[k])
        for n, m in self.model.named_modules():
            m.training = self.modes[n]
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self) -> None:
        self.restore_values()
        for n, p in self.model.named_parameters():
            p.grad = self.grads[n]


def _state_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [("p:" + n, p) for n, p in model.named_parameters()] + \
           [("b:" + n, b) for n, b in model.named_buffers()]


def _first_tensor(x: Any) -> Optional[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class _Recorder:
    """Forward hooks: each module's first input and output tensor, and which modules draw random
    numbers *themselves* (a child's draws are credited to the child, not to its parent)."""

    def __init__(self, model: nn.Module) -> None:
        self.io: Dict[str, List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]] = {}
        self.random: set = set()
        self._stack: List[List[Any]] = []  # [name, RNG state when last seen]
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            state = torch.get_rng_state()
            if self._stack and not torch.equal(self._stack[-1][1], state):
                self.random.add(self._stack[-1][0])  # the parent drew before calling this child
            self._stack.append([name, state])
        return hook

    def _post(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            _, before = self._stack.pop()
            now = torch.get_rng_state()
            if not torch.equal(before, now):
                self.random.add(name)
            if self._stack:
                self._stack[-1][1] = now  # the child's draws are not the parent's
            inp, out = _first_tensor(args), _first_tensor(output)
            self.io.setdefault(name, []).append(
                (None if inp is None else inp.detach().clone(), None if out is None else out.detach().clone()))
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _checked_loss(out: Any, micro_batch: Batch) -> Tuple[torch.Tensor, Any]:
    """``loss_fn``'s output under the Accumulator's contract, or an error that says the fix."""
    loss, n = split_loss_output(out, leading_dim(micro_batch))
    return scalar_loss(loss, subject="loss_fn must return a scalar loss",
                       where="loss_fn (check_equivalence compares gradients)"), n


def _window_grads(model: nn.Module, loss_fn: Any, micro_batches: List[Batch]) -> Tuple[Dict[str, torch.Tensor], float]:
    for p in model.parameters():
        p.grad = None
    loss_sum, items = 0.0, 0.0
    for mb in micro_batches:
        loss, n = _checked_loss(loss_fn(model, mb), mb)
        (loss * n).backward()
        loss_sum += float(loss.detach()) * float(n)
        items += float(n)
    grads = {name: p.grad.detach().double() / items for name, p in model.named_parameters()
             if p.grad is not None}
    return grads, loss_sum / items


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor], rtol: float) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return True  # nothing comparable: not evidence against the module
    a, b = a.double(), b.double()
    scale = max(a.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() <= rtol * scale


def check_equivalence(model: nn.Module, loss_fn: Any, batch: Batch, micro_batch_size: int, *,
                      rtol: float = 1e-5) -> EquivalenceReport:
    """Compare one big batch's gradient with the accumulated gradient over micro-batches.

    Args:
        model: the model, in the mode you train it in (training mode, usually).
        loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss or ``(mean_loss, num_items)``.
        batch: one batch, split along dim 0 into chunks of ``micro_batch_size``.
        rtol: the largest relative gradient difference still called equivalent; float32 models
            round differently for different splits at about 1e-6.

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> fn = lambda m, b: m(b).pow(2).mean()
        >>> report = check_equivalence(m, fn, torch.randn(8, 4), 2)
        >>> report.equivalent, report.suspects[0][0]
        (False, '1')
    """
    positive_int("micro_batch_size", micro_batch_size)
    positive_number("rtol", rtol)
    micro_batches = split_batch(batch, micro_batch_size)
    snapshot = _Snapshot(model)
    suspects: Dict[str, List[str]] = {}

    def suspect(name: str, reason: str) -> None:
        if reason not in suspects.setdefault(name, []):
            suspects[name].append(reason)

    for name in training_batchnorms(model):
        suspect(name, "BatchNorm in training mode normalizes with per-micro-batch statistics "
                      "(and updates its running statistics once per micro-batch)")
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            suspect(name, f"dropout (p={module.p}) in training mode draws different masks per split")
    try:
        full_rec = _Recorder(model)
        try:
            g_full, loss_full = _window_grads(model, loss_fn, [batch])
        finally:
            full_rec.remove()
        snapshot.restore_values()
        acc_rec = _Recorder(model)
        try:
            g_acc, loss_acc = _window_grads(model, loss_fn, micro_batches)
        finally:
            acc_rec.remove()
    finally:
        snapshot.restore()

    random = full_rec.random | acc_rec.random
    max_rel = 0.0
    for name, gf in g_full.items():
        ga = g_acc.get(name, torch.zeros_like(gf))
        denom = max(gf.norm().item(), 1e-30)
        max_rel = max(max_rel, (ga - gf).norm().item() / denom)
    for name in sorted(random):
        suspect(name, "draws random numbers in forward, so a different split sees different draws")
    k = len(micro_batches)
    mixing: List[str] = []
    for name, calls in full_rec.io.items():
        acc_calls = acc_rec.io.get(name, [])
        if len(calls) != 1 or len(acc_calls) != k or k == 1:
            continue
        inp_f, out_f = calls[0]
        try:
            inp_a = None if inp_f is None else torch.cat([c[0] for c in acc_calls])  # type: ignore[misc]
            out_a = None if out_f is None else torch.cat([c[1] for c in acc_calls])  # type: ignore[misc]
        except (RuntimeError, TypeError):
            continue
        if _same(inp_f, inp_a, rtol) and not _same(out_f, out_a, rtol):
            mixing.append(name)
    for name in mixing:  # the deepest modules only: a parent differs because its child does
        if name in random:
            continue  # different draws explain it
        if not any(other != name and (name == "" or other.startswith(name + ".")) for other in mixing):
            suspect(name, "its output for an item depends on the other items of the micro-batch")
    ordered = sorted(suspects.items(), key=lambda kv: (kv[0] == "", kv[0]))
    return EquivalenceReport(
        equivalent=max_rel <= rtol,
        max_rel_diff=max_rel,
        suspects=[(name, "; ".join(reasons)) for name, reasons in ordered],
        loss_full=loss_full,
        loss_accumulated=loss_acc,
        rtol=rtol,
    )
