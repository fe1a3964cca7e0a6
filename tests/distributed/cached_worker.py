"""WindowLoss under torchrun, 2 gloo processes: the loss sees every rank's representations, and the
step equals one float64 big batch on the union of the ranks' windows (rank 0's items first), with
uneven ranks, a rank with no data, the loss's own parameters inside or beside the wrapped module,
DDP and FSDP2, step() and train() over a WindowSampler, labels and scores riding along (joined over
the ranks), and a loss without representations refused on every rank (see test_cached.py)."""
from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: the contrastive helpers

from contrastive import DualEncoder, big_batch_step, largest_difference, pair_batch, split, twin, window_loss  # noqa: E402
from distributed.launch import run_modules  # noqa: E402
from distributed.worker import params_equal_on_all_ranks  # noqa: E402
from contrastive_labels import labelled_batch, labelled_big_batch_step, labelled_window_loss, split_rows  # noqa: E402
from gradaccum import Accumulator, WindowLoss, WindowSampler  # noqa: E402

RANK, WORLD = 0, 1
TOL = 1e-12
# each rank's micro-batch sizes per window: uneven shares, then a window where rank 1 has nothing
WINDOWS = [{0: [4, 4, 3], 1: [5, 1]}, {0: [2, 3], 1: []}, {0: [3], 1: [4, 4]}]


def windows(offset: int = 0):
    """Every rank's micro-batches of each window (every rank builds all of them: the reference)."""
    out = []
    for w, shares in enumerate(WINDOWS):
        per_rank = {}
        for r, sizes in shares.items():
            per_rank[r] = split(pair_batch(sum(sizes), seed=100 * (w + offset) + r), sizes) if sizes else []
        out.append(per_rank)
    return out


def _run(acc, model_of_loss, wl, ref, ref_opt, data, *, max_grad_norm=None):
    worst = 0.0
    for per_rank in data:
        acc.step(per_rank[RANK], wl)
        union = [mb for r in range(WORLD) for mb in per_rank[r]]
        big_batch_step(ref, ref_opt, union, max_grad_norm=max_grad_norm)
        worst = max(worst, largest_difference(model_of_loss, ref))
    assert worst < TOL, worst
    return worst


def cached_ddp_exact_with_uneven_ranks_and_a_rank_without_data():
    """The temperature sits inside the DDP module and only the loss reads it (find_unused_parameters
    False: its gradient rides in the reducing backward)."""
    model = DualEncoder(buffer=True)
    ref, opt, ref_opt = twin(model)
    ddp = DDP(model)
    acc = Accumulator(ddp, opt, max_grad_norm=0.5)
    worst = _run(acc, model, window_loss(lambda: model.log_scale), ref, ref_opt, windows(), max_grad_norm=0.5)
    assert params_equal_on_all_ranks(model)
    return f"3 windows (rank 1 empty in one), clipped: {worst:.1e} from one big batch"


def cached_ddp_find_unused_parameters():
    """Under find_unused_parameters=True the loss's parameters' gradient is in .grad before any backward."""
    model = DualEncoder()
    ref, opt, ref_opt = twin(model, "sgd")
    ddp = DDP(model, find_unused_parameters=True)
    worst = _run(Accumulator(ddp, opt), model, window_loss(lambda: model.log_scale), ref, ref_opt, windows(1))
    assert params_equal_on_all_ranks(model)
    return f"{worst:.1e}"


def cached_ddp_loss_parameters_beside_the_wrapped_module():
    """CLIP's logit scale and a head applied in the loss, beside the DDP module in the model given to
    the Accumulator; the big batch's gradient, the same on every rank."""
    encoder = DualEncoder(scale=False)
    holder = nn.Module()
    holder.encoder = DDP(encoder)
    holder.log_scale = nn.Parameter(torch.tensor([0.5], dtype=torch.float64))
    holder.head = nn.Linear(8, 8).double()

    ref_enc = DualEncoder(scale=False)
    ref_enc.load_state_dict(encoder.state_dict())
    ref_scale = nn.Parameter(holder.log_scale.detach().clone())
    ref_head = nn.Linear(8, 8).double()
    ref_head.load_state_dict(holder.head.state_dict())
    from contrastive import in_batch_negatives

    def loss(reps, head, scale):
        return in_batch_negatives(head(reps[0]), reps[1], scale)

    opt = torch.optim.AdamW(holder.parameters(), lr=0.05, weight_decay=0.1)
    ref_params = list(ref_enc.parameters()) + [ref_scale] + list(ref_head.parameters())
    ref_opt = torch.optim.AdamW(ref_params, lr=0.05, weight_decay=0.1)
    acc = Accumulator(holder, opt)
    wl = WindowLoss(lambda m, b: m.encoder(*b), lambda m, r: loss(r, m.head, m.log_scale))
    worst = 0.0
    for per_rank in windows(2):
        acc.step(per_rank[RANK], wl)
        union = [mb for r in range(WORLD) for mb in per_rank[r]]
        ref_opt.zero_grad()
        loss(ref_enc(torch.cat([b[0] for b in union]), torch.cat([b[1] for b in union])), ref_head, ref_scale).backward()
        ref_opt.step()
        mine = list(encoder.parameters()) + [holder.log_scale] + list(holder.head.parameters())
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(mine, ref_params)))
    assert worst < TOL, worst
    assert params_equal_on_all_ranks(holder)
    return f"{worst:.1e}"


