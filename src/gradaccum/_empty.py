"""The guard of a micro-batch of 0 items, the same in every driver. Its mean ``sum / count`` is ``0 / 0 = nan``, and
so is its graph's gradient whatever weight multiplies the loss: the mean is cleaned to 0 (:func:`clean_mean`) and its
backward brings each parameter exactly 0 (:func:`weighing_nothing`). A count on an accelerator is compared on the
device, with no host sync."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Union

import torch

from ._checks import Count, item_count

__all__ = ["may_be_empty", "host_count", "weighing_nothing", "graph_leaves", "clean_mean"]


def may_be_empty(num_items: Count) -> Union[None, bool, torch.Tensor]:
    """Whether a micro-batch of ``num_items`` holds no item, without waiting for a device: None for a count
    read as > 0 (nothing to guard), True for 0, a 0-d bool on the device for an accelerator's tensor."""
    n = host_count(num_items)
    if isinstance(n, torch.Tensor):
        return n.reshape(()) == 0
    return True if n == 0 else None


def host_count(num_items: Count) -> Count:
    """``num_items`` as the host reads it without waiting: a CPU tensor read (free), an accelerator's left a tensor."""
    if isinstance(num_items, torch.Tensor) and num_items.device.type == "cpu":
        return num_items.item()
    return num_items


@contextlib.contextmanager
def weighing_nothing(params: Iterable[torch.Tensor], empty: Union[bool, torch.Tensor]) -> Iterator[None]:
    """Inside: a backward adds exactly nothing to the parameters' gradients where ``empty`` (True, or a 0-d
    bool tensor), by a hook on each parameter, which runs before its gradient is accumulated (and reduced)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if empty is True:
            return torch.zeros_like(grad)
        return torch.where(empty.to(grad.device, non_blocking=True), 0.0, grad)  # type: ignore[union-attr]

    handles = [p.register_hook(hook) for p in params if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def graph_leaves(loss: torch.Tensor) -> List[torch.Tensor]:
    """The leaves a backward of ``loss`` accumulates into (under FSDP2: the unsharded parameters its forward ran on)."""
    leaves: List[torch.Tensor] = []
    seen = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            leaves.append(variable)
        else:
            stack.extend(child for child, _ in node.next_functions)
    return leaves


def clean_mean(loss: torch.Tensor, num_items: Count) -> torch.Tensor:
    """``loss``, once ``num_items`` is checked, with a mean over no item (nan) cleaned to 0 (on the device, no sync)."""
    item_count("num_items", num_items)
    if isinstance(num_items, torch.Tensor):
        return torch.where(num_items.reshape(()) == 0, loss.nan_to_num(0.0), loss)
    return loss.nan_to_num(0.0) if num_items == 0 else loss
