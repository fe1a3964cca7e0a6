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

:class:`~gradaccum._weights.WindowWeights` composes these formulas into the window every driver runs (the
Accumulator's window and boundary, the pipeline, the Hugging Face Trainer drivers, the Lightning callback),
step by step: open, weigh each micro-batch, close (the :class:`Closing`), record.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .errors import ConfigurationError

__all__ = ["Closing", "CLIP_EPS", "ceil_div", "backward_weight", "boundary_scale", "running_reference",
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
