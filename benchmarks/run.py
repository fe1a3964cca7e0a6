"""gradaccum benchmarks (`make bench`): writes docs/benchmarks.md, .json and .png from one run
(`BENCH_QUICK=1`: runs/bench-quick/ instead, so a smoke run never replaces the committed figures).

    make bench                       # the whole run, a few minutes on 2 cores
    BENCH_QUICK=1 make bench         # a smoke run of every section, about a minute

Sections: overhead against the hand loop and Accelerate, and a profile of it (overhead.py);
distributed under torchrun (distributed.py, dist_bench.py, dist_window_cost.py, count_first.py); memory measured by PeakMeter and what
measuring costs (memory_bench.py); transformers, speed and distance from one big batch
(transformer.py); accumulation against one big batch, numerics, the floor (scaling.py); a loss that
couples the window's items, WindowLoss against the big batch and sentence-transformers (contrastive.py); an
MoE router's load-balancing term per mode against the big batch, written into docs/guides/moe.md (moe.py); TRL's
GRPO and RLOO per loss type and setting, stock and exact, written into docs/guides/trl.md (grpo.py); the
same on CUDA in its own process when a GPU is there (cuda_bench.py); each stack's own accumulation against
ours (stacks.py); bf16 parameters' accumulation and DeepSpeed per ZeRO stage, written into
docs/guides/deepspeed.md (precision.py); a pipeline schedule under PipelineWindow against the stock one, time
and collectives per window (pipeline.py). report.py writes the page.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict

# torch 2.13's profiler prints "profiler_start"/"profiler_stop" on every region PeakMeter measures
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

from common import QUICK, ROOT, machine, mlp  # noqa: E402

DOCS = ROOT / "docs"


def _cuda() -> Any:
    """Section 8 in a process of its own (Accelerate's state is process-wide); None without a GPU."""
    if not torch.cuda.is_available():
        return None
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_bench.py")], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=1200)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main() -> None:
    torch.set_num_threads(1)  # every figure with one thread: comparable, and less noise on a shared machine
    where = ROOT / "runs" / "bench-quick" if QUICK else DOCS
    where.mkdir(parents=True, exist_ok=True)
    from contrastive import contrastive, st_losses, write_st_table
    from contrastive import write_guide as write_contrastive_guide
    from distributed import count_first, distributed, window_cost
    from grpo import grpo
    from grpo import write_guide as write_grpo_guide
    from memory_bench import memory, meter_cost
    from moe import moe, write_guide
    from overhead import overhead, profile
    from pipeline import pipeline
    from precision import precision, write_guide as write_precision
    from scaling import bandwidth, numerics, throughput
    from stacks import stacks
    from transformer import transformer

    results: Dict[str, Any] = {"quick": QUICK, "machine": machine(), "durations_s": {},
                               "mlp_params": sum(p.numel() for p in mlp().parameters())}
    started = time.time()
    sections: Dict[str, Callable[[], Any]] = {
        "overhead": overhead, "profile": profile, "memory": memory, "meter_cost": meter_cost,
        "transformer": transformer, "distributed": distributed, "window_cost": window_cost,
        "count_first": count_first,
        "throughput": throughput, "contrastive": contrastive, "st_losses": st_losses, "moe": moe, "grpo": grpo,
        "numerics": numerics, "bandwidth_Bps": bandwidth, "cuda": _cuda, "stacks": stacks,
        "precision": precision, "pipeline": pipeline}
    only = [n for n in os.environ.get("BENCH_ONLY", "").split(",") if n]
    if only:  # these sections again, into the page's stored figures (each marked as measured alone)
        unknown = sorted(set(only) - set(sections))
        if unknown:
            sys.exit(f"BENCH_ONLY names no section {unknown}; the sections: {', '.join(sections)}")
        stored = json.loads((where / "benchmarks.json").read_text())
        stored["durations_s"] = dict(stored.get("durations_s", {}))
        results, sections = stored, {n: sections[n] for n in only}
    for name, fn in sections.items():
        t0 = time.time()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        results[name] = fn()
        results["durations_s"][name] = time.time() - t0
        if only and isinstance(results[name], dict):
            results[name]["measured_alone"] = f"BENCH_ONLY={','.join(only)} make bench, {time.strftime('%Y-%m-%d')}"
    if not only:
        results["total_s"] = time.time() - started

    from report import plot, render
    plot(results, where / "benchmarks.png")
    doc = render(results)
    (where / "benchmarks.md").write_text(doc)
    (where / "benchmarks.json").write_text(json.dumps(results, indent=2) + "\n")
    # the MoE section's table lives in its guide (a quick run writes it beside the other figures)
    write_guide(results["moe"], where / "moe.md" if QUICK else ROOT / "docs" / "guides" / "moe.md")
    # WindowLoss's time and memory per kept graph: the contrastive guide's table
    write_contrastive_guide(results["contrastive"], where / "contrastive.md" if QUICK else ROOT / "docs" / "guides" / "contrastive.md")
    # GRPO/RLOO's stock-vs-exact tables live in the TRL guide
    write_grpo_guide(results["grpo"], where / "trl.md" if QUICK else ROOT / "docs" / "guides" / "trl.md")
    # bf16 accumulation and DeepSpeed per ZeRO stage: the tables of the DeepSpeed guide
    write_precision(results["precision"], where / "deepspeed.md" if QUICK else DOCS / "guides" / "deepspeed.md")
    if not QUICK:  # the sentence-transformers guide's per-loss table
        write_st_table(results["st_losses"], DOCS / "guides" / "sentence-transformers.md")
    print(doc)
    print(f"[bench] {results['total_s']:.0f} s; wrote {where.relative_to(ROOT)}/benchmarks.md, .json, .png",
          file=sys.stderr)


if __name__ == "__main__":
    main()