def cached_ddp_dropout_replayed_with_rank_seeds():
    """Dropout, each rank seeded apart: pass 2 replays pass 1 on each rank; the step equals the same
    split run as one graph on each rank (whose representations the loss sees together)."""
    torch.manual_seed(0)
    model = DualEncoder(dropout=0.3)
    ddp = DDP(model)
    acc = Accumulator(ddp, torch.optim.SGD(model.parameters(), lr=0.5))
    mine = split(pair_batch(9, seed=RANK), [4, 5] if RANK == 0 else [3, 6])
    torch.manual_seed(40 + RANK)
    result = acc.step(mine, window_loss(lambda: model.log_scale))
    assert result.num_items == 18 and not result.skipped
    assert params_equal_on_all_ranks(model)
    return "replayed on both ranks (checked in the first window), replicas equal"


def cached_fsdp2_exact():
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    encoder = DualEncoder(scale=False)
    ref = DualEncoder(scale=False)
    ref.load_state_dict(encoder.state_dict())
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(encoder.query, mesh=mesh)
    fully_shard(encoder, mesh=mesh)
    holder = nn.Module()
    holder.encoder = encoder
    holder.log_scale = nn.Parameter(torch.tensor([0.5], dtype=torch.float64))  # beside the sharded module
    ref_scale = nn.Parameter(holder.log_scale.detach().clone())
    from contrastive import in_batch_negatives

    opt = torch.optim.SGD(holder.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(list(ref.parameters()) + [ref_scale], lr=0.5)
    acc = Accumulator(holder, opt)
    wl = WindowLoss(lambda m, b: m.encoder(*b), lambda m, r: in_batch_negatives(*r, m.log_scale))
    worst = 0.0
    for per_rank in windows(3):
        acc.step(per_rank[RANK], wl)
        union = [mb for r in range(WORLD) for mb in per_rank[r]]
        ref_opt.zero_grad()
        in_batch_negatives(*ref(torch.cat([b[0] for b in union]), torch.cat([b[1] for b in union])),
                           ref_scale).backward()
        ref_opt.step()
        full = [p.full_tensor() for p in encoder.parameters()]
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(full, ref.parameters())),
                    (holder.log_scale - ref_scale).abs().max().item())
    assert worst < TOL, worst
    return f"every rank runs as many forwards in each pass; {worst:.1e}"


def cached_train_over_a_window_sampler():
    """acc.train over a WindowSampler: 23 pairs, global windows of 8 in micro-batches of 3, so the
    ranks' shares are uneven and the last window short."""
    from torch.utils.data import DataLoader

    q, d = pair_batch(23, seed=77)
    sampler = WindowSampler(23, global_batch_size=8, micro_batch_size=3, seed=5)
    loader = DataLoader(list(zip(q, d)), batch_sampler=sampler)
    model = DualEncoder()
    ref, opt, ref_opt = twin(model)
    results = list(Accumulator(DDP(model), opt).train(loader, window_loss(lambda: model.log_scale)))
    for w in range(sampler.num_windows):
        order = sampler.window_items(w, epoch=0)  # rank 0's share first, as the ranks' representations are joined
        big_batch_step(ref, ref_opt, [(q[order], d[order])])
    assert [r.num_items for r in results] == [8, 8, 7], results
    worst = largest_difference(model, ref)
    assert worst < TOL, worst
    return f"{worst:.1e}"


