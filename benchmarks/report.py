"""docs/benchmarks.md and docs/benchmarks.png from the results of one run."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from common import table

Results = Dict[str, Any]


def _f(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _machine_line(r: Results) -> str:
    m = r["machine"]
    gpu = f"CUDA {m['cuda']}" if m["cuda"] else "CPU only"
    return (f"{m['cpu']}, {m['cores']} cores, {gpu}; Python {m['python']}, torch {m['torch']}, "
            f"Accelerate {m['accelerate']}, transformers {m['transformers']}; {m['threads']} thread; "
            f"load average {m.get('load_average_at_start', float('nan')):.2f} at the start")


def overhead_section(r: Results) -> str:
    rows = r["overhead"]
    ms = table(rows, ["micro_batch", "hand_ms", "gradaccum_ms", "hand_clip_ms", "gradaccum_clip_ms", "accelerate_ms"],
               {k: ".2f" for k in ("hand_ms", "gradaccum_ms", "hand_clip_ms", "gradaccum_clip_ms", "accelerate_ms")},
               {"micro_batch": "micro-batch", "hand_ms": "hand loop", "gradaccum_ms": "gradaccum",
                "hand_clip_ms": "hand + clip_grad_norm_", "gradaccum_clip_ms": "gradaccum, max_grad_norm",
                "accelerate_ms": "Accelerate accumulate()"})
    ratio_rows = []
    for row in rows:
        def cell(label: str) -> str:
            if f"{label}_ratio" not in row:
                return "-"
            return f"{row[f'{label}_ratio']:.3f} ({row[f'{label}_q1']:.2f}-{row[f'{label}_q3']:.2f})"
        ratio_rows.append({"micro_batch": row["micro_batch"], "bare": cell("bare"), "goal_bare": f"<= {row['goal_bare']}",
                           "bare_met": row.get("bare_met", "-"), "clip": cell("clip"),
                           "goal_clip": f"<= {row['goal_clip']}", "clip_met": row.get("clip_met", "-"),
                           "accelerate": cell("accelerate"),
                           "vs_acc": _f(row.get("vs_accelerate_ratio"), ".3f")})
    ratios = table(ratio_rows, ["micro_batch", "bare", "goal_bare", "bare_met", "clip", "goal_clip", "clip_met",
                                "accelerate", "vs_acc"], {},
                   {"micro_batch": "micro-batch", "bare": "bare: gradaccum / hand", "goal_bare": "goal",
                    "bare_met": "met", "clip": "clipping: gradaccum / hand + clip", "goal_clip": "goal",
                    "clip_met": "met", "accelerate": "Accelerate / hand", "vs_acc": "gradaccum / Accelerate"})
    p = r["profile"]
    prof_rows = table(p["rows"][:10], ["function", "calls_per_window", "ms_per_window", "calls_outside"],
                      {"calls_per_window": ".0f", "ms_per_window": ".3f"},
                      {"function": "gradaccum function", "calls_per_window": "calls / window",
                       "ms_per_window": "ms / window", "calls_outside": "main calls outside gradaccum (ms / window)"})
    reps = rows[0]["repeats"]
    blocks = " and ".join(f"{x['windows_per_block']} at micro-batch {x['micro_batch']}" for x in rows)
    return f"""## 1. Overhead per window (MLP 784-512-512-10, N = 4, SGD with momentum, one thread)

Five loops side by side in one run, {reps} repeats, the order rotated every repeat; each repeat times
a block of windows ({blocks}). The hand loop is the plain PyTorch accumulation loop: each micro-batch's `loss / N`,
backward, `step()`, `zero_grad()`. Milliseconds per window (medians):

{ms}

Ratios: the median of the per-repeat ratios (each against the baseline timed in the same repeat),
with their interquartile range in brackets. The targets this library holds itself to: bare at most
1.03x the hand loop at micro-batch 8; with clipping at most 1.01x the hand loop plus
`clip_grad_norm_(1.0)`; within 1.02x at micro-batch 256.

{ratios}

### Where gradaccum's extra time goes (cProfile, micro-batch {p['micro_batch']}, {p['windows']} windows)

