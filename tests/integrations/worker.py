"""Lightning and the HF Trainer under torchrun, 2 gloo processes on the CPU (see test_distributed.py).

Each scenario trains on every rank's own micro-batches (scenarios.SIZES: uneven sizes, padded
sequences, a short last window), builds the float64 reference from the union of both ranks' windows
on every rank, and prints on rank 0 ``PASS <name>: <numbers>`` or ``FAIL <name>: <why>``. The replicas
are compared bit for bit after gathering. Data placement: Lightning gets ``use_distributed_sampler=False``
and each rank its own DataLoader; the HF Trainer one dataset interleaving both ranks' lists (length a
multiple of 2, so its sampler neither pads nor duplicates).
"""
from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # scenarios, hf_helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import scenarios as S  # noqa: E402
from hf_helpers import gpt2, llama  # noqa: E402

torch.set_num_threads(1)
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
PER_RANK = [S.rank_micro_batches(r, S.SIZES[r]) for r in range(WORLD)]
WINDOWS = S.windows_of(PER_RANK, S.ACCUM)
CLIP = 0.05


def identical_replicas(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], other) for other in every[1:])


def verdict(name: str, exact, native, ref, extra: str = "") -> str:
    problems = []
    if not identical_replicas(exact):
        problems.append("replicas differ")
    mismatch = S.params_close(exact, ref)
    if mismatch:
        problems.append(f"integration != reference: {mismatch}")
    d_exact, d_native = S.max_diff(exact, ref), S.max_diff(native, ref)
    if d_native <= 1e-6:
        problems.append(f"native accumulation is not measurably wrong (delta {d_native:.2e})")
    numbers = f"delta integration {d_exact:.2e}, native {d_native:.2e}{extra}"
    return f"FAIL {name}: {'; '.join(problems)} ({numbers})" if problems else f"PASS {name}: {numbers}"


def lightning(make: Callable, name: str) -> str:
    model = make()
    ref = S.reference(model, WINDOWS, clip=CLIP)
    lit, trainer, cb = S.lightning_fit(model, PER_RANK[RANK], exact=True, clip=CLIP, world=WORLD)
    nat, _, _ = S.lightning_fit(model, PER_RANK[RANK], exact=False, clip=CLIP, world=WORLD)
    steps = len(WINDOWS)
    if trainer.global_step != steps:
        return f"FAIL {name}: global_step {trainer.global_step} != {steps} windows"
    return verdict(name, lit.model, nat.model, ref, f", last window N={cb.last_window_items:.0f}")


def hf(make: Callable, name: str, clip=CLIP, head=None) -> str:
    model = make()
    ref = S.reference(model, WINDOWS, clip=clip)
    exact, trainer = S.hf_fit(model, PER_RANK, exact=True, clip=clip, head=head)
    native, _ = S.hf_fit(model, PER_RANK, exact=False, clip=clip)
    if trainer.state.global_step != len(WINDOWS):
        return f"FAIL {name}: global_step {trainer.state.global_step} != {len(WINDOWS)} windows"
    return verdict(name, exact, native, ref, f", last window N={trainer.last_window_items}")


SCENARIOS: Dict[str, Callable[[], str]] = {
    "lightning_ddp_gpt2_clipped": lambda: lightning(gpt2, "lightning_ddp_gpt2_clipped"),
    "lightning_ddp_llama_float64_norm_clipped": lambda: lightning(lambda: S.float64_rmsnorm(llama()),
                                                                  "lightning_ddp_llama_float64_norm_clipped"),
    # not clipped: an engaged clip rescales the stock Trainer's uniform GPT-2 error away
    "hf_ddp_gpt2_stock_loss_type": lambda: hf(lambda: S.stock(gpt2()), "hf_ddp_gpt2_stock_loss_type", clip=None),
    "hf_ddp_llama_plain_forward_clipped": lambda: hf(lambda: S.PlainForward(llama()),
                                                     "hf_ddp_llama_plain_forward_clipped", head="causal_lm"),
}


def main(names: List[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for name in names or list(SCENARIOS):
        try:
            line = SCENARIOS[name]()
        except Exception:  # noqa: BLE001 - report and go on to the next scenario
            line = f"FAIL {name}: {traceback.format_exc()[-1500:]}"
        if RANK == 0:
            print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
