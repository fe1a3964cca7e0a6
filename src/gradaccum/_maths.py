"""What a loss's items n_k are (the weights they make: :mod:`gradaccum._weights`) and its sum over them, as pure
functions: next-token targets, a Hugging Face head's targets, a mixture-of-experts router's statistics; and the
numeric helpers."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .errors import ConfigurationError

__all__ = ["ceil_div", "count_dtype", "tensor_norms", "target_count", "token_loss_sum", "LOSSES", "loss_items",
           "summed_loss", "router_statistics", "balance_loss_part"]


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


def tensor_norms(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Each tensor's 2-norm, stacked (in ``dtype``, else the tensors' own): one fused pass over plain
    tensors on one device. The total norm is the 2-norm of these; a fingerprint their weighted sum.

    >>> tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()
    [5.0, 1.0]
    """
    if len({t.device for t in tensors}) == 1:
        norms = torch.stack(torch._foreach_norm(list(tensors)))
    else:
        norms = torch.stack([torch.linalg.vector_norm(t).to(tensors[0].device) for t in tensors])
    return norms if dtype is None else norms.to(dtype)


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
            f"{tuple(targets.shape)}: logits must be targets.shape + (vocab,)")
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
    if len(router_logits) == 0:
        raise ConfigurationError("router_statistics: router_logits is empty; pass one (tokens, experts) tensor per "
                                 "MoE layer")
    counts = probs = rows = 0.0  # each layer's added in (0.0 + x is x, in x's dtype)
    for layer in router_logits:
        logits = layer.float() if layer.dtype in (torch.float16, torch.bfloat16) else layer
        p = torch.softmax(logits, dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices
        weight = (torch.ones(p.shape[0], dtype=p.dtype, device=p.device) if mask is None
                  else mask.reshape(-1).to(p.device, p.dtype))
        c = torch.zeros(p.shape[-1], dtype=p.dtype, device=p.device).scatter_add_(
            0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        s = (p * weight[:, None]).sum(dim=0)
        counts, probs, rows = counts + c, probs + s, rows + weight.sum()
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
