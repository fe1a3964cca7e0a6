from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from gradaccum import split_batch
from gradaccum.batching import concat_batches, leading_dim, slice_batch


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


def test_zero_d_tensors_are_carried_not_split():
    """A per-batch scalar (an index, a flag) rides along to every chunk; the items are the others'."""
    batch = {"x": torch.arange(5.0), "idx": torch.tensor(7), "flags": (torch.tensor(True), torch.ones(5, 2))}
    assert leading_dim(batch) == 5
    chunks = split_batch(batch, 2)
    assert [c["x"].tolist() for c in chunks] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert all(c["idx"] is batch["idx"] and c["flags"][0] is batch["flags"][0] for c in chunks)
    assert [c["flags"][1].shape[0] for c in chunks] == [2, 2, 1]
    joined = concat_batches(chunks)
    assert torch.equal(joined["x"], batch["x"]) and joined["idx"] is batch["idx"]
    assert slice_batch(batch, 1, 3)["idx"] is batch["idx"]


def test_joining_micro_batches_that_carry_different_scalars_is_refused():
    """Joining (micro_batch_size='auto') would keep one of two different per-batch values: refused."""
    a, b = {"x": torch.zeros(2), "idx": torch.tensor(0)}, {"x": torch.zeros(3), "idx": torch.tensor(1)}
    with pytest.raises(ValueError, match=r"micro-batches 0 and 1 carry different values at \['idx'\].*leading dimension"):
        concat_batches([a, b])
    with pytest.raises(ValueError, match=r"only 0-d tensors \(batch\['idx'\]\)"):
        leading_dim({"idx": torch.tensor(3), "name": "x"})
