"""Section: TRL's GRPO and RLOO against one big batch per optimizer step (docs/guides/trl.md).

Δ = the largest parameter difference after one epoch from the independent float64 reference
(tests/integrations/grpo_runs.py: one plain SGD step per optimizer step on the loss type's formula over
the step's whole batch), for stock TRL and for ExactGRPOTrainer / ExactRLOOTrainer, each against the
reference built from its own run's micro-batches. A tiny float64 Llama from a config, completions of
1-8 tokens fixed by replacing generation, 4 prompts x 4 generations, micro-batches of 2 sequences;
per loss type and setting on one process, and the torchrun scenarios of grpo_worker.py (2 gloo
processes, 8 prompts, uneven tokens per rank) as they print. ``make bench`` writes the tables into
the guide between its markers (:func:`write_guide`); ``python benchmarks/grpo.py`` prints them.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Dict, List

from common import QUICK, ROOT, between_markers, table, torchrun

sys.path[:0] = [str(ROOT / "tests")]

START, END = "<!-- grpo table: make bench writes it -->", "<!-- /grpo table -->"
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "sapo", "luspo", "cispo", "vespo")


#: the row of an MoE model whose router loss TRL turns on (a tiny Qwen3-MoE; 3 prompts: steps of 4 and 2
#: micro-batches)
MOE_ROW = "spg 2, GA 4, MoE router loss"


def _settings() -> Dict[str, Dict[str, Any]]:
    from integrations import grpo_runs as G

    out: Dict[str, Dict[str, Any]] = {name: dict(s) for name, s in G.SETTINGS.items()}
    out["GA 3, spg 2, short last step"] = dict(G.SHORT_LAST)
    out["spg 4, GA 2, KL + entropy bonus"] = dict(G.SETTINGS["spg 4, GA 2"], beta=0.04, entropy_coef=0.05)
    out[MOE_ROW] = dict(G.SETTINGS["spg 2, GA 4"], prompt_count=3)
    return out


def one_process() -> List[Dict[str, Any]]:
    """Per setting, per loss type: (stock Δ, exact Δ), and RLOO's."""
    from trl import GRPOTrainer, RLOOTrainer

    from gradaccum.integrations.trl import ExactGRPOTrainer, ExactRLOOTrainer
    from integrations import grpo_runs as G
    from integrations.trl_data import float64_log_probs

    from integrations.moe_models import moe_model

    llama, rows = G.base_model(), []
    settings = _settings()
    with float64_log_probs():
        for name, config in (list(settings.items())[:2] if QUICK else settings.items()):
            row: Dict[str, Any] = {"setting": name}
            model = moe_model("qwen3_moe") if name == MOE_ROW else llama
            for loss_type in (LOSS_TYPES[:2] if QUICK else LOSS_TYPES):
                stock, exact, _ = G.run_pair(GRPOTrainer, ExactGRPOTrainer, model, loss_type, **config)
                row[loss_type] = (stock, exact)
            rloo = {k: v for k, v in config.items() if k != "entropy_coef"}  # RLOO has no entropy bonus
            if name == MOE_ROW:
                rloo["beta"] = 0.0  # RLOO's default KL term would load its reference model from a folder
            row["rloo"] = G.run_pair(RLOOTrainer, ExactRLOOTrainer, model, "rloo", rloo=True, **rloo)[:2]
            rows.append(row)
    return rows


def two_processes() -> List[str]:
    """The worker's ``PASS``/``FAIL`` lines (one torchrun launch, 2 gloo processes)."""
    proc = torchrun(ROOT / "tests" / "integrations" / "grpo_worker.py", timeout=900)  # it sets its own path
    return [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]


def grpo() -> Dict[str, Any]:
    return {"one_process": one_process(), "two_processes": [] if QUICK else two_processes()}


def render(r: Dict[str, Any]) -> str:
    columns = [c for c in ("setting",) + LOSS_TYPES + ("rloo",) if any(c in row for row in r["one_process"])]
    cells = [{c: (row[c] if c == "setting" else f"{row[c][0]:.1e} / {row[c][1]:.1e}") for c in columns if c in row}
             for row in r["one_process"]]
    out = ["One process, Δ stock / exact (`per_device_train_batch_size=2`, `num_generations=4`; GA = "
           "`gradient_accumulation_steps`, spg = `steps_per_generation`):", "",
           table(cells, columns, headers={c: f"`{c}`" for c in columns if c != "setting"}), ""]
    if r["two_processes"]:
        out += ["Two processes (DDP, gloo; one loss type per divisor TRL writes, `sapo` and `luspo` sharing `grpo`'s, "
                "`cispo` and `vespo` `dapo`'s; `spg 4, GA 2` with `beta=0.04`, `entropy_coef=0.05`, or GA 3, spg 2 "
                "with a short last step; `moe`: a tiny Qwen3-MoE with its router loss, `spg 4, GA 2` with "
                "`entropy_coef=0.05`, or RLOO with a short last step), as `tests/integrations/grpo_worker.py` "
                "prints them:", "", "```"]
        out += [re.sub(r"; tokens per step and rank .*", "", line) for line in r["two_processes"]] + ["```", ""]
    return "\n".join(out)


def write_guide(r: Dict[str, Any], path: Path) -> None:
    """The guide's tables between its markers, from this run (a path without the markers gets them alone)."""
    path.write_text(between_markers(path.read_text() if path.exists() else "", START, END, render(r)))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    result = grpo()
    print(render(result))
    if "--write" in sys.argv:
        write_guide(result, ROOT / "docs" / "guides" / "trl.md")
