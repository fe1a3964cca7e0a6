"""The maths of exact accumulation, as pure functions: the one place each formula is written.

No driver derives a weight, a normalization or a count again (:func:`gradaccum.check_equivalence` keeps an
independent big-batch oracle on purpose).

A window holds micro-batches k (on every rank r) with n_k items and mean loss L_k. One step on the
whole window is a step on its item-weighted mean loss::

    L = sum_k n_k L_k / N,        grad L = sum_k n_k grad L_k / N,        N = sum_{r,k} n_k

Each micro-batch backpropagates ``w_k * L_k`` with the **backward weight** ``w_k = n_k * W / R``
(:func:`backward_weight`); gradients add up in ``.grad``. W is the number of ranks the data-parallel
reduction averages over (1 locally), so after the reduction the gradient is ``sum n_k grad L_k / R``.
At the boundary it is multiplied once by the **boundary scale** ``R / N`` (:func:`boundary_scale`)::

    backward weight  = n_k * W / R
    reduced grad     = (1 / W) * sum_ranks sum_k n_k * W / R * grad L_k  =  sum n_k grad L_k / R
    window grad      = reduced grad * R / N  =  grad L

R is a reference count, the same on every rank. When the window's global item count is known before
the first backward (the micro-batches' leading dimensions for a bare mean loss, or a ``num_items=``
counter; across ranks summed by one small all-reduce as the window opens: **count first**) and
``loss_fn`` counts the same items, R = N: the scale is 1, there is no scaling pass, and each backward
weighs exactly ``n_k / N`` as one big batch does (so float32 parts of a float64 model, such as a Llama
RMSNorm, round as in one big batch). When ``loss_fn`` counts other items (a ``(mean, count)`` pair),
R is the up-front N times the last window's ratio of the two; when nothing is counted up front, the
running R (:func:`running_reference`, fixed once); either way the scale ``R / N`` corrects it exactly,
at the cost of one more rounding of every gradient element (:mod:`gradaccum._ranks`). Dividing each
micro-batch by K instead is exact only when every n_k is equal, which uneven micro-batches, padded sequences and a short last window are not.

A window with N = 0 (every label ignored) has no loss to step on: its scale is 0 and the
:func:`verdict` skips it (no optimizer step, so no weight decay and no step counted), in the core and
in every integration alike.

For a language model the items are next-token targets: :func:`target_count` counts them from the
labels before any forward pass and :func:`token_loss_sum` sums their cross-entropy, so that a
micro-batch's mean is ``token_loss_sum / target_count``.

:class:`WindowWeights` composes these formulas into the window every driver runs (the Accumulator's
window and boundary, the Hugging Face Trainer, the Lightning callback), step by step:

1. **open** it: ``WindowWeights(state, W, num_items=N)`` when the window's global N is known before the
   first backward (count first: R = N, the boundary scale is 1; N = 0 is known to be skipped), else
   ``WindowWeights(state, W)`` with the running R of ``state.reference``, fixed once by the first
   backward (:meth:`fix_reference`) and kept in the state (a driver that cannot see the window ahead);
2. **weigh** micro-batch k: a mean loss over n_k items by :meth:`mean_weight` (``n_k * W / R``), a
   summed loss by :meth:`sum_weight` (``W / R``); W is the number of ranks the reduction averages over;
3. at the **boundary**: :meth:`close` gives the :class:`Closing` (the verdict, from N and, where the
   driver measured them, the loss and the norm; the scale ``R / N``), and :meth:`record` writes what the
   window taught into the :class:`~gradaccum._state.AccumulatorState`: one more step, or one more
   skipped window (with a one-time warning for an empty one), and N as the last window's count.

    >>> from gradaccum._state import AccumulatorState
    >>> state = AccumulatorState()
    >>> w = WindowWeights(state, grad_divisor=2.0, num_items=8)      # N known first: R = N
    >>> w.mean_weight(3), w.sum_weight()                              # 3 * 2 / 8, 2 / 8
    (0.75, 0.25)
    >>> closing = w.close(8); closing.verdict, closing.scale
    (<Verdict.STEP: 'step'>, 1.0)
    >>> w.record(closing).steps, state.steps, state.skipped, state.last_window_items
    (True, 1, 0, 8.0)
    >>> empty = WindowWeights(state, 1.0, num_items=0)                 # known empty: weighs nothing
    >>> empty.sum_weight(), empty.record(empty.close(0)).verdict, state.skipped
    (0.0, <Verdict.SKIP_EMPTY: 'skip: no item'>, 1)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ._checks import Count
from ._state import AccumulatorState
from .errors import ConfigurationError

__all__ = ["WindowWeights", "Closing", "CLIP_EPS", "ceil_div", "backward_weight", "boundary_scale", "running_reference",
           "window_mean",
           "clip_coefficient", "tensor_norms", "Verdict", "verdict", "target_count", "token_loss_sum",
           "LOSSES", "loss_items", "summed_loss", "router_statistics", "balance_loss_part"]

#: added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does
CLIP_EPS = 1e-6

Number = Union[int, float]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints, without floats.

    >>> ceil_div(10, 4), ceil_div(8, 4), ceil_div(0, 4)
    (3, 2, 0)
    """
    return -(-a // b)


def count_dtype(device: torch.device) -> torch.dtype:
    """The dtype counts and loss sums are added in: float64, so that they do not round with the
    model's dtype, except on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def backward_weight(num_items: Union[Number, torch.Tensor], reference: float, grad_divisor: float,
                    loss_dtype: torch.dtype = torch.float64) -> Union[float, torch.Tensor]:
    """``w_k = n_k * W / R``: what micro-batch k's mean loss is multiplied by before its backward.

    A Python count gives a Python float (no device tensor per micro-batch); a tensor count stays on
    its device, in the loss's precision (an int64 count divided by a float would round to float32).

    >>> backward_weight(3, reference=12.0, grad_divisor=2.0)
    0.5
    """
    if isinstance(num_items, torch.Tensor):
        return num_items.to(torch.promote_types(loss_dtype, torch.float32)) * (grad_divisor / reference)
    return num_items * grad_divisor / reference


def boundary_scale(reference: float, num_items: float) -> float:
    """``R / N``, the factor that turns the reduced gradient into the window's mean gradient (0 for a
    window that counted no item: it takes no step).

    >>> boundary_scale(12.0, 12.0), boundary_scale(12.0, 8.0), boundary_scale(12.0, 0.0)
    (1.0, 1.5, 0.0)
    """
    return reference / num_items if num_items > 0 else 0.0


def running_reference(count: float) -> float:
    """The running R, for windows whose item count is not known before the first backward: the first count seen
    (across ranks, the largest of them), never below 1 so that a first micro-batch of 0 items still
    gives finite weights. Any positive R is exact (the boundary scale corrects it); one near N keeps
    the gradients near their final size, which fp16's loss scale expects.

    >>> running_reference(0.0), running_reference(37.0)
    (1.0, 37.0)
    """
    return max(float(count), 1.0)


def window_mean(loss_sum: float, num_items: float) -> float:
    """The window's item-weighted mean loss ``sum n_k L_k / N``; nan for a window of 0 items.

    >>> window_mean(6.0, 4.0), math.isnan(window_mean(0.0, 0.0))
    (1.5, True)
    """
    return loss_sum / num_items if num_items > 0 else math.nan


def tensor_norms(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Each tensor's 2-norm, stacked (in ``dtype``, else the tensors' own): one fused pass over plain
    tensors on one device. The total norm is the 2-norm of these; a fingerprint their weighted sum.

    >>> tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()
    [5.0, 1.0]
    """
    if hasattr(torch, "_foreach_norm") and len({t.device for t in tensors}) == 1:
        norms = torch.stack(torch._foreach_norm(list(tensors)))
    else:
        norms = torch.stack([torch.linalg.vector_norm(t).to(tensors[0].device) for t in tensors])
    return norms if dtype is None else norms.to(dtype)