Each gradaccum function's own Python time plus what it calls outside gradaccum, per window, leaving
out the work the hand loop does as well (the loss, the backward, the optimizer step). cProfile adds
about a microsecond to every Python call, so small frequent calls look dearer than they are; the
order is what to read. Sum: {p['extra_ms_per_window']:.3f} ms per window, in a profiled window of
{p['profiled_window_ms']:.2f} ms; unprofiled, section 1 timed gradaccum's window at
{rows[0]['gradaccum_ms']:.2f} ms and the hand loop's at {rows[0]['hand_ms']:.2f} ms.

{prof_rows}
"""


def distributed_section(r: Results) -> str:
    d = r.get("distributed")
    if not d:
        return "## 2. Distributed\n\nThe torchrun launch failed in this run; its stderr was printed by `make bench`.\n"
    rows = d["rows"]
    floor = [{"N": x["N"], "measured_extra_ms": 1e3 * (x["every_s"] - x["once_s"]),
              "floor_ms": 1e3 * (x["N"] - 1) * d["allreduce_s"]} for x in rows]
    return f"""## 2. Distributed (torchrun --standalone, 2 processes, gloo, MLP of {d['params'] / 1e6:.1f} M parameters, micro-batch 8)

One reduction per window (`no_sync` until the last micro-batch) against reducing after every micro-batch
(`reduce_every_micro_batch=True`). All-reduces and bytes are counted per window by a DDP comm hook.
Goal: one reduction per window, and at least 1.8x at N = 4.

{table(rows, ["N", "once_s", "every_s", "speedup", "once_allreduces", "every_allreduces", "once_bytes", "every_bytes"],
       {"once_s": ".4f", "every_s": ".4f", "speedup": ".2f"})}

Floor: one all-reduce of the whole gradient ({d['params'] * 4 / 2**20:.1f} MiB) takes
{1e3 * d['allreduce_s']:.1f} ms here, so reducing every micro-batch costs at least (N - 1) x that
more per window:

{table(floor, ["N", "measured_extra_ms", "floor_ms"], {"measured_extra_ms": ".1f", "floor_ms": ".1f"})}
"""


def window_cost_section(r: Results) -> str:
    w = r.get("window_cost")
    if not w:
        return "### What a window costs besides DDP's buckets\n\nThe torchrun launch failed in this run.\n"
    return f"""### What a window costs besides DDP's buckets (MLP 784-512-512-10, N = {w['N']}, micro-batch {w['micro_batch']})

