"""Lightning and the HF Trainer (DDP and FSDP2) under torchrun, 2 gloo processes on the CPU (see
test_distributed.py).

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
from pathlib import Path
from typing import Callable, Dict

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # scenarios, trl_data, hf_helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import scenarios as S  # noqa: E402
from distributed.launch import run_modules  # noqa: E402
from gradaccum import causal_lm_loss  # noqa: E402
from hf_helpers import gpt2, llama, pad, unpad  # noqa: E402

torch.set_num_threads(1)
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
PER_RANK = [S.rank_micro_batches(r, S.SIZES[r]) for r in range(WORLD)]
WINDOWS = S.windows_of(PER_RANK, S.ACCUM)
# an evaluation set: as many rows per batch on every rank (the Trainer gathers its evaluation batches,
# which needs equal shapes), padded lengths that differ
EVAL = [S.rank_micro_batches(r, [2, 1, 3], seed=1) for r in range(WORLD)]
CLIP = 0.05


def identical_replicas(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], other) for other in every[1:])


def verdict(name: str, exact, native, ref, extra: str = "", native_off: bool = True) -> str:
    """PASS when the replicas are bit-identical and the integration equals the reference; the native
    accumulation must be off by more than 1e-6 unless ``native_off`` is False (a case it gets right)."""
    problems = []
    if not identical_replicas(exact):
        problems.append("replicas differ")
    mismatch = S.params_close(exact, ref)
    if mismatch:
        problems.append(f"integration != reference: {mismatch}")
    d_exact, d_native = S.max_diff(exact, ref), S.max_diff(native, ref)
    if native_off and d_native <= 1e-6:
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


def lightning_ddp_padded_labels_on_one_rank(name: str) -> str:
    """``ExactAccumulation()`` counting rows, ``training_step`` a bare mean over targets: rank 0's micro-batches
    are padded (labels -100), rank 1's one sequence each (none padded). The flag rides in the boundary's
    all-reduce of the count, so both ranks refuse at the first window's boundary, before its step (a rank-local
    check left rank 1 waiting in that all-reduce)."""
    from gradaccum import NotExactError
    from gradaccum.integrations.lightning import ExactAccumulation

    mine = PER_RANK[0][:2] if RANK == 0 else [S.rank_micro_batches(1, [1])[0]] * 2
    assert bool((mine[0]["labels"] == -100).any()) == (RANK == 0)
    try:
        S.lightning_fit(gpt2(), mine, exact=False, accum=2, world=WORLD, callbacks=[ExactAccumulation()])
    except NotExactError as e:
        assert "training_step returned a bare mean loss" in str(e), e
        return f"PASS {name}: refused on rank {RANK} too"
    return f"FAIL {name}: rank {RANK} took the window"


def lightning_fsdp2(make: Callable, name: str) -> str:
    """Lightning's ModelParallelStrategy with FSDP2 (``fully_shard`` per block and on the root, every
    rank data-parallel): each rank holds a shard, so the parameters are gathered into plain copies
    of the model before they are compared with the reference."""
    model = make()
    ref = S.reference(model, WINDOWS, clip=CLIP)
    lit, trainer, cb = S.lightning_fit(model, PER_RANK[RANK], exact=True, clip=CLIP, world=WORLD, fsdp2=True)
    nat, _, _ = S.lightning_fit(model, PER_RANK[RANK], exact=False, clip=CLIP, world=WORLD, fsdp2=True)
    if trainer.global_step != len(WINDOWS):
        return f"FAIL {name}: global_step {trainer.global_step} != {len(WINDOWS)} windows"
    sharded = [type(p).__name__ for p in lit.model.parameters()]
    if set(sharded) != {"DTensor"}:
        return f"FAIL {name}: the parameters are not all sharded by fully_shard ({sorted(set(sharded))})"
    return verdict(name, unsharded(lit.model, model), unsharded(nat.model, model), ref,
                   f", last window N={cb.last_window_items:.0f}")


def lightning_zero_item_windows(name: str) -> str:
    """scenarios.masked_batches under DDP: window 1 counts 0 items on both ranks (skipped: no AdamW
    step, no scheduler step, global_step not advanced), window 2 on rank 0 only (it steps on rank 1's
    items). Lightning's own accumulation steps on every window."""
    per_rank = [S.masked_batches(r) for r in range(WORLD)]
    ref = S.masked_reference(per_rank)
    exact, trainer, cb = S.masked_fit(per_rank[RANK], exact=True, world=WORLD)
    native, _, _ = S.masked_fit(per_rank[RANK], exact=False, world=WORLD)
    lr_steps = trainer.lr_scheduler_configs[0].scheduler.last_epoch
    if (trainer.global_step, cb.skipped, lr_steps) != (2, 1, 2):
        return (f"FAIL {name}: global_step {trainer.global_step}, skipped {cb.skipped}, scheduler steps "
                f"{lr_steps}; expected 2, 1, 2")
    return verdict(name, exact, native, ref, f", last window N={cb.last_window_items:.0f}")


