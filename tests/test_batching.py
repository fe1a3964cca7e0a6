from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from gradaccum import split_batch
from gradaccum.batching import leading_dim


def test_split_nested_structures_keeps_non_tensors():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.arange(10), "p": Pair(torch.zeros(10, 2), [torch.ones(10)]), "name": "demo", "k": 3}
    chunks = split_batch(batch, 4)
    assert [c["a"].tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(isinstance(c["p"], Pair) and c["name"] == "demo" and c["k"] == 3 for c in chunks)
    assert [c["p"].y[0].shape[0] for c in chunks] == [4, 4, 2]


def test_split_returns_views():
    t = torch.zeros(6, 3)
    chunks = split_batch(t, 4)
    chunks[0][0, 0] = 1.0
    assert t[0, 0] == 1.0


@pytest.mark.parametrize("size, expect", [(1, [1] * 5), (2, [2, 2, 1]), (5, [5]), (9, [5])])
def test_split_sizes(size, expect):
    assert [c.shape[0] for c in split_batch(torch.zeros(5), size)] == expect


def test_leading_dim_errors():
    with pytest.raises(ValueError, match="holds no tensor"):
        leading_dim({"a": 1})
    with pytest.raises(ValueError, match="0-d tensor"):
        leading_dim((torch.tensor(1.0),))
    with pytest.raises(ValueError, match="0 items"):
        split_batch(torch.zeros(0, 3), 2)