def clip_coefficient(grad_norm: Optional[float], max_grad_norm: Optional[float]) -> float:
    """``min(1, max_grad_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` scales; 1 without clipping.

    >>> clip_coefficient(4.0, 1.0) < 0.25 < clip_coefficient(4.0, None)
    True
    """
    if max_grad_norm is None:
        return 1.0
    assert grad_norm is not None, "the norm is measured whenever clipping"
    return min(1.0, max_grad_norm / (grad_norm + CLIP_EPS))


class Verdict(enum.Enum):
    """What the boundary does with a window."""

    STEP = "step"
    SKIP_EMPTY = "skip: no item"          # every label ignored: no loss to step on
    SKIP_NONFINITE = "skip: not finite"   # or fp16 overflow: the scaler backs off
    RAISE = "raise"


def verdict(loss_sum: Optional[float], num_items: float, grad_norm: Optional[float], *, nonfinite: str,
            has_scaler: bool) -> Verdict:
    """Step, skip or raise, from the window's global loss sum (None when the ranks did not exchange
    it: then the norm, always measured, carries it), item count and (measured) norm.

    A non-finite loss or norm skips (``nonfinite="skip"``) or raises; under fp16 it always skips,
    since an overflow is how the loss scaler learns to back off. A window of 0 items is skipped.

    >>> verdict(1.0, 4, None, nonfinite="raise", has_scaler=False), verdict(1.0, 0, None, nonfinite="raise", has_scaler=False)
    (<Verdict.STEP: 'step'>, <Verdict.SKIP_EMPTY: 'skip: no item'>)
    """
    finite = (loss_sum is None or math.isfinite(loss_sum)) and (grad_norm is None or math.isfinite(grad_norm))
    if not finite:
        return Verdict.RAISE if nonfinite == "raise" and not has_scaler else Verdict.SKIP_NONFINITE
    return Verdict.STEP if num_items > 0 else Verdict.SKIP_EMPTY


