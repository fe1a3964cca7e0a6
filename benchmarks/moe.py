"""Section: a mixture-of-experts model's load-balancing term under accumulation (docs/guides/moe.md).

Two measurements, written into the guide's table by ``make bench`` (:func:`write_guide`):

* **Distance from one big batch**, per family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE built from
  configs: hidden 16, 2 layers, 4 experts, top-2, ``router_aux_loss_coef=0.2``, float64): one window of
  4 padded micro-batches of uneven sizes, one SGD step at lr 1 (so the parameters move by the
  gradient) through the stock Hugging Face Trainer, ExactTrainer and ``Accumulator`` in each mode, the largest parameter difference from the big batch's step on the model's own loss
  (``model(**batch).loss``). transformers' float32 islands (the load-balancing sums, the token loss's
  ``.float()``) are swapped for the same formulas in float64 on both sides, except in the column
  "exact, float32 islands", which keeps transformers' own.
* **Time per window** of each mode on a larger float32 Mixtral (hidden 64, 4 layers, 8 experts,
  top-2), with a vocabulary of 512 (the trunk is most of a window's work, as in large MoEs) and of
  8192 (the LM head and the loss weigh more): a window of 4 micro-batches of 8 sequences of 64
  tokens, ``Accumulator.step`` with SGD; the median over rotated repeats of this thread's CPU time
  (one thread), and each mode's median paired ratio to plain accumulation (the model's own loss per
  micro-batch). The exact mode's extra cost is one forward of the trunk per micro-batch.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import torch

from common import QUICK, between_markers, median, paired_ratio, side_by_side, table

from gradaccum import Accumulator, MoELoss

FAMILIES = {
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral", dict(num_local_experts=4)),
    "Qwen2-MoE": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       decoder_sparse_step=1)),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe",
                  dict(num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1, head_dim=8)),
    "OLMoE": ("OlmoeConfig", "OlmoeForCausalLM", "olmoe", dict(num_experts=4)),
}
VOCAB = 50
REPEATS = 3 if QUICK else 9


def _model(family: str, *, hidden: int = 16, layers: int = 2, experts: int = 4, vocab: int = VOCAB,
           dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    import transformers

    config_name, model_name, _, extra = FAMILIES[family]
    extra = {k: (experts if k in ("num_local_experts", "num_experts") else v) for k, v in extra.items()}
    config = getattr(transformers, config_name)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, use_cache=False, output_router_logits=True, router_aux_loss_coef=0.2,
        num_experts_per_tok=2, **extra)
    config._experts_implementation = "eager"  # transformers' grouped-mm kernel takes no float64
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).train()
    model.loss_type = "ForCausalLM"
    return model


def _pad(seqs: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)], labels[i, :len(s)] = s, 1, s
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _window(sizes: List[int], lo: int, hi: int, vocab: int, seed: int) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(1, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g) for _ in range(n)]
            for n in sizes]


def _own_loss(model: Any, mb: Dict[str, torch.Tensor]) -> Any:
    """The model's own loss on one micro-batch (its aux term per micro-batch), weighted by its targets."""
    return model(**mb).loss, (mb["labels"][:, 1:] != -100).sum()


def _float64(fn: Callable[..., Any]) -> Callable[..., Any]:
    source = inspect.getsource(fn).replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    namespace = dict(fn.__globals__)
    exec(compile(source, f"<float64 {fn.__name__}>", "exec"), namespace)
    return namespace[fn.__name__]


@contextlib.contextmanager
def _float64_islands() -> Iterator[None]:
    from transformers.loss.loss_utils import LOSS_MAPPING

    modules = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for _, _, m, _ in FAMILIES.values()]
    kept, causal = [m.load_balancing_loss_func for m in modules], LOSS_MAPPING["ForCausalLM"]
    try:
        for m, fn in zip(modules, kept):
            m.load_balancing_loss_func = _float64(fn)
        LOSS_MAPPING["ForCausalLM"] = _float64(causal)
        yield
    finally:
        for m, fn in zip(modules, kept):
            m.load_balancing_loss_func = fn
        LOSS_MAPPING["ForCausalLM"] = causal


MODES: Dict[str, Callable[[Any], Any]] = {
    "per micro-batch (model's own loss)": lambda m: _own_loss,
    "MoELoss micro_batch": lambda m: MoELoss.for_hf_model(m, mode="micro_batch"),
    "MoELoss prefix": lambda m: MoELoss.for_hf_model(m, mode="prefix"),
    "MoELoss exact": lambda m: MoELoss.for_hf_model(m),
}


