"""An attribute replaced for a while and put back after, also on an exception (a LightningModule's hooks)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Set, Tuple

from torch import nn

__all__ = ["NoStep", "Swaps", "swapped"]


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the block, then what was there before (an attribute that came from the
    class is deleted, so the class's shows through). A module's child is read from its registry."""
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


class Swaps:
    """Attributes :func:`swapped` until :meth:`restore` (which may be called again), each wrapped once."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._names: Set[Tuple[int, str]] = set()

    def __bool__(self) -> bool:
        return bool(self._names)

    def wrap(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        """``owner.name = wrap(owner.name)`` until :meth:`restore`, unless it is wrapped already."""
        key = (id(owner), name)  # the owner stays alive while it is swapped: its id is not reused meanwhile
        if key not in self._names:
            self._stack.enter_context(swapped(owner, name, wrap(getattr(owner, name))))
            self._names.add(key)  # only once swapped: a wrap that raised leaves nothing held

    def restore(self) -> None:
        try:
            self._stack.close()
        finally:
            self._names.clear()


class NoStep:
    """An optimizer or scheduler whose ``step()`` does nothing; everything else is the real object's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
