"""Each stack's own gradient accumulation against ours (section 9): Δ = the largest parameter
difference from one float64 big batch per window, on the data and references the tests use
(tests/integrations: scenarios.py, heads.py, trl_data.py), so the table measures what they assert.

Rows: the Hugging Face Trainer on every head (GPT-2 as a config builds it, Llama behind a forward
without ``**kwargs``, BERT sequence classification single-label / regression / multi-label, token
classification) with windows of 3, 3 and 1 micro-batches; the step the stock Trainer takes on
sequence classification with ``gradient_accumulation_steps=4`` relative to one big batch's; TRL's
SFTTrainer (padded, padding-free, packed) and DPOTrainer, with TRL's own fused LM-head kernel (it
accumulates in float32 and, under TRL's default ``bf16=True``, projects in bf16 even for a float64
model: the "exact" rows show that kernel's rounding, and the float64-kernel rows show the weighting).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, List

import torch

from common import ROOT

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integrations")]


def _step_ratio(model: Any, micro: List[Dict[str, torch.Tensor]]) -> float:
    """||stock Trainer's first update|| / ||one big batch's|| with 4 equal micro-batches per window
    (SGD's first step is lr * grad, so this is the ratio of the gradients)."""
    from integrations import heads as H
    from integrations import scenarios as S

    def moved(trained: Any) -> float:
        return torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(trained.parameters(), model.parameters()))).item()

    def sgd(params: Any) -> tuple:
        opt = torch.optim.SGD(params, lr=0.1)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    for mb in micro:  # every label counted, so that each micro-batch's mean is over as many items
        mb["labels"] = mb["labels"].clamp(min=0)
    ref = H.reference(model, micro[:4], accum=4, optimizer=sgd)
    stock, _ = S.hf_fit(model, [micro[:4]], exact=False, accum=4, optimizer=sgd)
    return moved(stock) / moved(ref)


def stacks() -> List[Dict[str, Any]]:
    try:
        import trl  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return []
    from trl import DPOTrainer, SFTTrainer

    from gradaccum.integrations.trl import ExactDPOTrainer, ExactSFTTrainer
    from hf_helpers import gpt2, llama
    from integrations import heads as H
    from integrations import scenarios as S
    from integrations import trl_data as T

    S.quiet()
    rows: List[Dict[str, Any]] = []
    micro = S.rank_micro_batches(0, S.SIZES[0])
    windows = S.windows_of([micro], S.ACCUM)
    for case, make, head in (("causal LM: GPT-2 as built (loss_type None)", lambda: S.stock(gpt2()), None),
                             ("causal LM: Llama, forward without **kwargs", lambda: S.PlainForward(llama()), "causal_lm")):
        model = make()
        ref = S.reference(model, windows)
        rows.append({"stack": "HF Trainer", "case": case,
                     "stock": S.max_diff(S.hf_fit(model, [micro], exact=False)[0], ref),
                     "exact": S.max_diff(S.hf_fit(model, [micro], exact=True, head=head)[0], ref)})
    for kind, case in (("single_label", "sequence classification"), ("regression", "regression (num_labels=1)"),
                       ("multi_label", "multi-label classification"), ("token", "token classification")):
        model, batches = H.bert(kind), H.micro_batches(kind, S.SIZES[0])
        ref = H.reference(model, batches)
        row = {"stack": "HF Trainer", "case": case,
               "stock": S.max_diff(S.hf_fit(model, [batches], exact=False)[0], ref),
               "exact": S.max_diff(S.hf_fit(model, [batches], exact=True)[0], ref)}
        if kind == "single_label":
            row["stock_step_ratio_k4"] = _step_ratio(model, H.micro_batches(kind, [2, 2, 2, 2]))
        rows.append(row)
    sft_cases = {"padded": {}, "padding-free": {"padding_free": True},
                 "packed": {"packing": True, "max_length": 40, "per_device_train_batch_size": 1}}
    for kernel in ("TRL's kernel", "float64 kernel"):
        swap = T.float64_log_probs() if kernel == "float64 kernel" else contextlib.nullcontext()
        with swap:
            for case, config in sft_cases.items():
                model, examples = S.stock(gpt2()), T.sft_examples(10)
                ref = T.reference(SFTTrainer, model, examples, 2 * config.get("per_device_train_batch_size", 2), **config)
                rows.append({"stack": "TRL SFTTrainer", "case": f"{case}, GPT-2 as built ({kernel})",
                             "stock": S.max_diff(T.fit(SFTTrainer, model, examples, **config)[0], ref),
                             "exact": S.max_diff(T.fit(ExactSFTTrainer, model, examples, **config)[0], ref)})
            model, pairs = llama(), T.dpo_examples(19)
            ref = T.reference(DPOTrainer, model, pairs, window=4)
            rows.append({"stack": "TRL DPOTrainer", "case": f"19 pairs, last window 2 + 1 ({kernel})",
                         "stock": S.max_diff(T.fit(DPOTrainer, model, pairs)[0], ref),
                         "exact": S.max_diff(T.fit(ExactDPOTrainer, model, pairs)[0], ref)})
    rows.extend(_two_processes())
    return rows


#: torchrun scenarios of tests/integrations/hf_worker.py reported here: (stack, case)
TWO_PROCESS = {
    "hf_ddp_llama_plain_forward_clipped": ("HF Trainer", "2 processes: Llama, forward without **kwargs, clipped"),
    "trl_sft_ddp_average_tokens_gpt2": ("TRL SFTTrainer", "2 processes, average_tokens_across_devices=True (float64 kernel)"),
    "trl_sft_ddp_local_tokens_llama": ("TRL SFTTrainer", "2 processes, average_tokens_across_devices=False, Llama (float64 kernel)"),
    "trl_dpo_ddp": ("TRL DPOTrainer", "2 processes, 20 pairs (float64 kernel)"),
}


def _two_processes() -> List[Dict[str, Any]]:
    """The torchrun scenarios' figures (2 gloo processes): ``delta integration X, native Y``."""
    import importlib.util
    import re

    # tests/distributed/launch.py by its path: benchmarks/distributed.py holds the name "distributed"
    spec = importlib.util.spec_from_file_location("_launch", ROOT / "tests" / "distributed" / "launch.py")
    launch = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(launch)  # type: ignore[union-attr]
    proc = launch.torchrun([str(ROOT / "tests" / "integrations" / "hf_worker.py"), *TWO_PROCESS], timeout=900)
    rows = []
    for line in proc.stdout.splitlines():
        found = re.match(r"(PASS|FAIL) (\w+): .*delta integration ([0-9.e+-]+), native ([0-9.e+-]+)", line)
        if found and found.group(2) in TWO_PROCESS:
            stack, case = TWO_PROCESS[found.group(2)]
            rows.append({"stack": stack, "case": case, "stock": float(found.group(4)),
                         "exact": float(found.group(3)), "passed": found.group(1) == "PASS"})
    return rows
