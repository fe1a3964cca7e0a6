"""Old public names kept readable for a while: one read-only property per rename, that warns and reads
the new name (one name per concept: R is ``state.reference``, a window's micro-batches
``micro_batches``, the skip count ``skipped``)."""
from __future__ import annotations

import operator
import warnings
from typing import Any


def renamed(old: str, new: str) -> property:
    """A read-only property for the old attribute ``old`` that reads ``new`` (a dotted path from the
    object, e.g. ``"state.reference"``) and says so with a :class:`DeprecationWarning` at the caller."""
    read = operator.attrgetter(new)

    def get(self: Any) -> Any:
        warnings.warn(f"{type(self).__name__}.{old} is deprecated: read .{new}", DeprecationWarning, stacklevel=2)
        return read(self)

    get.__doc__ = f"Deprecated: ``{new}``."
    return property(get)