def cached_ddp_misuse_is_refused_on_every_rank_even_one_without_data():
    """encode detaching its output, in a first window where rank 1 holds nothing: both ranks raise the
    same error (rank 1 runs a padding forward whose output would pass), none waits in a collective."""
    model = DualEncoder()
    ddp = DDP(model)
    acc = Accumulator(ddp, torch.optim.SGD(model.parameters(), lr=0.5))
    spare = split(pair_batch(1, seed=9), [1])[0]
    acc.set_padding(spare)
    mine = split(pair_batch(5, seed=RANK), [3, 2]) if RANK == 0 else []
    detaching = WindowLoss(lambda m, b: tuple(t.detach() for t in m(*b)) if len(b[0]) > 1 else m(*b),
                           lambda m, r: __import__("contrastive").in_batch_negatives(*r, m.module.log_scale))
    try:
        acc.step(mine, detaching)
    except ValueError as e:
        assert "does not require grad (on this rank or another)" in str(e), e
    else:
        raise AssertionError("not refused")
    result = acc.step(split(pair_batch(4, seed=RANK), [4]), window_loss(lambda: model.log_scale))
    assert result.step == 1 and params_equal_on_all_ranks(model)
    return "refused on both ranks, the next window steps"


SHARES = [{0: [4, 3], 1: [5]}, {0: [2], 1: [3, 3]}]  # each rank's micro-batch sizes, per window



def cached_labels_ride_along_joined_across_ranks():
    model = DualEncoder(scale=False)  # no temperature: every parameter is used in the forward (DDP)
    ref, opt, ref_opt = twin(model, "sgd")
    acc = Accumulator(DDP(model), opt)
    wl = labelled_window_loss()
    worst = 0.0
    for w, shares in enumerate(SHARES):
        per_rank = {r: split_rows(labelled_batch(sum(s), seed=10 * w + r), s) for r, s in shares.items()}
        result = acc.step(per_rank[RANK], wl)
        labelled_big_batch_step(ref, ref_opt, [mb for r in range(WORLD) for mb in per_rank[r]])
        assert result.num_items == sum(sum(s) for s in shares.values())
        worst = max(worst, largest_difference(model, ref))
    assert worst < TOL, worst
    # teeth: each rank's own labels only is another objective
    local, _, local_opt = twin(DualEncoder(scale=False), "sgd")
    labelled_big_batch_step(local, local_opt, split_rows(labelled_batch(7, seed=0), [4, 3]))
    union, _, union_opt = twin(DualEncoder(scale=False), "sgd")
    labelled_big_batch_step(union, union_opt, split_rows(labelled_batch(7, seed=0), [4, 3]) + [labelled_batch(5, seed=1)])
    assert largest_difference(local, union) > 1e-3
    assert params_equal_on_all_ranks(model)
    return f"2 windows, uneven ranks: {worst:.1e} from one big batch"


def cached_loss_without_representations_refused_on_every_rank():
    model = DualEncoder()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(DDP(model), torch.optim.SGD(model.parameters(), lr=0.1))
    wl = WindowLoss(lambda m, b: m(b[0], b[1]), lambda m, r: m.module.log_scale.sum())
    try:
        acc.step(split_rows(labelled_batch(4, seed=RANK), [2, 2]), wl)
    except ValueError as e:
        assert "does not depend on the representations encode returned" in str(e), e
    else:
        raise AssertionError("not refused")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return "refused on both ranks before any backward"


def cached_layouts_that_differ_across_ranks_are_refused_on_every_rank():
    """Rank 1's encode returns its representations in another width (say, sequences padded to its own
    length): the ranks would send all-gathers of other sizes. Refused on both ranks, nothing changed."""
    from gradaccum import RankAgreementError

    model = DualEncoder()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(DDP(model), torch.optim.SGD(model.parameters(), lr=0.1))
    wl = WindowLoss(lambda m, b: tuple(torch.cat([z] * (1 + RANK), dim=1) for z in m(*b)),
                    lambda m, r: (r[0] * r[1]).sum(1).mean())
    try:
        acc.step(split(pair_batch(4, seed=RANK), [2, 2]), wl)
    except RankAgreementError as e:
        assert "differ in layout" in str(e), e
    else:
        raise AssertionError("not refused")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return "refused on both ranks before the gather"


SCENARIOS = [cached_labels_ride_along_joined_across_ranks, cached_loss_without_representations_refused_on_every_rank,
             cached_layouts_that_differ_across_ranks_are_refused_on_every_rank,
             cached_ddp_misuse_is_refused_on_every_rank_even_one_without_data, cached_ddp_exact_with_uneven_ranks_and_a_rank_without_data, cached_ddp_find_unused_parameters,
             cached_ddp_loss_parameters_beside_the_wrapped_module, cached_ddp_dropout_replayed_with_rank_seeds,
             cached_fsdp2_exact, cached_train_over_a_window_sampler]

if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
