"""WindowLoss: a loss that couples the window's items (in-batch negatives, CLIP) is exactly the big
batch's on one process, for any split, through step() and train(); plain accumulation is not."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from contrastive import (DualEncoder, big_batch_step, in_batch_negatives, largest_difference, pair_batch,
                         per_micro_batch_step, split, twin, window_loss)
from gradaccum import Accumulator, ReplayError, WindowLoss
from gradaccum import _random

TOL = 1e-12  # float64: the gradients differ by the order of additions only


@pytest.mark.parametrize("micro_batch_size", [1, 3, 4, 13])
@pytest.mark.parametrize("max_grad_norm", [None, 0.3])
def test_exact_for_any_micro_batch_size_where_plain_accumulation_is_not(micro_batch_size, max_grad_norm):
    model = DualEncoder()
    ref, opt, ref_opt = twin(model)
    acc = Accumulator(model, opt, max_grad_norm=max_grad_norm)
    wl = window_loss(lambda: model.log_scale)
    for step in range(3):
        batch = pair_batch(13, seed=step)
        result = acc.step(batch, wl, micro_batch_size=micro_batch_size)
        loss = big_batch_step(ref, ref_opt, [batch], max_grad_norm=max_grad_norm)
        assert result.num_items == 13 and math.isclose(result.loss, loss, rel_tol=1e-12)
        assert largest_difference(model, ref) < TOL
    plain, _, plain_opt = twin(DualEncoder())
    per_micro_batch_step(plain, plain_opt, split(pair_batch(13, seed=0), [4, 4, 4, 1]))
    fresh, _, fresh_opt = twin(DualEncoder())
    big_batch_step(fresh, fresh_opt, [pair_batch(13, seed=0)])
    assert largest_difference(plain, fresh) > 1e-3  # the other objective: the test has teeth


def test_uneven_micro_batches_as_a_list_and_the_loss_s_own_parameters():
    """A list of uneven micro-batches; the temperature and a head applied inside the loss (a module
    the encoder never runs) get the big batch's gradient too."""
    model = DualEncoder()
    model.head = nn.Linear(8, 8).double()  # applied in the loss only
    ref, opt, ref_opt = twin(model, "sgd")

    def loss(reps, m):
        q, d = reps
        return in_batch_negatives(m.head(q), d, m.log_scale)

    acc = Accumulator(model, opt)
    batch = pair_batch(11, seed=4)
    acc.step(split(batch, [5, 1, 3, 2]), WindowLoss(lambda m, b: m(*b), lambda m, r: loss(r, m)))
    ref_opt.zero_grad()
    loss(ref(*batch), ref).backward()
    ref_opt.step()
    assert largest_difference(model, ref) < TOL


@pytest.mark.parametrize("shape", ["tuple", "dict", "negatives"])
def test_representations_as_tuple_dict_and_rows_of_several_negatives(shape):
    model = DualEncoder()
    ref, opt, ref_opt = twin(model)
    negatives = 3 if shape == "negatives" else 0
    batch = pair_batch(10, seed=5, negatives=negatives)
    if shape == "dict":
        wl = WindowLoss(lambda m, b: dict(zip("qd", m(*b))), lambda m, r: in_batch_negatives(r["q"], r["d"], m.log_scale))
    else:
        wl = window_loss(lambda: model.log_scale)
    Accumulator(model, opt).step(batch, wl, micro_batch_size=3)
    big_batch_step(ref, ref_opt, [batch])
    assert largest_difference(model, ref) < TOL


def test_train_with_a_short_last_window_is_exact_window_by_window():
    model = DualEncoder()
    ref, opt, ref_opt = twin(model)
    q, d = pair_batch(23, seed=6)
    loader = DataLoader(list(zip(q, d)), batch_size=3)  # 8 micro-batches: windows of 3, 3 and 2
    results = list(Accumulator(model, opt).train(loader, window_loss(lambda: model.log_scale), accum_steps=3))
    assert [r.num_items for r in results] == [9, 9, 5]
    for start, n in ((0, 9), (9, 9), (18, 5)):
        big_batch_step(ref, ref_opt, [(q[start:start + n], d[start:start + n])])
    assert largest_difference(model, ref) < TOL


