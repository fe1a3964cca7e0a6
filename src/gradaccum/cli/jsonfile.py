"""JSON the way every strict parser reads it: a non-finite number (a diverged loss) is ``null``.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which ``JSON.parse``, ``jq`` and most
other readers refuse. Every JSON file and line the command line writes goes through here.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["finite_or_none", "strict_json"]


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float inside it (dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``value`` with ``null`` for NaN and infinities (``allow_nan=False`` proves it)."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
