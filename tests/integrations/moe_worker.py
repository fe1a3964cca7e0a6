"""MoE load balancing over the window under torchrun, 2 gloo processes on the CPU (see
test_moe_distributed.py): ExactTrainer (DDP, FSDP2), ExactSFTTrainer (DDP) and Accumulator + MoELoss (DDP, uneven micro-batch counts
per rank, so one rank pads) against one float64 step per window on the model's own loss over both
ranks' micro-batches as one batch (float32 islands swapped for float64 on both sides). Prints on rank 0
``PASS <name>: <numbers>`` or ``FAIL <name>: <why>``."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Callable, Dict

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

import moe_models as M  # noqa: E402
import moe_scenarios as MS  # noqa: E402
import scenarios as S  # noqa: E402
from gradaccum import Accumulator, MoELoss  # noqa: E402
from hf_helpers import unpad  # noqa: E402
from distributed.launch import run_modules  # noqa: E402
from hf_worker import unsharded, verdict  # noqa: E402

torch.set_num_threads(1)
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
PER_RANK = [S.rank_micro_batches(r, S.SIZES[r]) for r in range(WORLD)]
WINDOWS = S.windows_of(PER_RANK, S.ACCUM)
CLIP = 0.05
# the Accumulator's windows: rank 0 runs 3 then 1 micro-batches, rank 1 runs 2 then 2 (it pads in window 0)
OWN = {0: [[2, 3, 1], [2]], 1: [[1, 2], [3, 1]]}
OWN_WINDOWS = [[S.rank_micro_batches(r, sizes[w], seed=7 + w) for r, sizes in OWN.items()] for w in range(2)]


def hf(family: str, name: str) -> str:
    model = M.moe_model(family)
    ref = MS.reference(model, WINDOWS, clip=CLIP)
    exact, trainer = S.hf_fit(model, PER_RANK, exact=True, clip=CLIP)
    native, _ = S.hf_fit(model, PER_RANK, exact=False, clip=CLIP)
    if trainer.state.global_step != len(WINDOWS):
        return f"FAIL {name}: global_step {trainer.state.global_step} != {len(WINDOWS)} windows"
    return verdict(name, exact, native, ref)


def hf_fsdp2(family: str, name: str) -> str:
    """ExactTrainer under Accelerate's FSDP2 on the CPU (scenarios.fsdp_on_cpu): each decoder layer then
    the root fully_shard-ed; the counting pass runs the sharded trunk on every rank alike (the Trainer
    gives every rank every micro-batch of a window). Shards gathered before the comparison."""
    model = M.moe_model(family)
    layer = next(type(m).__name__ for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
    S.BLOCKS = tuple(S.BLOCKS) + (layer,)
    ref = MS.reference(model, WINDOWS, clip=CLIP)
    exact, trainer = S.hf_fit(model, PER_RANK, exact=True, clip=CLIP, fsdp_version=2)
    native, _ = S.hf_fit(model, PER_RANK, exact=False, clip=CLIP, fsdp_version=2)
    if {type(p).__name__ for p in exact.parameters()} != {"DTensor"}:
        return f"FAIL {name}: the parameters are not all sharded by fully_shard"
    return verdict(name, unsharded(exact, model), unsharded(native, model), ref)


def accumulator(family: str, name: str) -> str:
    """Accumulator(DDP(model)) with MoELoss.for_hf_model, against the reference; the native side is
    the model's own loss per micro-batch (its aux term per micro-batch)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = M.moe_model(family)
    ref = MS.reference(model, [[s for per_rank in w for mb in per_rank for s in unpad(mb)] for w in OWN_WINDOWS],
                       clip=CLIP, optimizer=MS.sgd)

    def train(loss) -> torch.nn.Module:
        net = copy.deepcopy(model)
        ddp = DDP(net)
        acc = Accumulator(ddp, MS.sgd(net.parameters())[0], max_grad_norm=CLIP)
        for w in OWN_WINDOWS:
            acc.step(list(w[RANK]), loss(ddp))
        return net

    exact = train(MoELoss.for_hf_model)
    native = train(lambda m: (lambda mm, mb: (mm(**mb).loss, (mb["labels"][:, 1:] != -100).sum())))
    return verdict(name, exact, native, ref)