def unsharded(sharded, template):
    """A plain copy of ``template`` holding ``sharded``'s full parameters (gathered from every rank)."""
    import copy

    plain = copy.deepcopy(template)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), sharded.parameters()):
            p.copy_(q.full_tensor())
    return plain


def hf(make: Callable, name: str, clip=CLIP, head=None) -> str:
    model = make()
    ref = S.reference(model, WINDOWS, clip=clip)
    exact, trainer = S.hf_fit(model, PER_RANK, exact=True, clip=clip, head=head)
    native, _ = S.hf_fit(model, PER_RANK, exact=False, clip=clip)
    if trainer.state.global_step != len(WINDOWS):
        return f"FAIL {name}: global_step {trainer.state.global_step} != {len(WINDOWS)} windows"
    return verdict(name, exact, native, ref, f", last window N={trainer.last_window_items}")


def hf_fsdp2(make: Callable, name: str, head=None) -> str:
    """The Trainer with ``fsdp_config={"fsdp_version": 2}`` through Accelerate (scenarios.fsdp_on_cpu):
    every block then the root ``fully_shard``-ed, the clip engaged on the sharded gradients. The
    shards are gathered into plain copies before the comparison. Then ``eval_loss`` evaluated by the
    sharded model over EVAL: the mean over every target of the set (rtol 1e-12), which the Trainer's
    mean of batch means is not."""
    model = make()
    ref = S.reference(model, WINDOWS, clip=CLIP)
    exact, trainer = S.hf_fit(model, PER_RANK, exact=True, clip=CLIP, head=head, fsdp_version=2,
                              per_device_eval_batch_size=1)
    native, _ = S.hf_fit(model, PER_RANK, exact=False, clip=CLIP, fsdp_version=2)
    if trainer.state.global_step != len(WINDOWS):
        return f"FAIL {name}: global_step {trainer.state.global_step} != {len(WINDOWS)} windows"
    sharded = {type(p).__name__ for p in exact.parameters()}
    if sharded != {"DTensor"}:
        return f"FAIL {name}: the parameters are not all sharded by fully_shard ({sorted(sharded)})"
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    if not all(n > 2 * CLIP for n in norms):
        return f"FAIL {name}: the clip did not engage on every step (pre-clip norms {norms})"
    plain, plain_native = unsharded(exact, model), unsharded(native, model)
    evaluated = trainer.evaluate(S.ListDataset(S.interleaved(EVAL)))["eval_loss"]
    every = pad([s for mbs in EVAL for mb in mbs for s in unpad(mb)])
    with torch.no_grad():
        mean = causal_lm_loss(S.lm_logits(plain, every), every["labels"])[0].item()
        batch_means = [(causal_lm_loss(S.lm_logits(plain, mb), mb["labels"])[0].item(), len(mb["input_ids"]))
                       for mbs in EVAL for mb in mbs]
    trainers_mean = sum(m * n for m, n in batch_means) / sum(n for _, n in batch_means)
    if abs(evaluated - mean) > 1e-12 * abs(mean) or abs(trainers_mean - mean) < 1e-6:
        return (f"FAIL {name}: eval_loss {evaluated!r}, the mean over every target {mean!r} (the Trainer's mean of "
                f"batch means {trainers_mean!r})")
    return verdict(name, plain, plain_native, ref,
                   f", eval_loss {evaluated:.6f}, last window N={trainer.last_window_items}")


# micro-batches whose every label is -100, per rank (accumulation 3, windows of 3, 3 and 2): window 1
# holds no target on either rank (skipped), window 2 none on rank 0 (it steps on rank 1's targets)
MASKED = {0: {3, 4, 5, 6, 7}, 1: {3, 4, 5}}


def hf_fsdp2_zero_item_windows(name: str) -> str:
    """The skipped window under FSDP2 (GPT-2 as a config builds it, AdamW with weight decay): every rank
    reads the same all-reduced N = 0, so all run the window's forwards and backwards (FSDP2's
    collectives stay matched) and none steps: no AdamW step (weight decay would move the weights), no
    scheduler step, global_step not advanced. The stock Trainer steps on it (or divides by 0)."""
    per_rank = [S.rank_micro_batches(r, S.SIZES[r] + [2]) for r in range(WORLD)]
    for r, empty in MASKED.items():
        for k in empty:
            per_rank[r][k]["labels"] = torch.full_like(per_rank[r][k]["labels"], -100)
    windows = S.stepped_windows(per_rank, S.ACCUM)
    assert len(windows) == 2, "the data leaves windows 0 and 2 to step"
    model = S.stock(gpt2())
    ref = S.reference(model, windows, optimizer=S.adamw)
    exact, trainer = S.hf_fit(model, per_rank, exact=True, optimizer=S.adamw, fsdp_version=2)
    native, _ = S.hf_fit(model, per_rank, exact=False, optimizer=S.adamw, fsdp_version=2)
    counts = (trainer.state.global_step, trainer.skipped, trainer.lr_scheduler.last_epoch)
    if counts != (2, 1, 2):
        return f"FAIL {name}: global_step, windows skipped, scheduler steps {counts}; expected (2, 1, 2)"
    return verdict(name, unsharded(exact, model), unsharded(native, model), ref,
                   f", last window N={trainer.last_window_items}")