def _step(model: Any, window: List[Dict[str, torch.Tensor]], loss: Any) -> Any:
    model = copy.deepcopy(model)
    Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0)).step(list(window), loss(model))
    return model


def _trainer_step(model: Any, window: List[Dict[str, torch.Tensor]], exact: bool) -> Any:
    """One window through the Hugging Face Trainer (stock) or ExactTrainer: one pre-padded micro-batch per
    dataset item, SGD at lr 1, no clipping."""
    import tempfile

    import transformers
    from transformers import Trainer, TrainingArguments

    from gradaccum.integrations.hf_trainer import ExactTrainer

    transformers.logging.set_verbosity_error()
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="gradaccum-moe-"), per_device_train_batch_size=1,
                             gradient_accumulation_steps=len(window), max_steps=1, max_grad_norm=0.0, report_to="none",
                             use_cpu=True, disable_tqdm=True, train_sampling_strategy="sequential",
                             remove_unused_columns=False, save_strategy="no", logging_strategy="no",
                             dataloader_num_workers=0)
    trainer = (ExactTrainer if exact else Trainer)(
        model=model, args=args, train_dataset=list(window), data_collator=lambda items: items[0],
        optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)))
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    return model


def _big_batch(model: Any, window: List[List[torch.Tensor]]) -> Any:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(**_pad([s for mb in window for s in mb])).loss.backward()
    opt.step()
    return model


def _delta(a: Any, b: Any) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def distances() -> List[Dict[str, Any]]:
    """Each family's largest parameter difference from the big batch's step, per mode."""
    seqs = _window([2, 3, 1, 2], 3, 31, VOCAB, seed=0)
    window = [_pad(mb) for mb in seqs]
    rows = []
    for family in FAMILIES:
        model = _model(family)
        with _float64_islands():
            ref = _big_batch(model, seqs)
            row: Dict[str, Any] = {"family": family}
            row.update({mode: _delta(_step(model, window, make), ref) for mode, make in MODES.items()})
            row.update({"stock Trainer": _delta(_trainer_step(model, window, False), ref),
                        "ExactTrainer": _delta(_trainer_step(model, window, True), ref)})
        row["MoELoss exact, float32 islands"] = _delta(_step(model, window, MODES["MoELoss exact"]),
                                                       _big_batch(model, seqs))
        rows.append(row)
    return rows


def times(vocab: int = 512) -> Dict[str, Any]:
    """Seconds per window of each mode and of the big batch on a float32 Mixtral; ratios to plain."""
    model = _model("Mixtral", hidden=64, layers=4, experts=8, vocab=vocab, dtype=torch.float32)
    seqs = _window([8, 8, 8, 8], 64, 65, vocab, seed=1)
    window = [_pad(mb) for mb in seqs]
    big = _pad([s for mb in seqs for s in mb])
    nets = {name: copy.deepcopy(model) for name in list(MODES) + ["big batch"]}
    accs = {name: Accumulator(net, torch.optim.SGD(net.parameters(), lr=1e-4)) for name, net in nets.items()}
    losses = {name: make(nets[name]) for name, make in MODES.items()}
    fns: Dict[str, Callable[[], object]] = {name: (lambda n=name: accs[n].step(list(window), losses[n]))
                                            for name in MODES}
    fns["big batch"] = lambda: accs["big batch"].step([big], _own_loss)
    samples = side_by_side(fns, REPEATS)
    base = "per micro-batch (model's own loss)"
    return {"seconds": {k: median(v) for k, v in samples.items()},
            "ratio_to_plain": {k: paired_ratio(samples, k, base) for k in samples},
            "setup": f"float32 Mixtral, hidden 64, 4 layers, 8 experts, top-2, vocabulary {vocab}; 4 micro-batches "
                     "of 8 x 64 tokens"}


TOPICS, WINDOWS = 4, (20 if QUICK else 120)


