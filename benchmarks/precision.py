"""bf16 parameters and DeepSpeed (section "precision", written into docs/guides/deepspeed.md).

Two tables, each from the code the tests assert on, so the guide quotes what ``make test`` checks:

- **bf16**: relative L2 error of the window gradient the optimizer is handed, from the float64 big
  batch, on a bf16 GPT-2 built from a config (tests/test_precision.py: :func:`bf16_errors`), for K = 16
  and 64 micro-batches: the floor, the plain loop, the ``Accumulator`` default (float32 buffers) and its
  opt-out (``accum_dtype="param"``); and the peak memory of one window with and without the buffers
  (PeakMeter, :func:`accumulation_memory`).
- **DeepSpeed**: Δ per ZeRO stage, through the ``Accumulator`` and ``ExactTrainer``, from one torchrun
  launch of tests/distributed/deepspeed_worker.py (2 gloo processes, ``DS_ACCELERATOR=cpu``), parsed from
  the figures its scenarios print.

    PYTHONPATH=src:tests python benchmarks/precision.py     # prints both tables
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

from common import ROOT, between_markers, torchrun

sys.path[:0] = [str(ROOT / "tests")]

START, END = "<!-- bench:precision -->", "<!-- /bench:precision -->"
DS_START, DS_END = "<!-- bench:deepspeed -->", "<!-- /bench:deepspeed -->"
HF_START, HF_END = "<!-- bench:deepspeed-trainer -->", "<!-- /bench:deepspeed-trainer -->"
TRL_START, TRL_END = "<!-- bench:deepspeed-trl -->", "<!-- /bench:deepspeed-trl -->"
_TRL = re.compile(r"(SFT|DPO) \(ZeRO-(\d)\) (\S+?)(?:,|$)")
_FIGURES = re.compile(r"stage (\d): Accumulator delta (\S+) .*Accumulator (\S+), DeepSpeed's own loop (\S+); "
                      r"without W (\S+)")
_TRAINER = re.compile(r"stage (\d) (\S+?)[,\s]")
_TRAINER_FREE = re.compile(r"unclipped, stage 2: ExactTrainer (\S+), stock Trainer (\S+)$")


def bf16() -> Dict[str, Any]:
    from test_precision import accumulation_memory, bf16_errors

    with torch.random.fork_rng():
        torch.set_num_threads(1)
        return {"errors": {str(k): bf16_errors(k) for k in (16, 64)}, "memory": accumulation_memory()}


def deepspeed_table() -> Dict[str, Any]:
    """Each stage's figures from one launch of the worker the tests run; empty without DeepSpeed."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {}
    proc = torchrun(ROOT / "tests" / "distributed" / "deepspeed_worker.py", "zero1_exact", "zero2_exact",
                    "zero3_exact", "exact_trainer_stages", "exact_trl_trainers", timeout=900)
    rows: Dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        m = _FIGURES.search(line)
        if line.startswith("PASS") and m:
            rows[m.group(1)] = {"accumulator": float(m.group(2)), "equal_accumulator": float(m.group(3)),
                                "stock": float(m.group(4)), "without_w": float(m.group(5))}
        if line.startswith("PASS exact_trainer_stages"):
            clipped, _, free = line.partition("(clipped)")
            rows["trainer"] = {stage: float(d) for stage, d in _TRAINER.findall(clipped)}
            f = _TRAINER_FREE.search(free.strip())
            if f:
                rows["trainer_free"] = {"exact": float(f.group(1)), "stock": float(f.group(2))}
        if line.startswith("PASS exact_trl_trainers"):
            rows["trl"] = {name: (stage, float(d)) for name, stage, d in _TRL.findall(line)}
    return rows


def precision() -> Dict[str, Any]:
    return {"bf16": bf16(), "deepspeed": deepspeed_table()}


def render_bf16(r: Dict[str, Any]) -> str:
    e, mem = r["errors"], r["memory"]
    lines = ["| K | floor: each micro-batch's bf16 gradient summed exactly, rounded once | plain `(S_k / N).backward()` "
             "| `Accumulator` default (float32 buffers) | `Accumulator(accum_dtype=\"param\")` |", "|---|---|---|---|---|"]
    for k, row in e.items():
        lines.append(f"| {k} | {row['floor']:.2e} | {row['plain']:.2e} | {row['default']:.2e} | {row['param']:.2e} |")
    lines += ["", f"Peak memory of one window of 8 micro-batches (PeakMeter, CPU; the parameters are "
              f"{mem['param_bytes']:,} bytes in bf16): {mem['default']:,} bytes with the float32 buffers, "
              f"{mem['param']:,} bytes without (+{mem['default'] - mem['param']:,} bytes, "
              f"{(mem['default'] - mem['param']) / mem['param_bytes']:.2f}x the bf16 parameters)."]
    return "\n".join(lines) + "\n"


def render_deepspeed(rows: Dict[str, Any]) -> str:
    if not rows:
        return "(DeepSpeed is not installed where this ran: `pip install -e '.[test]'`.)\n"
    lines = ["| ZeRO stage | `Accumulator`: uneven ranks, short and empty windows, clipped | `Accumulator`, equal-count "
             "windows | DeepSpeed's own loop, same windows | the caller-owned boundary without W |",
             "|---|---|---|---|---|"]
    for stage, row in sorted(rows.items()):
        lines.append(f"| {stage} | {row['accumulator']:.1e} | {row['equal_accumulator']:.1e} | {row['stock']:.1e} "
                     f"| {row['without_w']:.1e} |")
    return "\n".join(lines) + "\n"


def render_trainer(rows: Dict[str, Any]) -> str:
    if "trainer" not in rows:
        return "(DeepSpeed is not installed where this ran: `pip install -e '.[test]'`.)\n"
    free = rows.get("trainer_free", {})
    lines = ["| ZeRO stage | `ExactTrainer`, clip engaged on every step | `ExactTrainer`, unclipped | stock Trainer, "
             "unclipped |", "|---|---|---|---|"]
    for stage, d in sorted(rows["trainer"].items()):
        extra = f"{free['exact']:.1e} | {free['stock']:.1e}" if stage == "2" and free else " | "
        lines.append(f"| {stage} | {d:.1e} | {extra} |")
    return "\n".join(lines) + "\n"


def render_trl(rows: Dict[str, Any]) -> str:
    if "trl" not in rows:
        return "(DeepSpeed is not installed where this ran: `pip install -e '.[test]'`.)\n"
    lines = ["| TRL trainer | ZeRO stage | Δ from TRL's loss over one big batch |", "|---|---|---|"]
    lines += [f"| {name} | {stage} | {d:.1e} |" for name, (stage, d) in rows["trl"].items()]
    return "\n".join(lines) + "\n"


def write_guide(r: Dict[str, Any], path: Path) -> None:
    """Both tables between their markers in the guide (a path without the markers gets them alone)."""
    text = path.read_text() if path.exists() else ""
    stages = {k: v for k, v in r["deepspeed"].items() if k.isdigit()}
    for start, end, body in ((START, END, render_bf16(r["bf16"])), (DS_START, DS_END, render_deepspeed(stages)),
                             (HF_START, HF_END, render_trainer(r["deepspeed"])),
                             (TRL_START, TRL_END, render_trl(r["deepspeed"]))):
        text = between_markers(text, start, end, body)
    path.write_text(text)


if __name__ == "__main__":
    result = precision()
    print(render_bf16(result["bf16"]))
    print(render_deepspeed({k: v for k, v in result["deepspeed"].items() if k.isdigit()}))
    print(render_trainer(result["deepspeed"]))
    print(render_trl(result["deepspeed"]))
