"""The big batch that :func:`gradaccum.check_equivalence` compares with, computed independently of the code
it checks (:func:`window_grads`, not :mod:`gradaccum._weights`' weights); a loss over the window is
backpropagated whole on the batch, and run through the Accumulator's own window on the split."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._cached import WindowLoss
from ._checks import ROWS, item_count, scalar_loss, split_loss_output
from .accumulator import Accumulator
from .batching import Batch, concat_batches, leading_dim
from .moe import MoELoss

__all__ = ["MicroBatchFailed", "window_grads", "balance_loss"]


class MicroBatchFailed(Exception):
    """``loss_fn`` (or the model's forward inside it) raised on micro-batch ``index`` of ``items``."""

    def __init__(self, index: int, items: int, error: BaseException) -> None:
        super().__init__(index, items, error)
        self.index, self.items, self.error = index, items, error


def window_grads(model: nn.Module, loss_fn: Any, micro_batches: List[Batch], num_items: Any = None
                  ) -> Tuple[Dict[str, torch.Tensor], float, bool, float]:
    """The oracle: backpropagate ``n_k * L_k / N`` per micro-batch (N counted up front, so that a gradient hook of the
    model's sees the gradient at the size it has in training), rescaled once in float64 by ``N / sum n_k`` where
    ``loss_fn`` counts other items; whether ``loss_fn`` returned a bare loss (weighed by what ``num_items``
    counts, or by rows); and ``sum n_k``. A loss over the window (WindowLoss, MoELoss) is
    :func:`whole_batch_loss` on the batch, :func:`accumulated_grads` on a split."""
    for p in model.parameters():  # not model.zero_grad(): the oracle runs no override of the model's own
        p.grad = None
    coupled = isinstance(loss_fn, (WindowLoss, MoELoss))
    if coupled and len(micro_batches) > 1:
        return (*accumulated_grads(model, loss_fn, micro_batches), False, 1.0)
    counts = [None if coupled else (  # a loss over the window is one item: num_items is not asked
        leading_dim(mb) if num_items is None or num_items == ROWS else
        item_count("num_items(micro_batch)", num_items(mb))) for mb in micro_batches]
    counted = sum(1.0 if c is None else float(c) for c in counts) or 1.0  # N, counted up front
    loss_sum, items, bare = 0.0, 0.0, False
    for index, (mb, count) in enumerate(zip(micro_batches, counts)):
        try:
            out = whole_batch_loss(model, loss_fn, mb) if coupled else loss_fn(model, mb)
        except Exception as e:  # noqa: BLE001 - which micro-batch failed decides whose fault it is
            raise MicroBatchFailed(index, leading_dim(mb), e) from e
        bare = type(out) is torch.Tensor  # under the Accumulator's contract: a bare loss counts num_items(mb), or rows
        loss, n = split_loss_output(out, count)
        loss = scalar_loss(loss, subject="loss_fn must return a scalar loss",
                           where="loss_fn (check_equivalence compares gradients)")
        (loss * (float(n) / counted)).backward()
        loss_sum += float(loss.detach()) * float(n)
        items += float(n)
    grads = {name: p.grad.detach().double() * (counted / items) for name, p in model.named_parameters()
             if p.grad is not None}
    return grads, loss_sum / items, bare, items


def whole_batch_loss(model: nn.Module, loss_fn: Any, batch: Batch) -> Tuple[torch.Tensor, int]:
    """A loss over the window on the whole batch, as it is (an MoELoss's token loss plus ``coef`` times
    :func:`balance_loss`), checked, as one item."""
    if isinstance(loss_fn, WindowLoss):
        loss = loss_fn.loss(model, loss_fn.encode(model, batch))
        subject, where = "WindowLoss's loss must return a scalar loss", "loss(model, representations)"
    else:
        out = loss_fn.checked(loss_fn.forward(model, batch))
        loss = out.loss + loss_fn.coef * balance_loss(out.router_logits, loss_fn.top_k, out.token_mask)
        subject, where = "MoELoss's forward must return a scalar mean loss", "forward(model, batch).loss"
    return scalar_loss(loss, subject=subject, where=where), 1


def balance_loss(router_logits: Any, top_k: int, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The checker's own load-balancing loss of one batch (``E * sum_i f_i P_i`` over every layer's unmasked
    tokens), in float64, written from transformers' ``load_balancing_loss_func``, not from :mod:`gradaccum._maths`."""
    probs = [torch.softmax(layer.to(torch.float64), dim=-1) for layer in router_logits]
    experts = probs[0].shape[-1]
    weight = torch.cat([torch.ones(p.shape[0], dtype=torch.float64, device=p.device) if token_mask is None
                        else token_mask.reshape(-1).to(p.device, torch.float64) for p in probs])
    prob = torch.cat(probs)
    chosen = nn.functional.one_hot(torch.topk(prob.detach(), top_k, dim=-1).indices, experts).sum(dim=1)
    fraction = (chosen * weight[:, None]).sum(dim=0) / weight.sum()
    mean_prob = (prob * weight[:, None]).sum(dim=0) / weight.sum()
    return experts * (fraction * mean_prob).sum()


def accumulated_grads(model: nn.Module, loss: Any, micro_batches: List[Batch]
                       ) -> Tuple[Dict[str, torch.Tensor], float]:
    """The Accumulator's own window over ``micro_batches`` (a loss over the window: a WindowLoss, an
    MoELoss), stepped with a zero learning rate and read just before the optimizer step."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.0)
    read: Dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: read.update(
        {name: p.grad.detach().double().clone() for name, p in named if p.grad is not None}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Accumulator's BatchNorm warning: the report names BatchNorm
        # the batch again with the size that split it: a list of bare-tensor micro-batches is ambiguous
        result = Accumulator(model, optimizer).step(concat_batches(micro_batches), loss,
                                                    micro_batch_size=leading_dim(micro_batches[0]))
    return read, result.loss