def test_dropout_is_replayed_and_without_replay_the_step_is_wrong(monkeypatch):
    """With dropout, the reference is the same split run as one graph from the same random state:
    pass 2 must draw pass 1's masks. Broken replay is caught by the first window's check, and, past
    it, gives another gradient."""
    def one_graph_reference(model, opt, batch, sizes):
        opt.zero_grad()
        reps = [model(*mb) for mb in split(batch, sizes)]
        in_batch_negatives(torch.cat([r[0] for r in reps]), torch.cat([r[1] for r in reps]), model.log_scale).backward()
        opt.step()

    batch = pair_batch(10, seed=7)
    model = DualEncoder(dropout=0.3)
    ref, opt, ref_opt = twin(model, "sgd")
    wl = window_loss(lambda: model.log_scale)
    torch.manual_seed(11)
    Accumulator(model, opt).step(batch, wl, micro_batch_size=4)
    after = torch.get_rng_state()
    torch.manual_seed(11)
    one_graph_reference(ref, ref_opt, batch, [4, 4, 2])
    assert largest_difference(model, ref) < TOL
    assert torch.equal(after, torch.get_rng_state())  # the window drew its numbers once

    monkeypatch.setattr(_random.RandomState, "restore", lambda self: None)
    broken = DualEncoder(dropout=0.3)
    before = [p.detach().clone() for p in broken.parameters()]
    acc = Accumulator(broken, torch.optim.SGD(broken.parameters(), lr=0.5))
    refused = window_loss(lambda: broken.log_scale)
    for _ in range(2):  # a window whose replay differed leaves the loss unchecked: the next window checks again
        with pytest.raises(ReplayError, match="second forward gave other representations"):
            acc.step(batch, refused, micro_batch_size=4)
    assert refused not in acc.state.checked_replays
    assert all(torch.equal(a, b) for a, b in zip(before, broken.parameters())) and acc.steps == 0
    unchecked = window_loss(lambda: broken.log_scale)
    acc.state.checked_replays.add(unchecked)  # past the first window's check
    torch.manual_seed(11)
    acc.step(batch, unchecked, micro_batch_size=4)
    fresh = DualEncoder(dropout=0.3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
    torch.manual_seed(11)
    one_graph_reference(fresh, fresh_opt, batch, [4, 4, 2])
    assert largest_difference(broken, fresh) > 1e-3


def test_autocast_and_float32_buffers():
    """bf16 autocast: both passes autocast alike, so the step equals the same split run as one graph
    under autocast. accum_dtype: the float32 buffers hold the cached path's gradient too."""
    model = DualEncoder().float()
    ref, opt, ref_opt = twin(model, "sgd")
    batch = tuple(t.float() for t in pair_batch(12, seed=8))
    Accumulator(model, opt, precision="bf16").step(batch, window_loss(lambda: model.log_scale), micro_batch_size=4)
    ref_opt.zero_grad()
    reps = []
    for mb in split(batch, [4, 4, 4]):  # an autocast region each, as each micro-batch's forward runs
        with torch.autocast("cpu", dtype=torch.bfloat16):  # (one region would cache one bf16 weight copy
            reps.append(ref(*mb))                          # and sum its gradient in bf16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = in_batch_negatives(torch.cat([r[0] for r in reps]), torch.cat([r[1] for r in reps]), ref.log_scale)
    loss.backward()
    ref_opt.step()
    assert largest_difference(model, ref) < 1e-5

    low = DualEncoder().float()  # float32 parameters, their window gradient summed in float64 buffers
    wide, _, wide_opt = twin(DualEncoder(), "sgd")
    acc = Accumulator(low, torch.optim.SGD(low.parameters(), lr=0.5, momentum=0.9), accum_dtype=torch.float64,
                      max_grad_norm=0.3)
    acc.step(batch, window_loss(lambda: low.log_scale), micro_batch_size=3)
    big_batch_step(wide, wide_opt, [tuple(t.double() for t in batch)], max_grad_norm=0.3)
    assert acc.buffers.tensors() == [] and largest_difference(low.double(), wide) < 1e-6


def test_a_transformers_encoder_built_from_a_config_with_padded_inputs():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    encoder = transformers.BertModel(config).double()
    ref, opt, ref_opt = twin(encoder, "sgd")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (9, 7), generator=g)
    lengths = torch.tensor([7, 3, 5, 2, 7, 6, 4, 1, 5])
    mask = (torch.arange(7) < lengths[:, None]).long()
    ids = ids * mask  # padded with 0
    batch = {"input_ids": ids, "attention_mask": mask}

    def encode(model, mb):
        hidden = model(**mb).last_hidden_state
        m = mb["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1)  # mean over real tokens

    def loss(model, z):  # SimCSE-style: each sentence against the window's others, by a fixed pairing
        z = nn.functional.normalize(z, dim=-1)
        return nn.functional.cross_entropy(z @ z.roll(1, 0).T * 5.0, torch.arange(len(z)))

    Accumulator(encoder, opt).step(batch, WindowLoss(encode, loss), micro_batch_size=4)
    ref_opt.zero_grad()
    loss(ref, encode(ref, batch)).backward()
    ref_opt.step()
    assert largest_difference(encoder, ref) < 1e-10


def test_batchnorm_statistics_move_once_per_micro_batch_and_are_warned_about():
    model = DualEncoder()
    model.query.insert(1, nn.BatchNorm1d(16).double())
    with pytest.warns(UserWarning, match="BatchNorm layers in training mode"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)).step(
            pair_batch(12, seed=9), window_loss(lambda: model.log_scale), micro_batch_size=4)
    assert model.query[1].num_batches_tracked.item() == 3  # pass 2 only: as plain accumulation moves them