def trl_sft(make: Callable, name: str, average_tokens: bool) -> str:
    """20 sequences, micro-batches of 2 dealt to the ranks in turn, gradient_accumulation_steps=2: windows
    of 8, 8 and 4 sequences over both ranks."""
    from trl import SFTTrainer

    from gradaccum.integrations.trl import ExactSFTTrainer

    import trl_data as T

    model, examples, config = make(), T.sft_examples(20), {"average_tokens_across_devices": average_tokens}
    with T.float64_log_probs():
        ref = T.reference(SFTTrainer, model, examples, window=8, **config)
        exact, trainer = T.fit(ExactSFTTrainer, model, examples, **config)
        native, _ = T.fit(SFTTrainer, model, examples, **config)
    return verdict(name, exact, native, ref, f", last window N={trainer.last_window_items}")


def trl_dpo(name: str) -> str:
    """20 pairs, micro-batches of 2 dealt to the ranks in turn, gradient_accumulation_steps=2: windows
    of 8, 8 and 4 pairs over both ranks. Every micro-batch holds 2 pairs (TRL gathers its metrics with
    equal shapes on every rank, so a shorter one would hang it), which stock DPO weighs right too: this
    scenario checks the ranks' factor W; test_trl.py has the short micro-batch stock DPO gets wrong."""
    from trl import DPOTrainer

    from gradaccum.integrations.trl import ExactDPOTrainer

    import trl_data as T

    model, pairs = llama(), T.dpo_examples(20)
    with T.float64_log_probs():
        ref = T.reference(DPOTrainer, model, pairs, window=8)
        exact, trainer = T.fit(ExactDPOTrainer, model, pairs)
        native, _ = T.fit(DPOTrainer, model, pairs)
    return verdict(name, exact, native, ref, f", last window pairs={trainer.last_window_items}", native_off=False)


SCENARIOS: Dict[str, Callable[[], str]] = {
    "lightning_ddp_gpt2_clipped": lambda: lightning(gpt2, "lightning_ddp_gpt2_clipped"),
    "lightning_ddp_llama_float64_norm_clipped": lambda: lightning(lambda: S.float64_rmsnorm(llama()),
                                                                  "lightning_ddp_llama_float64_norm_clipped"),
    "lightning_fsdp2_gpt2_clipped": lambda: lightning_fsdp2(gpt2, "lightning_fsdp2_gpt2_clipped"),
    "lightning_ddp_zero_item_windows": lambda: lightning_zero_item_windows("lightning_ddp_zero_item_windows"),
    "lightning_ddp_padded_labels_on_one_rank": lambda: lightning_ddp_padded_labels_on_one_rank(
        "lightning_ddp_padded_labels_on_one_rank"),
    # not clipped: an engaged clip rescales the stock Trainer's uniform GPT-2 error away
    "hf_ddp_gpt2_stock_loss_type": lambda: hf(lambda: S.stock(gpt2()), "hf_ddp_gpt2_stock_loss_type", clip=None),
    "hf_ddp_llama_plain_forward_clipped": lambda: hf(lambda: S.PlainForward(llama()),
                                                     "hf_ddp_llama_plain_forward_clipped", head="causal_lm"),
    "hf_fsdp2_llama_plain_forward_clipped": lambda: hf_fsdp2(lambda: S.PlainForward(llama()),
                                                             "hf_fsdp2_llama_plain_forward_clipped", head="causal_lm"),
    "hf_fsdp2_zero_item_windows": lambda: hf_fsdp2_zero_item_windows("hf_fsdp2_zero_item_windows"),
    # TRL (TRL's fused LM head with a float64 stand-in on both sides, as in test_trl.py)
    "trl_sft_ddp_average_tokens_gpt2": lambda: trl_sft(lambda: S.stock(gpt2()), "trl_sft_ddp_average_tokens_gpt2", True),
    "trl_sft_ddp_local_tokens_llama": lambda: trl_sft(llama, "trl_sft_ddp_local_tokens_llama", False),
    "trl_dpo_ddp": lambda: trl_dpo("trl_dpo_ddp"),
}


if __name__ == "__main__":
    run_modules([sys.modules[__name__]], sys.argv[1:])