Per window in the steady state, the hand loop (`no_sync` on the first N-1 micro-batches, `loss / N`)
against gradaccum's `acc.step`, `acc.train` over a `WindowSampler` and Accelerate's `accumulate()`,
{w['repeats']} rotated repeats of {w['windows']} windows each: collectives issued from Python (DDP's
bucket all-reduces are the same for all), host synchronisations (`Tensor.item/tolist/cpu`; torch's
SGD makes none), the median over repeats of the time against the hand loop in the same repeat
(quartiles beside it), and the largest parameter difference from one float64 step on the union of
both ranks' windows. "the same DataLoader" is
`acc.train` over the hand loop's own `DistributedSampler` loader (no agreement per window; its items
are summed at the boundary). "(the floor)" is the hand loop plus the boundary's all-reduce that
`acc.step` adds: five numbers (the loss sum, the count, three flags) launched after the last forward, read
on the host after the last backward. No design that learns the window's global item count at its end can
cost less, so the gap between it and the hand loop is what that knowledge costs on this machine: `acc.step`
weighs by the last window's N and rescales by `R / N` at the boundary (next section), so that this one
exchange is all it adds. `acc.train` is timed against the hand loop
over a DataLoader with a DistributedSampler, FSDP2's rows against the hand loop that toggles
`set_requires_gradient_sync` (over tensors: FSDP2's `acc.train` also pays its DataLoader), the others
against the hand loop over tensors. Goal: at
most one small collective and one host sync per window at the boundary, none before the first forward,
and `acc.step` within 1.05x of the floor.
{_alone(w)}
{table(w["rows"], ["contender", "collectives", "host_syncs", "time_ratio", "ratio_q1", "ratio_q3", "window_ms",
                   "distance", "extra_latency_us_at_1024"],
       {"collectives": ".3g", "host_syncs": ".2f", "time_ratio": ".3f", "ratio_q1": ".3f", "ratio_q3": ".3f",
        "window_ms": ".2f", "distance": ".1e", "extra_latency_us_at_1024": ".0f"})}

{_against_floor(w["rows"])}

Paper projection to W = 1024 ranks: a small collective is latency-bound, about {w['latency_us_per_hop']:g} us
per log2(W) step of a tree or ring on a cluster (a stated assumption, not measured here), so each one
per window adds about {w['latency_us_per_hop'] * 10:g} us at W = 1024. gradaccum's boundary collective carries
the window's loss and item count (the global mean and the exact normalization), whether every rank
can pad, and a stop request; the hand loop reports no global loss and cannot skip a non-finite
window on every rank alike.
"""


def _against_floor(rows: List[Dict[str, Any]]) -> str:
    """``acc.step``'s time over the floor's, both against the hand loop in the same repeats (the goal: 1.05x)."""
    ratio = {row["contender"]: row.get("time_ratio") for row in rows}
    step, floor = ratio.get("gradaccum acc.step"), ratio.get("hand no_sync loop + one async all-reduce (the floor)")
    if not step or not floor:
        return ""
    return f"`acc.step` against the floor in this run: {step / floor:.3f}x (goal: 1.05x)."


def _alone(section: Dict[str, Any]) -> str:
    """The line a section measured in a run of its own (not this page's ``make bench``) carries."""
    note = section.get("measured_alone")
    return f"\n*Measured alone, not in this page's run: {note}.*\n" if note else ""


def count_first_section(r: Results) -> str:
    c = r.get("count_first")
    if not c:
        return "### Where a window across ranks learns its N\n\nThe torchrun launch failed in this run.\n"
    return f"""### Where a window across ranks learns its N (MLP 784-512-512-10, {c['micro_batches'][0]} and {c['micro_batches'][1]} micro-batches of 3 to 17 items)

Windows uneven across ranks and from one window to the next, so that the boundary always rescales.
`acc.step` weighs every backward by `n_k W / R`, R the last window's N (the same on every rank, saved
with the state), and rescales the reduced gradient by `R / N` at the boundary, whose one all-reduce
brings N: one more rounding of every element where N changed, none where windows repeat their N.
Beside it the same written by hand (the floor of that design, the baseline of the time ratios: median
over {c['repeats']} rotated repeats of {c['windows']} windows, quartiles beside it) and the hand loop
that counts first (N all-reduced before the first backward, then `(mean_k * n_k * W / N).backward()`,
as torchtitan's `train_step`; gradaccum counts first in its first window only, and under DeepSpeed).
Relative L2 distance of the gradient the optimizer receives from the float64 big batch on the union
of both ranks' windows, mean over {c['accuracy_windows']} windows, for float32 and bf16 parameters
(bf16: DDP sums the window in the parameters' dtype).
{_alone(c)}
{table(c["rows"], ["contender", "collectives", "host_syncs", "time_ratio", "ratio_q1", "ratio_q3", "window_ms",
                   "rel_l2_float32", "rel_l2_bfloat16"],
       {"collectives": ".3g", "host_syncs": ".2f", "time_ratio": ".3f", "ratio_q1": ".3f", "ratio_q3": ".3f",
        "window_ms": ".2f", "rel_l2_float32": ".2e", "rel_l2_bfloat16": ".2e"})}
"""


def pipeline_section(r: Results) -> str:
    p = r.get("pipeline")
    if not p:
        return "### Pipeline parallelism\n\nThe torchrun launch failed in this run.\n"
    rows = [{"schedule": name, "stock_ms": 1e3 * v["stock_s"], "gradaccum_ms": 1e3 * v["gradaccum_s"],
             "ratio": v["ratio"]} for name, v in p.items() if isinstance(v, dict)]
    return f"""### Pipeline parallelism (2 gloo processes, an MLP in 2 stages, 4 micro-batches of padded tokens)

`gradaccum.PipelineWindow` against the stock schedule on the same stages (its mean loss, `scale_grads=True`, and
the same clipping, local to each stage), each window timed in turn: median time per window and the ratio. The
window adds {p.get("collectives_per_window", float("nan")):.3g} all-reduce(s) per window over the pipeline group
(the window's N, its micro-batch counts, the global squared norm and the loss, in one), counted. Goal: within
1.05x of the stock schedule.
{_alone(p)}
{table(rows, ["schedule", "stock_ms", "gradaccum_ms", "ratio"], {"stock_ms": ".2f", "gradaccum_ms": ".2f", "ratio": ".3f"})}
"""


def memory_section(r: Results) -> str:
    rows = r["memory"]
    cost = r["meter_cost"]
    worst = max((x["ratio"] for x in rows), default=float("nan"))
    return f"""## 3. Memory, measured (activation-heavy conv net, 28x28 inputs)

Peak bytes the step allocated above what was held before it, measured by
`gradaccum.memory.PeakMeter("cpu")`: the PyTorch profiler's memory events (allocations and frees of
the CPU allocator, no operator events), replayed in time order. The reference is one micro-batch of
m with its gradient buffer: the N = 1 row. Goal: N x m accumulated stays within 1.1x of it for N up
to 16 (worst here: {worst:.3f}x). `estimate` is what `gradaccum train` reported so far (gradients +
the activations one micro-batch saves for backward): it misses the backward's temporaries.

{table(rows, ["micro_batch", "N", "accumulated_MiB", "reference_MiB", "ratio", "met", "one_batch_MiB", "estimate_MiB", "allocations"],
       {"accumulated_MiB": ".2f", "reference_MiB": ".2f", "ratio": ".3f", "one_batch_MiB": ".2f", "estimate_MiB": ".2f"},
       {"micro_batch": "m", "accumulated_MiB": "N x m accumulated, MiB", "reference_MiB": "one micro-batch + grads, MiB",
        "ratio": "ratio (goal <= 1.1)", "one_batch_MiB": "one batch of N x m, MiB", "estimate_MiB": "estimate, MiB",
        "allocations": "allocations"})}

What measuring costs. The meter's own price, from regions that do nothing but allocate and free
1,000 small tensors, side by side with the same loop unmeasured: {cost[0]['start_stop_ms']:.2f} ms to
start and stop, plus {cost[0]['us_per_allocation']:.1f} us per allocation (its free included), most of
it spent collecting the events when the region ends. Then the MLP window of section 1 (N = 4), measured
and not, side by side; `predicted` is start and stop plus the allocations at that price, and the last
column is `torch.profiler.profile(profile_memory=True)`, which records every operator too:

{table(cost, ["micro_batch", "window_ms", "measured_ms", "ratio", "allocations", "predicted_ms", "full_profiler_ratio"],
       {"window_ms": ".2f", "measured_ms": ".2f", "ratio": ".3f", "predicted_ms": ".2f", "full_profiler_ratio": ".3f"},
       {"micro_batch": "micro-batch", "window_ms": "window, ms", "measured_ms": "measured window, ms",
        "ratio": "ratio", "allocations": "allocations", "predicted_ms": "predicted cost, ms",
        "full_profiler_ratio": "full profiler / window"})}

Measure a window now and then (the first windows, or one in a hundred), not every one.
On CUDA the meter reads the caching allocator's own peak
(`torch.cuda.max_memory_allocated`), which costs nothing measurable.
"""


def transformer_section(r: Results) -> str:
    rows = r.get("transformer") or []
    if not rows:
        return "## 4. Transformers\n\nSkipped: transformers or Accelerate is not installed (`pip install -e '.[bench]'`).\n"
    parts = ["""## 4. Transformers on padded variable-length batches: speed and distance from one big batch

The text task's byte sequences (lengths 2 to 64, shuffled), 4 sequences per micro-batch, each
micro-batch padded to its own longest sequence, SGD with momentum, one thread. Speed: target tokens
(not padding) per second, the four methods side by side, the order rotated every repeat; in brackets
the median per-repeat ratio of the window's time to the hand loop's. Distance: after 3 windows from the same
initial weights, `||theta - theta_ref|| / ||theta_ref - theta_0||` against 3 full-batch steps of a
float64 copy (each window one batch); 0 is one big batch exactly, float32 rounding alone about 1e-6.
The hand loop and Accelerate divide each micro-batch's mean loss by N: exact only when every
micro-batch holds as many tokens as the others (the N = 1 rows).
"""]
    for model in dict.fromkeys(x["model"] for x in rows):
        mrows = [x for x in rows if x["model"] == model]
        by_n: Dict[int, Dict[str, Any]] = {}
        for x in mrows:
            cell = by_n.setdefault(x["N"], {"N": x["N"], "padding": f"{100 * x['padding']:.0f}%"})
            cell[x["method"]] = (f"{x['tokens_per_s']:,.0f} ({x['time_vs_hand']:.2f}x) / "
                                 f"{_f(x['distance'], '.1e')}")
        params = mrows[0]["params"]
        parts.append(f"**{model}** ({params / 1e6:.2f} M parameters): tokens/s (time per window / hand loop's) "
                     "/ distance\n\n" + table(
            list(by_n.values()), ["N", "padding", "gradaccum", "hand", "accelerate", "trainer", "trainer-exact",
                                  "lightning", "lightning-exact"], {},
            {"accelerate": "Accelerate accumulate()", "trainer": "HF Trainer", "hand": "hand loop",
             "trainer-exact": "ExactTrainer", "lightning": "Lightning", "lightning-exact": "Lightning + ExactAccumulation"})
            + "\n")
    trainer_gpt2 = [x for x in rows if x["method"] == "trainer" and x["N"] == 1 and "GPT" in x["model"]]
    trainer_tiny = [x for x in rows if x["method"] == "trainer" and x["N"] > 1 and "Tiny" in x["model"]]
    notes = []
    if trainer_tiny and all((x["distance"] or 0) > 1e-3 for x in trainer_tiny):
        notes.append("The Trainer divides by N for the TinyTransformer: its `forward(input_ids, labels)` returns a "
                     "mean loss and takes no `**kwargs`, so the Trainer cannot pass it the window's token count.")
    if trainer_gpt2 and (trainer_gpt2[0]["distance"] or 0) > 1e-3:
        notes.append(
            f"The Trainer is off for GPT-2 at N = 1 too ({trainer_gpt2[0]['distance']:.1e}): it passes GPT-2 the "
            "window's token count, but counts `labels[..., 1:]` (the targets after the causal shift) only when "
            "`model.loss_type` maps to `ForCausalLMLoss`; a `GPT2LMHeadModel` built from a config has "
            f"`loss_type=None` (transformers {r['machine']['transformers']}), so each row's first label is counted "
            "as a target and every step is smaller by about sequences / targets.")
    if notes:
        parts.append("\n".join(notes) + "\n")
    return "\n".join(parts)


def scaling_sections(r: Results) -> str:
    over = r["overhead"]
    bw = r["bandwidth_Bps"]
    params = r["mlp_params"]
    add_floor_ms = 1e3 * 3 * 3 * params * 4 / bw
    return f"""## 5. Accumulation against one big batch, both fitting in memory

{table(r["throughput"], ["model", "N", "micro_batch", "window_ms", "throughput_vs_one_batch"],
       {"window_ms": ".2f", "throughput_vs_one_batch": ".3f"})}

When both fit, accumulation only costs: smaller matrix products use the core less well, and each
micro-batch reads every weight again. Accumulate to fit memory, not for speed.

## 6. Numerics: relative gradient error against float64 (micro-batches of 4 items)

{table(r["numerics"], ["N", "fp32", "bf16", "bf16 + fp32 buffers"], {"fp32": ".2e", "bf16": ".2e", "bf16 + fp32 buffers": ".2e"})}

Plain bf16 accumulation rounds the running sum to 8 bits of mantissa N times, so its error grows with
N; with `accum_dtype=torch.float32` the sum is kept in float32 and rounded once.

## 7. The floor

Memory bandwidth measured here (`a += b` on 128 MiB): {bw / 1e9:.1f} GB/s. Accumulating the MLP of
section 1 ({params / 1e6:.2f} M parameters) over N = 4 needs 3 gradient additions of 3 x 4 bytes per
parameter: {add_floor_ms:.3f} ms per window, against windows of {over[0]['gradaccum_ms']:.2f} ms
(micro-batch {over[0]['micro_batch']}) and {over[-1]['gradaccum_ms']:.2f} ms (micro-batch {over[-1]['micro_batch']}).
"""


def contrastive_section(r: Results) -> str:
    sizes = r.get("contrastive")
    if not sizes:
        return ""
    rows = [{**row, "width": c["hidden"]} for c in sizes for row in c["rows"]]
    cells = table(rows, ["width", "contender", "ms", "time_ratio", "peak_mib", "memory_ratio", "distance"],
                  {"ms": ".1f", "time_ratio": ".2f", "peak_mib": ".1f", "memory_ratio": ".2f", "distance": ".1e"},
                  {"width": "hidden", "contender": "per window", "ms": "ms", "time_ratio": "time / big batch",
                   "peak_mib": "peak MiB", "memory_ratio": "peak / big batch",
                   "distance": "distance from the float64 big batch"})
    c = sizes[0]
    return f"""## 10. WindowLoss: a loss that couples the window's items (in-batch negatives)

One window of {c['pairs']} (anchor, positive) text pairs, micro-batches of {c['micro_batch']} pairs, on a small BERT
sentence-transformers model (2 layers, 64 or 256 wide, sequences of 6 to 32 tokens, dropout on, float32,
one thread) with the multiple-negatives ranking loss (in-batch negatives): the big batch,
`gradaccum.WindowLoss` through `Accumulator.step`, sentence-transformers' own
`CachedMultipleNegativesRankingLoss(mini_batch_size={c['micro_batch']})`, and plain accumulation (another objective),
side by side, {c['repeats']} rotated repeats, each one SGD step. Peak memory by PeakMeter around one window; the
distance is the largest parameter difference from the float64 big batch's step (dropout off), relative
to the largest change that step made.

{cells}

The goal was at most 1.4x the big batch's time and 1.2x its memory. WindowLoss runs one more forward per
micro-batch (pass 1, without a graph), so its time is at least `(2F + B) / (F + B)` of the big batch's:
about 1.33x where the backward costs twice the forward, more where it costs less, as on these small CPU
models (the wider one comes closer). It is on a par with sentence-transformers' own cached loss for
this objective, and it holds one micro-batch's activations instead of the window's. CachedMNRL runs
anchors and positives in separate forwards, so it holds half as many sequences at a time.
"""


def cuda_section(r: Results) -> str:
    c = r.get("cuda")
    if not c:
        return """## 8. CUDA

No GPU was available for this run. When `torch.cuda.is_available()`, `make bench` runs
`benchmarks/cuda_bench.py` in a process of its own: sections 1 and 3 on the GPU (CUDA events,
`PeakMeter("cuda")`, i.e. `torch.cuda.max_memory_allocated`), and the transformers of section 4 in
fp32, fp16 (GradScaler) and bf16 for gradaccum and the hand loop, with each one's peak memory and
distance from a float64 big batch. `python benchmarks/cuda_bench.py --device cpu` checks that code
path on a machine without a GPU.
"""
    prec = table(c["precision"], ["model", "N", "precision", "method", "tokens_per_s", "time_vs_hand", "peak_MiB", "distance"],
                 {"tokens_per_s": ",.0f", "time_vs_hand": ".3f", "peak_MiB": ".1f", "distance": ".1e"})
    over = table(c["overhead"], ["micro_batch", "hand_ms", "gradaccum_ms", "bare_ratio", "clip_ratio", "accelerate_ratio"],
                 {"hand_ms": ".3f", "gradaccum_ms": ".3f", "bare_ratio": ".3f", "clip_ratio": ".3f", "accelerate_ratio": ".3f"})
    mem = table(c["memory"], ["micro_batch", "N", "accumulated_MiB", "reference_MiB", "ratio", "one_batch_MiB"],
                {"accumulated_MiB": ".2f", "reference_MiB": ".2f", "ratio": ".3f", "one_batch_MiB": ".2f"})
    return f"""## 8. CUDA: {c['device']}

Timed with CUDA events; memory from `torch.cuda.max_memory_allocated` (`PeakMeter("cuda")`).

Overhead (section 1 on the GPU):

{over}

Memory (section 3 on the GPU):

{mem}

Precisions (transformers of section 4; peak over one window above the level before it):

{prec}
"""


def stacks_section(r: Results) -> str:
    rows = r.get("stacks") or []
    if not rows:
        return "## 9. Each stack's own accumulation against ours\n\nSkipped: transformers or TRL is not installed.\n"
    ratio = next((x["stock_step_ratio_k4"] for x in rows if "stock_step_ratio_k4" in x), None)
    lines = ["| stack | case | its own accumulation | ours |", "|---|---|---|---|"]
    for x in rows:
        ours = "ExactTrainer" if x["stack"] == "HF Trainer" else "Exact" + x["stack"].split()[-1]
        lines.append(f"| {x['stack']} | {x['case']} | {x['stock']:.1e} | {x['exact']:.1e} ({ours}) |")
    return f"""## 9. Each stack's own accumulation against ours

`benchmarks/stacks.py`: Δ = the largest parameter difference from one float64 big batch per window
(the same step on the window's union as one batch), on the data and references of
`tests/integrations/` (float64 tiny GPT-2, Llama and BERT built from configs; padded micro-batches of
uneven sizes; windows of 3, 3 and 1 micro-batches, SFT of 4, 4 and 2 sequences, DPO of 4 pairs and a
last of 3). TRL's rows with "TRL's kernel" use TRL's fused LM head as shipped: it accumulates in
float32 and, under TRL's default `bf16=True`, projects in bf16 even for a float64 model, so its big
batch is the reference there and ~1e-9 is that kernel's rounding; "float64 kernel" rows swap in a
float64 one on both sides and show the weighting alone. 2-process rows are the torchrun scenarios of
`tests/integrations/hf_worker.py` (2 gloo processes).

{chr(10).join(lines)}

The stock Trainer's step on sequence classification with 4 equal micro-batches per window is
{_f(ratio, '.2f')}x the big batch's: the head's `forward` takes `**kwargs`, so the Trainer neither divides
by the accumulation steps nor passes a count the head uses (it returns a mean). Padding-free and packed
SFT batches carry -100 at every sequence start, which makes the stock count right on one process;
two processes with `average_tokens_across_devices=False` weigh each rank's mean equally, whatever its
tokens. DPO's stock step divides each micro-batch's mean by the micro-batches: the short last window
weighs its pairs 1/4, 1/4 and 1/2 instead of 1/3 each (on 2 processes with equal micro-batches it is
right too).
"""


def render(r: Results) -> str:
    quick = " with `BENCH_QUICK=1` (fewer repeats and sizes: a smoke run, not figures to quote)" if r["quick"] else ""
    durations = ", ".join(f"{k} {v:.0f} s" for k, v in r["durations_s"].items())
    return f"""# Benchmarks

Measured by `make bench`{quick} in {r['total_s']:.0f} s on: {_machine_line(r)}.
{"No GPU was available for this run." if not r['machine']['cuda'] else ""}

Every ratio is against a baseline measured in the same run, with the alternatives side by side and
their order rotated every repeat, so that drift and the position in the sequence hit all alike.
Memory is measured from the allocator (`gradaccum.memory.PeakMeter`), not estimated. A load average
above zero at the start means other work shared the machine: the timings are then noisy, which the
interquartile ranges of section 1 show. `BENCH_QUICK=1 make bench` is a smoke run of every section
(about a minute), written to `runs/bench-quick/` so that it never replaces this page; regenerate this
page without it, on a quiet machine, before quoting it.
Sections took: {durations}.

{overhead_section(r)}
{distributed_section(r)}
{window_cost_section(r)}
{count_first_section(r)}
{pipeline_section(r)}
{memory_section(r)}
{transformer_section(r)}
{scaling_sections(r)}
{cuda_section(r)}
{stacks_section(r)}
{contrastive_section(r)}
![numerics, memory, transformer speed and distance](benchmarks.png)

Raw numbers: `docs/benchmarks.json`.
"""


# one colour and marker per method in every panel (strong colours: the GPT-2 lines used to be drawn at half
# opacity); a model is told apart by its line, solid for TinyTransformer and dashed for GPT-2
METHODS = {"gradaccum": ("#1f4e9c", "o"), "hand": ("#d55e00", "s"), "accelerate": ("#009e73", "^"),
           "trainer": ("#7a2c8f", "D")}
N_LABEL = "micro-batches per window, N"


def _dodge(ns: Sequence[float], k: int, of: int) -> List[float]:
    """N moved by a few percent per method on a log axis, so that methods at the same N (at N = 1 every
    method is one plain batch: the same point) stay visible side by side."""
    return [n * 1.045 ** (k - (of - 1) / 2) for n in ns]


def plot(r: Results, path: Path):
    """The four panels of docs/benchmarks.png from a run's results (``python benchmarks/report.py``
    redraws it from docs/benchmarks.json). Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(12, 8.6))
    num = r["numerics"]
    for label, colour in (("fp32", "#1f4e9c"), ("bf16", "#d55e00"), ("bf16 + fp32 buffers", "#009e73")):
        a.plot([x["N"] for x in num], [x[label] for x in num], marker="o", color=colour, label=label)
    a.set(xscale="log", yscale="log", xlabel=N_LABEL, ylabel="relative gradient error vs float64",
          title="Numerics: accumulated gradient vs float64")
    a.legend(fontsize=8)
    mem = r["memory"]
    for m, colour in zip(sorted({x["micro_batch"] for x in mem}), ("#1f4e9c", "#d55e00", "#009e73")):
        xs = [x for x in mem if x["micro_batch"] == m]
        b.plot([x["N"] for x in xs], [x["accumulated_MiB"] for x in xs], "-o", color=colour,
               label=f"accumulate N x {m}")
        b.plot([x["N"] for x in xs], [x["one_batch_MiB"] for x in xs], "--x", color=colour,
               label=f"one batch of N x {m}")
    b.set(xscale="log", yscale="log", xlabel=N_LABEL + " (of the micro-batch size shown)",
          ylabel="peak MiB (measured)", title="Memory (CPU allocator)")
    b.legend(fontsize=8)
    rows: List[dict] = r.get("transformer") or []
    models = list(dict.fromkeys(x["model"] for x in rows))
    for i, model in enumerate(models):
        for k, (method, (colour, marker)) in enumerate(METHODS.items()):
            xs = [x for x in rows if x["model"] == model and x["method"] == method]
            if not xs:
                continue
            line = "-" if i == 0 else "--"
            face = colour if i == 0 else "white"
            if i == 0:
                c.plot(_dodge([x["N"] for x in xs], k, len(METHODS)), [x["tokens_per_s"] for x in xs], line,
                       marker=marker, color=colour, label=method)
            d.plot(_dodge([x["N"] for x in xs], k, len(METHODS)), [max(x["distance"] or 0, 1e-9) for x in xs],
                   line, marker=marker, color=colour, markerfacecolor=face, label=f"{method}, {model}")
    c.set(xscale="log", xlabel=N_LABEL, ylabel="target tokens / s (higher is faster)",
          title=f"{models[0] if models else 'TinyTransformer'} speed (axis from 0)")
    c.set_ylim(bottom=0, top=1.15 * max((x["tokens_per_s"] for x in rows if x["model"] == models[0]), default=1))
    d.set(xscale="log", yscale="log", xlabel=N_LABEL, ylabel="||θ - θ_big batch|| / ||θ_big batch - θ_0||",
          title="Distance from one big batch after 3 steps\n"
                "(float32 models: gradaccum's ~1e-6 is float32 rounding)")
    if rows:
        c.legend(fontsize=8, loc="lower right")
        d.legend(fontsize=7, loc="center right")
    for ax in (a, b, c, d):
        ax.grid(True, which="major", color="#e0e0e0", lw=0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return fig


if __name__ == "__main__":  # python benchmarks/report.py: redraw docs/benchmarks.png from docs/benchmarks.json
    import json

    docs = Path(__file__).resolve().parents[1] / "docs"
    plot(json.loads((docs / "benchmarks.json").read_text()), docs / "benchmarks.png")
    print(f"wrote {docs / 'benchmarks.png'}")
