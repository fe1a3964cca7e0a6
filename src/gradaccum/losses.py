"""Loss helpers that return ``(mean_loss, num_items)`` so windows are weighted by items, not batches.

For a causal language model the items are the next-token targets that are not ``ignore_index``, which padded
micro-batches hold different numbers of; the Accumulator weights each micro-batch's mean by its count::

    window loss = sum_k count_k * mean_k / sum_k count_k

A contrastive model's loss couples the batch's rows instead: :func:`contrastive_window_loss` is CLIP's and
SigLIP's as a :class:`~gradaccum.WindowLoss`, computed once over the whole window."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch
from torch import nn

from ._maths import target_count, token_loss_sum
from .errors import ConfigurationError

if TYPE_CHECKING:  # the window's machinery is imported where a contrastive loss is made, not with the losses
    from ._cached import WindowLoss

__all__ = ["causal_lm_loss", "contrastive_window_loss", "count_targets", "token_cross_entropy"]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over targets that are not ``ignore_index``, and their count.

    ``logits`` is ``(..., vocab)``, ``targets`` the matching ``(...)``. The count stays a tensor on the logits'
    device (no host synchronisation). A micro-batch with no counted target returns a mean of 0 that carries no
    weight. The sum and the count are :func:`gradaccum._maths.token_loss_sum` and :func:`gradaccum._maths.target_count`.
    """
    total = token_loss_sum(logits, targets, ignore_index=ignore_index)
    count = target_count(targets, ignore_index=ignore_index)
    return total / count.clamp(min=1).to(total.dtype), count


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of a causal LM: position t predicts ``labels[:, t + 1]``.

    Args:
        logits: ``(batch, seq, vocab)``, the model's output for ``input_ids``.
        labels: ``(batch, seq)``, usually ``input_ids`` with padding set to ``ignore_index``.

    Returns:
        ``(mean_loss, num_targets)``: the mean over the ``labels[:, 1:]`` that are not ignored,
        and how many there are. Pass both back from a ``loss_fn``.

    Example:
        >>> logits = torch.zeros(2, 4, 5)
        >>> labels = torch.tensor([[1, 2, 3, -100], [1, 2, -100, -100]])
        >>> causal_lm_loss(logits, labels)[1].item()   # 2 + 1 targets after the shift
        3
    """
    if logits.dim() != 3 or labels.dim() != 2:
        raise ConfigurationError(f"causal_lm_loss expects logits (batch, seq, vocab) and labels (batch, seq), got "
                                 f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    return token_cross_entropy(logits[:, :-1, :], labels[:, 1:], ignore_index=ignore_index)


def count_targets(labels: torch.Tensor, *, shift: bool = True, ignore_index: int = -100) -> int:
    """How many targets a causal LM's loss is a mean over, counted from the labels before any forward pass: the
    ``labels[:, 1:]`` (``shift=True``) that are not ``ignore_index``.

    Give it to ``Accumulator.step``/``train`` as ``num_items=lambda mb: count_targets(mb["labels"])``: the window's
    token count is then known before the first backward, so each micro-batch's backward weighs exactly
    ``tokens_k / tokens`` as the full batch does (float32 parts of a float64 model, such as Llama's RMSNorm, then
    round as in one big batch) and no scaling pass is needed. It also makes a bare mean-over-tokens loss, like
    Hugging Face's ``outputs.loss``, weighted by tokens.

    >>> count_targets(torch.tensor([[1, 2, 3, -100], [1, 2, -100, -100]]))
    3
    """
    if labels.dim() < 1 or (shift and labels.dim() != 2):
        raise ConfigurationError(f"count_targets expects labels of shape (batch, seq), got {tuple(labels.shape)}")
    return int(target_count(labels[:, 1:] if shift else labels, ignore_index=ignore_index))


def contrastive_window_loss(model: nn.Module) -> Optional[WindowLoss]:
    """The loss of a contrastive Hugging Face model (``CLIPModel``, ``SiglipModel``) as a WindowLoss: ``encode``
    runs the model without its loss (``return_loss=False``) for the normalized text and image embeddings; ``loss``
    is the model's own over the whole window, its ``logit_scale`` (and SigLIP's ``logit_bias``) reached through
    the model. None for another model. ``ExactTrainer`` trains these models with it; in one's own loop:
    ``acc.step(batch, contrastive_window_loss(model), ...)``."""
    from ._cached import WindowLoss

    name = type(model).__name__
    if name not in ("CLIPModel", "SiglipModel"):
        return None

    def encode(m: nn.Module, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        out = m(**{k: v for k, v in batch.items() if k not in ("return_loss", "labels")}, return_loss=False)
        return out.text_embeds, out.image_embeds

    def loss(m: nn.Module, reps: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        text, image = reps
        logits = text @ image.T * m.logit_scale.exp()
        if name == "CLIPModel":
            target = torch.arange(len(text), device=text.device)
            return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target)) / 2
        logits = logits + m.logit_bias
        signs = 2 * torch.eye(len(text), device=text.device, dtype=logits.dtype) - 1
        return -nn.functional.logsigmoid(signs * logits).sum(dim=-1).mean()

    return WindowLoss(encode, loss)
