"""The examples in the core's docstrings run as written (the maths module's above all)."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["gradaccum._maths", "gradaccum._weights", "gradaccum._ranks", "gradaccum._boundary", "gradaccum.batching",
           "gradaccum.losses", "gradaccum.schedule", "gradaccum.accumulator", "gradaccum.checking",
           "gradaccum.rl"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