# -- what a language model's items are: next-token targets --------------------------------------------

def target_count(targets: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """How many of ``targets`` are not ``ignore_index``: a count left on their device (no host sync).
    Callers align the targets first (``labels[:, 1:]`` for a causal LM).

    >>> target_count(torch.tensor([[2, 3, -100], [1, -100, -100]])).item()
    3
    """
    return (targets != ignore_index).sum()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """The summed cross-entropy of ``logits`` ``(..., vocab)`` against ``targets`` ``(...)`` over the
    targets that are not ``ignore_index``. float16 and bfloat16 logits are raised to float32 for the
    softmax; float64 stays float64 (never downcast).

    >>> round(token_loss_sum(torch.zeros(2, 3, 4), torch.tensor([[0, 1, -100], [2, -100, -100]])).item(), 4)
    4.1589
    """
    if logits.shape[:-1] != targets.shape:
        raise ConfigurationError(
            f"logits of shape {tuple(logits.shape)} do not match targets of shape "
            f"{tuple(targets.shape)}: logits must be targets.shape + (vocab,)"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return F.cross_entropy(flat, targets.reshape(-1).to(flat.device), ignore_index=ignore_index, reduction="sum")


# -- a Hugging Face model's loss as a sum over its items (integrations/hf_trainer.py) -----------------

#: the losses a Hugging Face head computes from its logits, by what their items are
LOSSES = ("cross_entropy", "squared_error", "binary_cross_entropy")


def loss_items(targets: torch.Tensor, *, loss: str, ignore_index: int = -100) -> torch.Tensor:
    """How many items ``loss`` averages over for these (aligned) ``targets``, on their device: the
    targets that are not ``ignore_index`` for a cross-entropy (tokens, sequence labels), every element
    for a squared error (regression) or a binary cross-entropy (multi-label), as their ``mean`` does.

    >>> loss_items(torch.tensor([3, -100, 1]), loss="cross_entropy").item(), loss_items(torch.zeros(2, 5), loss="binary_cross_entropy").item()
    (2, 10)
    """
    if loss == "cross_entropy":
        return target_count(targets, ignore_index=ignore_index)
    if loss in LOSSES:
        return torch.tensor(targets.numel(), device=targets.device)
    raise ConfigurationError(f"loss={loss!r} is not one of {LOSSES}")


def summed_loss(logits: torch.Tensor, targets: torch.Tensor, *, loss: str, ignore_index: int = -100) -> torch.Tensor:
    """The sum over :func:`loss_items` of ``loss``, so that ``summed_loss / loss_items`` is the mean a
    Hugging Face head returns. Cross-entropy is :func:`token_loss_sum` (logits ``targets.shape +
    (classes,)``); a squared error or a binary cross-entropy takes logits of the targets' shape (or one
    that squeezes to it, as a regression head's ``(n, 1)`` does), the targets cast to the logits' dtype.
    float16 and bfloat16 logits are raised to float32; float64 stays float64.

    >>> summed_loss(torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 1.0]), loss="squared_error").item()
    5.0
    """
    if loss == "cross_entropy":
        return token_loss_sum(logits, targets, ignore_index=ignore_index)
    if loss not in LOSSES:
        raise ConfigurationError(f"loss={loss!r} is not one of {LOSSES}")
    if logits.numel() != targets.numel():
        raise ConfigurationError(f"logits of shape {tuple(logits.shape)} do not match targets of shape "
                         f"{tuple(targets.shape)}: a {loss} needs one logit per target")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = logits.reshape(targets.shape)
    targets = targets.to(logits.device, logits.dtype)
    if loss == "squared_error":
        return F.mse_loss(logits, targets, reduction="sum")
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="sum")


# -- a mixture-of-experts router's load-balancing loss over the window (gradaccum.moe) ----------------

def router_statistics(router_logits: "Sequence[torch.Tensor]", top_k: int, mask: Optional[torch.Tensor] = None
                      ) -> "Tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """A batch's router statistics, pooled over its layers as transformers' ``load_balancing_loss_func``
    pools them: ``(C, S, T)`` with ``C_i`` the top-k choices of expert i (no gradient), ``S_i`` the summed
    router probability of expert i (differentiable) and ``T`` the rows (tokens times layers). ``mask``
    (one 0/1 value per token, the flattened ``attention_mask``) leaves padding out. Each layer's
    ``router_logits`` is ``(tokens, experts)``; the softmax is in their dtype (float16 and bfloat16
    raised to float32; float64 stays float64, where transformers' own sums are float32).

    >>> logits = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 9.0]])]
    >>> C, S, T = router_statistics(logits, top_k=1, mask=torch.tensor([1, 1, 0]))
    >>> C.tolist(), T.item(), round(S.sum().item(), 6)
    ([1.0, 1.0, 0.0], 2.0, 2.0)
    """
    counts = probs = rows = None
    for layer in router_logits:
        logits = layer.float() if layer.dtype in (torch.float16, torch.bfloat16) else layer
        p = torch.softmax(logits, dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices
        weight = (torch.ones(p.shape[0], dtype=p.dtype, device=p.device) if mask is None
                  else mask.reshape(-1).to(p.device, p.dtype))
        c = torch.zeros(p.shape[-1], dtype=p.dtype, device=p.device).scatter_add_(
            0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        s = (p * weight[:, None]).sum(dim=0)
        counts, probs, rows = ((c, s, weight.sum()) if counts is None else
                               (counts + c, probs + s, rows + weight.sum()))  # type: ignore[operator]
    if counts is None:
        raise ConfigurationError("router_statistics: router_logits is empty; pass one (tokens, experts) tensor per "
                                 "MoE layer")
    return counts, probs, rows  # type: ignore[return-value]


def balance_loss_part(prob_sums: torch.Tensor, counts: torch.Tensor, count_rows: Union[float, torch.Tensor],
                      rows: Union[float, torch.Tensor]) -> torch.Tensor:
    """``E * sum_i (C_i / T_C) * S_i / T``: one micro-batch's part of the load-balancing loss, its
    summed probabilities ``S`` against expert fractions ``C / T_C`` that are held fixed.

    With the **window's** counts ``C``, ``T_C = T`` the window's rows and ``T`` them too, the parts
    of the window's micro-batches (every rank's) sum to the window's loss ``E * sum_i f_i P_i``, and,
    ``C`` not being differentiated, so do their gradients: the exact split. With a micro-batch's own
    counts and rows ``(C_k, T_k)`` and ``T = T_k`` it is that micro-batch's loss alone.

    >>> C, S = torch.tensor([3.0, 1.0]), torch.tensor([2.5, 1.5])           # a window of T = 4 rows
    >>> whole = balance_loss_part(S, C, 4.0, 4.0)                           # 2 * (0.75 * 0.625 + 0.25 * 0.375)
    >>> parts = balance_loss_part(torch.tensor([1.5, 0.5]), C, 4.0, 4.0) + balance_loss_part(torch.tensor([1.0, 1.0]), C, 4.0, 4.0)
    >>> whole.item(), torch.isclose(parts, whole).item()
    (1.125, True)
    """
    experts = prob_sums.shape[-1]
    return experts * (counts.to(prob_sums.dtype) / count_rows * prob_sums).sum() / rows


# -- the window, step by step: every driver's one weighting, verdict and record --------------------------

@dataclass(frozen=True)
class Closing:
    """What a window's boundary decides: the verdict, the scale ``R / N`` that turns the reduced
    gradient into the window's mean gradient (0 for a window of no item), the norm after that scale
    (when measured), and the window's global item count N."""

    verdict: Verdict
    scale: float
    num_items: float
    grad_norm: Optional[float] = None
    steps: bool = dataclasses.field(init=False)  #: the verdict is STEP (set once: every driver asks it often)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", self.verdict is Verdict.STEP)


