"""An attribute of an object replaced for a while and put back after, also on an exception: how a
driver serves a framework's object something else for one call (a loss its cached embeddings), for one
fit (a LightningModule's hooks, wrapped) or for one skipped window's end (the Trainer's optimizer and
scheduler, by stand-ins whose ``step()`` does nothing)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

__all__ = ["NoStep", "swapped"]


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the block; after it, what was there before: the old value, or, where
    the attribute came from the class (a method), none of the instance's own, so the class's shows
    through again. A module's child is read from its registry, not through an attribute of the same name."""
    children = owner._modules if isinstance(owner, nn.Module) else {}
    own = name in children or name in vars(owner)
    old = children[name] if name in children else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, old)
        elif name in vars(owner):
            delattr(owner, name)


class NoStep:
    """Stands in for an optimizer or a scheduler whose step must not happen (a skipped window's):
    ``step()`` does nothing, everything else is the real object's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