def _topic_batch(topic: int, n: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    """``n`` sequences of 16 tokens from topic ``topic``'s 12 words (ids 1 + 12 t .. 12 + 12 t)."""
    return _pad([torch.randint(1 + 12 * topic, 13 + 12 * topic, (16,), generator=g) for _ in range(n)])


def expert_shares() -> Dict[str, Any]:
    """A float32 Mixtral (hidden 32, 2 layers, 8 experts, top-2, coef 0.2) trained from the same start on
    windows of 4 micro-batches, each micro-batch one topic's sequences: with the balance per micro-batch
    (``mode="micro_batch"``: every topic must spread over every expert) or over the window (exact: the
    window must be balanced, each topic need not). Then each expert's share of each topic's routed tokens
    (top-2 choices, pooled over the layers) on fresh sequences."""
    from gradaccum._maths import router_statistics

    start = _model("Mixtral", hidden=32, experts=8, dtype=torch.float32, seed=3)
    out: Dict[str, Any] = {}
    for mode in ("micro_batch", "exact"):
        model = copy.deepcopy(start)
        acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        loss = MoELoss.for_hf_model(model, mode=mode)
        g = torch.Generator().manual_seed(0)
        for _ in range(WINDOWS):
            acc.step([_topic_batch(t, 4, g) for t in range(TOPICS)], loss)
        shares = []
        with torch.no_grad():
            for t in range(TOPICS):
                batch = _topic_batch(t, 16, torch.Generator().manual_seed(100 + t))
                logits = model(**{k: v for k, v in batch.items() if k != "labels"}).router_logits
                counts = router_statistics(logits, 2, batch["attention_mask"].reshape(-1))[0]
                shares.append((counts / counts.sum()).tolist())
        out[mode] = shares
    return out


def window_shares(per_topic: List[List[float]]) -> List[float]:
    """Each expert's share of the whole window's routed tokens: the topics' shares averaged (every
    topic's evaluation batch routes as many tokens, 16 sequences of 16)."""
    return [sum(col) / len(per_topic) for col in zip(*per_topic)]


def share_summary(shares: Dict[str, Any]) -> Dict[str, Any]:
    """What the figure shows, in numbers: per mode, how many experts each topic uses (share >= 5 %),
    how many topic-expert shares are below 1 %, and the range of the experts' shares of the window."""
    out = {}
    for mode, per_topic in shares.items():
        used = [sum(share >= 0.05 for share in topic) for topic in per_topic]
        window = window_shares(per_topic)
        out[mode] = {"experts": len(per_topic[0]), "pairs": len(per_topic) * len(per_topic[0]),
                     "used_min": min(used), "used_max": max(used),
                     "near_zero": sum(share < 0.01 for topic in per_topic for share in topic),
                     "window_min": min(window), "window_max": max(window)}
    return out


def plot_shares(shares: Dict[str, Any], path: Path) -> None:
    """Left and middle: each topic's share of each expert, balanced per micro-batch and over the window;
    right: each expert's share of the whole window in both modes. The dashed line is 1/E (every expert
    equally loaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True, gridspec_kw={"width_ratios": [2, 2, 1.4]})
    titles = {"micro_batch": "each topic, balanced per micro-batch", "exact": "each topic, balanced over the window"}
    experts = len(next(iter(shares.values()))[0])
    even = 1 / experts
    colours = plt.get_cmap("tab10").colors
    for ax, (mode, per_topic) in zip(axes, shares.items()):
        width = 0.8 / len(per_topic)
        for t, share in enumerate(per_topic):
            ax.bar([e + (t - (len(per_topic) - 1) / 2) * width for e in range(experts)], share, width,
                   label=f"topic {t}", color=colours[t])
        ax.set_title(titles[mode], fontsize=10)
    window_ax = axes[2]
    for i, (mode, per_topic) in enumerate(shares.items()):
        window_ax.bar([e + (i - 0.5) * 0.4 for e in range(experts)], window_shares(per_topic), 0.4,
                      color=("0.65", "0.2")[i], label={"micro_batch": "per micro-batch", "exact": "over the window"}[mode])
    window_ax.set_title("each expert's share of the whole window", fontsize=10)
    for ax in axes:
        ax.axhline(even, color="k", lw=0.9, ls="--", label=f"1/E = {even:.3f} (even load)")
        ax.set_xlabel("expert")
        ax.set_xticks(range(experts))
    axes[0].set_ylabel("share of the routed tokens")
    axes[1].legend(fontsize=8, loc="upper right")
    window_ax.legend(fontsize=8, loc="upper right", title="balanced", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def moe() -> Dict[str, Any]:
    # the trunk's share of a window sets what the counting pass costs: a small vocabulary (the trunk is
    # most of the work, as in large MoEs) and a larger one (the LM head and the loss weigh more)
    return {"distances": distances(), "times": [times(512), times(8192)], "expert_shares": expert_shares()}


ACCUMULATOR = ["family"] + list(MODES)
TRAINERS = ["family", "stock Trainer", "ExactTrainer", "MoELoss exact, float32 islands"]


def render(r: Dict[str, Any]) -> str:
    """The guide's measured section: the distances in two tables (the Accumulator's modes; the Trainers
    and transformers' own float32 islands), the times, and what the expert-share figure shows."""
    fmt = {c: ".1e" for c in ACCUMULATOR[1:] + TRAINERS[1:]}
    out = ["Largest parameter difference from one big batch's step (SGD, lr 1) on the model's own loss, one "
           "window of 4 padded micro-batches (2, 3, 1, 2 sequences), coef 0.2, float64. The `Accumulator`:", "",
           table(r["distances"], ACCUMULATOR, fmt), "",
           "The Hugging Face Trainer, and `MoELoss` exact with transformers' own float32 load-balancing sums "
           "and token loss (the other columns swap them for float64 on both sides):", "",
           table(r["distances"], TRAINERS, fmt), ""]
    times = r["times"] if isinstance(r["times"], list) else [r["times"]]
    for t in times:
        rows = [{"mode": k, "ms per window": 1e3 * s, "x plain": t["ratio_to_plain"][k]["ratio"],
                 "IQR": f"{t['ratio_to_plain'][k]['q1']:.2f}-{t['ratio_to_plain'][k]['q3']:.2f}"}
                for k, s in t["seconds"].items()]
        out += [f"Time per window ({t['setup']}; median of {REPEATS} rotated repeats, one thread):", "",
                table(rows, ["mode", "ms per window", "x plain", "IQR"], {"ms per window": ".1f", "x plain": ".2f"}), ""]
    exact = [(t["setup"].split("vocabulary ")[1].split(";")[0], t["ratio_to_plain"]["MoELoss exact"]["ratio"])
             for t in times]
    cheap = [t["ratio_to_plain"][m]["ratio"] for t in times for m in ("MoELoss micro_batch", "MoELoss prefix")]
    costs = [f"{x:.2f}x" + (" plain accumulation" if i == 0 else "") + f" with a vocabulary of {v}"
             for i, (v, x) in enumerate(exact)]
    out += ["The exact mode costs one forward of the trunk per micro-batch without a graph (no LM head, no loss, "
            f"no autograd record): {' and '.join(costs)} in this run. How much that is depends on the trunk's "
            "share of a window: the smaller the vocabulary, the more of the work is the trunk (as in large MoEs, "
            "whose experts dwarf the LM head). The cheaper modes cost "
            f"{min(cheap):.2f}x to {max(cheap):.2f}x plain accumulation.", ""]
    if "expert_shares" in r:
        n = share_summary(r["expert_shares"])
        mb, ex = n["micro_batch"], n["exact"]
        out += ["Each expert's share of each topic's routed tokens after training a tiny Mixtral (8 experts, top-2, "
                f"coef 0.2) on {WINDOWS} windows of 4 micro-batches, one topic per micro-batch, from the same start "
                "(`expert_shares` in `benchmarks/moe.py`):", "",
                "![Each expert's share of each topic's routed tokens, balanced per micro-batch (left) and over the "
                "window (middle), and each expert's share of the whole window (right); the dashed line is 1/E]"
                "(moe_expert_share.png)", "",
                f"*Balanced per micro-batch (left), each topic uses {mb['used_min']} to {mb['used_max']} of the "
                f"{mb['experts']} experts (a share of 5 % or more), yet {mb['near_zero']} of the {mb['pairs']} "
                "topic-expert shares are below 1 %: the balance term is a penalty weighed against the token loss, not "
                "a constraint, so it pushes each topic toward every expert without getting it there. Balanced over "
                f"the window (middle), each topic concentrates on {ex['used_min']} to {ex['used_max']} experts and "
                f"{ex['near_zero']} shares are below 1 %: the experts specialize by topic. What the balance is for, "
                "the load of the whole window (right), is what the exact mode balances: each expert takes "
                f"{100 * ex['window_min']:.1f} % to {100 * ex['window_max']:.1f} % of the window's tokens with the "
                f"balance over the window, {100 * mb['window_min']:.1f} % to {100 * mb['window_max']:.1f} % with "
                f"the balance per micro-batch, against 1/E = {100 / ex['experts']:.1f} % (dashed).*", ""]
    return "\n".join(out)


START, END = "<!-- bench:moe -->", "<!-- /bench:moe -->"


def write_guide(r: Dict[str, Any], path: Path) -> None:
    """The guide's table between its markers, from this run (a path without the markers gets the table
    alone), and the expert-share plot beside it (``moe_expert_share.png``)."""
    if "expert_shares" in r:
        plot_shares(r["expert_shares"], path.parent / "moe_expert_share.png")
    path.write_text(between_markers(path.read_text() if path.exists() else "", START, END, render(r)))


if __name__ == "__main__":
    import json
    import sys

    torch.set_num_threads(1)
    result = moe()
    print(render(result))
    plot_shares(result["expert_shares"], Path("/tmp/moe_expert_share.png"))
    json.dump(result, sys.stderr, indent=1)
