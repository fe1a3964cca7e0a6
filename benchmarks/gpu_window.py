"""Issue 48's GPU check: host synchronisations and time per window, GPT-2 small in bf16.

On a GPU, ``python benchmarks/gpu_window.py`` (a few minutes) builds GPT-2 small from its config (124M
parameters, no download), its parameters in bf16, and trains windows of 4 micro-batches of 8 padded
sequences of up to 512 tokens through four loops:

- the hand loop: each micro-batch's ``loss / N`` backpropagated, ``clip_grad_norm_``, one optimizer step (the
  baseline);
- ``acc.step(window, loss_fn, micro_batch_size=8, num_items=...)`` as docs/guides/hf-models.md writes it
  (``causal_lm_loss``, ``count_targets``), the gradient summed in float32 buffers (the default);
- the Hugging Face ``Trainer`` with ``gradient_accumulation_steps=4``, and ``ExactTrainer`` with the same.

Each clips at a norm of 1.0 (the Trainer's default), with AdamW. One GPU: the script makes only device 0 visible
(else the Trainer would wrap the model in DataParallel).

For each it counts the host synchronisations of a steady-state window twice: as CUDA sees them
(``torch.cuda.set_sync_debug_mode("warn")`` warns at every call that waits for the device) and as Python
asks for them (``item``, ``tolist``, ``cpu``, ``float``, ``int``, ``bool`` of a tensor on the device): for the
two loops in one window after a warm-up one, for the Trainers the mean over ``windows - 1`` windows (the
difference from a one-window run, whose start-up both share). It times the windows (synchronized, the median,
relative to the hand loop). It prints one JSON line, then the table docs/measurements.md
quotes.

``--device cpu --tiny`` runs the same code on a tiny GPT-2 on the CPU in seconds
(tests/test_gpu_window_script.py), so that the script a GPU session runs is known to work; its times mean
nothing there, and CUDA's count is None.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from gradaccum import Accumulator, causal_lm_loss, count_targets  # noqa: E402

N, M = 4, 8  # micro-batches per window, sequences per micro-batch


class Syncs:
    """Host synchronisations while active: CUDA's own count (sync debug mode; None off CUDA), and the reads
    Python asks of a tensor on an accelerator (a CPU tensor's are free)."""

    READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host_reads = 0

    def __enter__(self) -> "Syncs":
        self.saved = {name: getattr(torch.Tensor, name) for name in self.READS}
        for name, read in self.saved.items():
            setattr(torch.Tensor, name, self._counted(read))
        self.caught = warnings.catch_warnings(record=True)
        self.seen = self.caught.__enter__()
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _counted(self, read: Callable) -> Callable:
        def counted(tensor: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.host_reads += tensor.device.type != "cpu"
            return read(tensor, *args, **kwargs)
        return counted

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self.caught.__exit__(*exc)
        for name, read in self.saved.items():
            setattr(torch.Tensor, name, read)
        self.device_syncs = sum("synchroniz" in str(w.message) for w in self.seen) if self.cuda else None


def model_and_data(device: torch.device, tiny: bool, windows: int, seed: int = 0):
    """GPT-2 (small, or tiny) in bf16 and ``windows`` windows of ``N * M`` sequences, each padded to the
    longest (right padding: ``attention_mask`` 0, labels -100)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = (GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32) if tiny
           else GPT2Config())  # GPT-2 small: 12 layers, 768 wide, 50257 tokens, 1024 positions
    seq = 16 if tiny else 512
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).to(device, torch.bfloat16)
    model.config.use_cache = False
    data = []
    for _ in range(windows):
        ids = torch.randint(0, cfg.vocab_size, (N * M, seq), device=device)
        lengths = torch.randint(seq // 4, seq + 1, (N * M,), device=device)
        mask = (torch.arange(seq, device=device)[None, :] < lengths[:, None]).long()
        data.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return model, data


def lm_loss(model: torch.nn.Module, mb: Dict[str, torch.Tensor]):
    """The window's exact loss: each micro-batch's mean over its targets, with their count."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return causal_lm_loss(logits, mb["labels"])


def loop_runner(name: str, model: torch.nn.Module) -> Callable[[Dict[str, torch.Tensor]], None]:
    """One window of the hand loop or of ``acc.step``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "acc.step":
        acc = Accumulator(model, opt, max_grad_norm=1.0)
        return lambda batch: acc.step(batch, lm_loss, micro_batch_size=M,
                                      num_items=lambda mb: count_targets(mb["labels"]))

    def hand(batch: Dict[str, torch.Tensor]) -> None:
        for k in range(N):
            mb = {key: v[k * M:(k + 1) * M] for key, v in batch.items()}
            (model(**mb).loss / N).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return hand


def measure_loop(name: str, device: torch.device, tiny: bool, windows: int) -> Dict[str, Optional[float]]:
    model, data = model_and_data(device, tiny, windows + 2)
    run = loop_runner(name, model)
    run(data[0])  # warm-up: the optimizer's state, the buffers, the kernels
    with Syncs(device) as syncs:
        run(data[1])
    seconds = []
    for batch in data[2:]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"device_syncs": syncs.device_syncs, "host_reads": syncs.host_reads, "seconds": statistics.median(seconds)}


def measure_trainer(exact: bool, device: torch.device, tiny: bool, windows: int) -> Dict[str, Optional[float]]:
    """The Trainer over the same windows: syncs per window from the difference between ``windows`` and one
    window's training (the start is in both), time from its step ends (synchronized)."""
    import transformers
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from gradaccum.integrations import ExactTrainer

    transformers.logging.set_verbosity_error()
    model, data = model_and_data(device, tiny, windows)
    rows = [{key: v[i] for key, v in batch.items()} for batch in data for i in range(N * M)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="gradaccum-gpu-"), per_device_train_batch_size=M,
                             gradient_accumulation_steps=N, max_steps=1, max_grad_norm=1.0, report_to="none",
                             save_strategy="no", logging_strategy="no", eval_strategy="no", disable_tqdm=True,
                             use_cpu=device.type == "cpu", dataloader_num_workers=0, dataloader_pin_memory=False,
                             train_sampling_strategy="sequential", remove_unused_columns=False, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ends: List[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
            if device.type == "cuda":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
    trainer = (ExactTrainer if exact else Trainer)(
        model=model, args=args, train_dataset=rows,
        optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1)),
        data_collator=lambda items: {key: torch.stack([it[key] for it in items]) for key in items[0]},
        callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)
    counts = []
    for steps in (1, windows):
        trainer.args.max_steps = steps
        ends.clear()
        with Syncs(device) as syncs:
            trainer.train()
        counts.append(syncs)
    per = windows - 1
    device_syncs = None if counts[0].device_syncs is None else (counts[1].device_syncs - counts[0].device_syncs) / per
    return {"device_syncs": device_syncs, "host_reads": (counts[1].host_reads - counts[0].host_reads) / per,
            "seconds": statistics.median(b - a for a, b in zip(ends, ends[1:]))}


def table(results: Dict[str, Dict[str, Optional[float]]]) -> str:
    lines = ["| loop | host syncs per window (CUDA) | host reads per window (Python) "
             "| time per window vs the hand loop |",
             "|---|---|---|---|"]
    hand = results["hand loop"]["seconds"]
    for name, r in results.items():
        cuda = "-" if r["device_syncs"] is None else f"{r['device_syncs']:g}"
        ratio = r["seconds"] / hand  # type: ignore[operator]
        lines.append(f"| {name} | {cuda} | {r['host_reads']:g} | {ratio:.3f}x |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict[str, Optional[float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT-2 (a check of the code path, on any device)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows per loop (default 20; tiny 3)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    windows = args.windows or (3 if args.tiny else 20)
    if windows < 2:
        parser.error(f"--windows {windows}: the Trainers' figures are differences over windows - 1; pass 2 or more")
    if device.type == "cuda":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(device.index or 0))  # before CUDA starts: one GPU
        device = torch.device("cuda", 0)
    results = {"hand loop": measure_loop("hand", device, args.tiny, windows),
               "acc.step": measure_loop("acc.step", device, args.tiny, windows),
               "Trainer, GA 4": measure_trainer(False, device, args.tiny, windows),
               "ExactTrainer, GA 4": measure_trainer(True, device, args.tiny, windows)}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "N": N, "M": M, "results": results}))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