def _unchanged(model, before):
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and all(
        p.grad is None for p in model.parameters())


@pytest.mark.parametrize("encode, loss, match", [
    (lambda m, b: tuple(t.detach() for t in m(*b)), None, "does not require grad"),
    (lambda m, b: m(*b)[0][:-1], lambda m, r: r.sum(), "leading size 2, but the micro-batch holds 3 items"),
    (lambda m, b: m(*b), lambda m, r: in_batch_negatives(*r, None).reshape(1).expand(2), "must return a scalar"),
    (lambda m, b: m(*b), lambda m, r: (in_batch_negatives(*r, None), 4), "returned a tuple"),
    (lambda m, b: m(*b), lambda m, r: torch.tensor(1.0, dtype=torch.float64), "does not depend on the representations"),
    (lambda m, b: (m(*b)[0], "name"), lambda m, r: r[0].sum(), "returned str"),
])
def test_misuse_is_one_clear_error_before_anything_changes(encode, loss, match):
    model = DualEncoder()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = loss or (lambda m, r: in_batch_negatives(*r, None))
    with pytest.raises(ValueError, match=match):
        acc.step(pair_batch(9), WindowLoss(encode, loss), micro_batch_size=3)
    assert _unchanged(model, before) and acc.steps == 0


def test_arguments_a_window_loss_does_not_take_are_refused():
    model = DualEncoder()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    wl = window_loss(lambda: model.log_scale)
    with pytest.raises(ValueError, match="num_items= was given with a WindowLoss"):
        acc.step(pair_batch(4), wl, micro_batch_size=2, num_items=lambda b: 1)
    with pytest.raises(ValueError, match="'auto' is not supported with a WindowLoss"):
        acc.step(pair_batch(4), wl, micro_batch_size="auto")
    with pytest.raises(TypeError, match=r"WindowLoss\(loss=...\) must be callable"):
        WindowLoss(lambda m, b: m(*b), "infonce")