def trl_sft(family: str, name: str, average_tokens: bool) -> str:
    """ExactSFTTrainer with TRL's aux default: 20 sequences, micro-batches of 2 dealt to the ranks in
    turn, gradient_accumulation_steps=2: windows of 8, 8 and 4 sequences over both ranks, against SFT's
    own compute_loss over each window as one batch (float64 fused-head stand-in on both sides)."""
    from trl import SFTTrainer

    from gradaccum.integrations.trl import ExactSFTTrainer

    import trl_data as T

    model, examples, config = M.moe_model(family), T.sft_examples(20), {"average_tokens_across_devices": average_tokens}
    with T.float64_log_probs():
        ref = T.reference(SFTTrainer, model, examples, window=8, **config)
        exact, _ = T.fit(ExactSFTTrainer, model, examples, **config)
        native, _ = T.fit(SFTTrainer, model, examples, **config)
    return verdict(name, exact, native, ref)


def accumulator_fsdp2(family: str, name: str) -> str:
    """Accumulator over a model sharded by FSDP2 (each decoder layer, then the root) with MoELoss: the
    ranks' uneven micro-batch counts (3 against 2) pad the counting pass too, since every forward
    all-gathers the shards. Shards gathered before the comparison."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = M.moe_model(family)
    ref = MS.reference(model, [[s for per_rank in w for mb in per_rank for s in unpad(mb)] for w in OWN_WINDOWS],
                       clip=CLIP, optimizer=MS.sgd)
    mesh = init_device_mesh("cpu", (WORLD,))

    def train(loss) -> torch.nn.Module:
        net = copy.deepcopy(model)
        for layer in [m for m in net.modules() if type(m).__name__.endswith("DecoderLayer")]:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        acc = Accumulator(net, MS.sgd(net.parameters())[0], max_grad_norm=CLIP)
        for w in OWN_WINDOWS:
            acc.step(list(w[RANK]), loss(net))
        return unsharded(net, model)

    exact = train(MoELoss.for_hf_model)
    native = train(lambda m: (lambda mm, mb: (mm(**mb).loss, (mb["labels"][:, 1:] != -100).sum())))
    return verdict(name, exact, native, ref)


def accumulator_train_uneven(family: str, name: str) -> str:
    """Accumulator(DDP(model)).train with MoELoss over uneven loaders, accum_steps=2: rank 0 holds 7
    micro-batches (windows of 2, 2, 2 and 1), rank 1 holds 3 (2, then 1, then none: it pads the last
    two windows with zero-weight forwards of its last micro-batch). Against the union of each window."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    loaders = {0: S.rank_micro_batches(0, [2, 1, 3, 1, 2, 2, 1], seed=11), 1: S.rank_micro_batches(1, [3, 1, 2], seed=11)}
    windows = [[s for r in range(WORLD) for mb in loaders[r][w * 2:(w + 1) * 2] for s in unpad(mb)] for w in range(4)]
    model = M.moe_model(family)
    ref = MS.reference(model, windows, clip=CLIP, optimizer=MS.sgd)

    def train(loss) -> torch.nn.Module:
        net = copy.deepcopy(model)
        ddp = DDP(net)
        acc = Accumulator(ddp, MS.sgd(net.parameters())[0], max_grad_norm=CLIP)
        steps = [r.step for r in acc.train(loaders[RANK], loss(ddp), accum_steps=2)]
        assert steps == [1, 2, 3, 4], steps
        return net

    exact = train(MoELoss.for_hf_model)
    native = train(lambda m: (lambda mm, mb: (mm(**mb).loss, (mb["labels"][:, 1:] != -100).sum())))
    return verdict(name, exact, native, ref)


SCENARIOS: Dict[str, Callable[[], str]] = {
    "accumulator_fsdp2_mixtral_clipped": lambda: accumulator_fsdp2("mixtral", "accumulator_fsdp2_mixtral_clipped"),
    "accumulator_train_uneven_ranks_olmoe": lambda: accumulator_train_uneven("olmoe", "accumulator_train_uneven_ranks_olmoe"),
    "hf_fsdp2_mixtral_clipped": lambda: hf_fsdp2("mixtral", "hf_fsdp2_mixtral_clipped"),
    "trl_sft_ddp_olmoe_average_tokens": lambda: trl_sft("olmoe", "trl_sft_ddp_olmoe_average_tokens", True),
    **{f"hf_ddp_{f}_clipped": (lambda f=f: hf(f, f"hf_ddp_{f}_clipped")) for f in M.FAMILIES},
    **{f"accumulator_ddp_{f}_clipped": (lambda f=f: accumulator(f, f"accumulator_ddp_{f}_clipped"))
       for f in ("qwen2_moe",)},
}


def scenario_context():
    """The models' load-balancing loss with its float32 islands in float64, on both sides."""
    return M.float64_balance_loss()


if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