class WindowWeights:
    """One window's weighting from its opening to its boundary (the module docstring's order).

    Args:
        state: the driver's :class:`~gradaccum._state.AccumulatorState`: the running R is read from it
            and fixed into it, and :meth:`record` writes the window's lesson into it.
        grad_divisor: W, the ranks the gradient reduction averages over (1 on one process).
        num_items: the window's global N, when known before its first backward (count first).
        reference: R, when the driver knows it up front (the Accumulator's: N times the last window's
            ratio of the items ``loss_fn`` counted to those counted up front, 1 when they are the same
            items). Default: ``num_items``, else the running R.
    """

    __slots__ = ("state", "grad_divisor", "num_items", "reference")

    def __init__(self, state: AccumulatorState, grad_divisor: float, *, num_items: Optional[Count] = None,
                 reference: Optional[float] = None) -> None:
        self.state, self.grad_divisor = state, float(grad_divisor)
        #: the window's global N, when known before the first backward; else None
        self.num_items: Optional[float] = None if num_items is None else float(num_items)
        if reference is None:
            reference = self.num_items if self.num_items is not None and self.num_items > 0 else state.reference
        #: R: known when the window opened, else the running R (None until its first backward fixes it)
        self.reference: Optional[float] = reference

    @property
    def empty(self) -> bool:
        """The window is known before its first backward to hold no item: it weighs nothing, is skipped."""
        return self.num_items == 0

    def fix_reference(self, estimate: Count, agree: Callable[[float], float] = float) -> float:
        """R for this window: known, or the running R; fixed now, once per state, from ``estimate`` (the
        driver's guess at a window's N from its first backward, :func:`running_reference`)
        made the same on every rank by ``agree`` (a max across ranks; the identity where the estimate is
        already agreed)."""
        if self.reference is None:
            if self.state.reference is None:
                self.state.reference = float(agree(running_reference(float(estimate))))
            self.reference = self.state.reference
        return self.reference

    def _r(self) -> float:
        if self.reference is None:
            self.reference = self.state.reference  # fixed since this window opened, if at all
            if self.reference is None:
                raise RuntimeError("WindowWeights: a weight asked for before R was fixed; call fix_reference(count) "
                                   "at the window's first backward")
        return self.reference

    def mean_weight(self, num_items: Union[Count, torch.Tensor], loss_dtype: torch.dtype = torch.float64
                    ) -> Union[float, torch.Tensor]:
        """What micro-batch k's **mean** loss over ``num_items`` = n_k items is multiplied by:
        ``n_k * W / R`` (:func:`backward_weight`); 0 in a window known to be empty."""
        if self.num_items == 0:  # known empty
            return 0.0
        r = self.reference if self.reference is not None else self._r()
        return backward_weight(num_items, r, self.grad_divisor, loss_dtype)

    def window_loss_weight(self, num_items: Count) -> float:
        """What the gradient of a loss over the **whole window** (a ``WindowLoss``: one mean over the
        window's ``num_items`` = N rows, the cached two passes) is multiplied by: ``N / R``
        (:func:`backward_weight` with ``W`` = 1: the ranks' divisor rides in the
        representations' gradient slices), 1 where N was counted first."""
        return 0.0 if self.empty else float(backward_weight(float(num_items), self._r(), 1.0))

    def sum_weight(self) -> float:
        """What micro-batch k's **summed** loss ``S_k = n_k L_k`` is multiplied by: ``W / R`` (the mean
        weight of one item); 0 in a window known to be empty."""
        if self.num_items == 0:  # known empty
            return 0.0
        r = self.reference if self.reference is not None else self._r()
        return float(backward_weight(1, r, self.grad_divisor))

    def close(self, num_items: Count, *, loss_sum: Optional[float] = None, raw_norm: Optional[float] = None,
              nonfinite: str = "raise", has_scaler: bool = False) -> Closing:
        """The boundary's decision from the window's global N (summed over its micro-batches and ranks),
        and where the driver measured them its global loss sum and the reduced gradient's norm before
        the scale (:func:`verdict`, :func:`boundary_scale`). Changes
        nothing: :meth:`record` does, once the driver has stepped or skipped."""
        n = float(num_items)
        r = self.reference  # None only where no weighted backward ran: then any R scales a zero gradient
        scale = boundary_scale(r if r is not None else 1.0, n)
        grad_norm = raw_norm * scale if raw_norm is not None else None
        return Closing(verdict(loss_sum, n, grad_norm, nonfinite=nonfinite, has_scaler=has_scaler), scale, n,
                       grad_norm)

    def record(self, closing: Closing, *, applied: bool = True, warn_empty: Optional[str] = None,
               warn_nonfinite: Optional[str] = None, stacklevel: int = 2) -> Closing:
        """What the state learns at the boundary: one more optimizer step, or one more skipped window
        (``warn_empty``, when given, is said once per state for a window of no item: how the driver
        counts them; ``warn_nonfinite``, the driver's whole warning, once per state for a window skipped
        as not finite), and the window's N as the last window's (windows with items only: it is an R).
        A step the stepper did not apply (``applied=False``: an fp16 loss scale that overflowed, a
        DeepSpeed engine that found the gradient not finite) is a window skipped as not finite. Returns
        the closing as recorded."""
        state = self.state
        assert closing.verdict is not Verdict.RAISE, "a window that raises is not recorded: the driver raised"
        if closing.steps and not applied:
            closing = dataclasses.replace(closing, verdict=Verdict.SKIP_NONFINITE)
        if closing.steps:
            state.steps += 1
        else:
            state.skipped += 1
            if closing.verdict is Verdict.SKIP_EMPTY and warn_empty is not None and state.warn_once("no_items"):
                warnings.warn("a window counted 0 items (e.g. every label is the ignore_index): it has no loss to "
                              f"step on, so it was skipped; {warn_empty}", UserWarning, stacklevel=stacklevel + 1)
            if closing.verdict is Verdict.SKIP_NONFINITE and warn_nonfinite is not None \
                    and state.warn_once("nonfinite"):
                warnings.warn(warn_nonfinite, UserWarning, stacklevel=stacklevel + 1)
        if closing.num_items > 0:
            state.last_window_items = closing.num_items
        return closing
