"""Section 4: transformers on padded variable-length batches: speed, and distance from one big batch.

Two models: the text task's TinyTransformer, and a tiny Hugging Face GPT-2 (random init from a
``GPT2Config``, nothing downloaded, dropout 0). Four ways to accumulate N micro-batches of M
sequences, each padded to its own longest sequence:

* gradaccum: ``Accumulator.step`` with ``causal_lm_loss`` -> (mean, token count): token-weighted.
* hand loop: each micro-batch's mean loss / N, the loop of most tutorials.
* Accelerate ``accumulate()``: the same loss / N, inside Accelerate's context.
* HF ``Trainer`` with ``gradient_accumulation_steps=N``: it counts the window's tokens and hands
  them to models whose ``forward`` takes ``**kwargs`` (GPT-2 does); a custom ``forward(input_ids,
  labels)`` that returns its mean loss (the TinyTransformer wrapper here) gets loss / N instead.
* trainer-exact: gradaccum's ``ExactTrainer`` in place of ``Trainer``, same arguments.
* lightning: PyTorch Lightning's ``accumulate_grad_batches=N`` (loss / N per micro-batch).
* lightning-exact: the same Trainer with ``ExactAccumulation(num_items=<targets after the shift>)``.

Speed: target tokens (not padding) per second, side by side in one run, order rotated every repeat.
Distance: after S windows of SGD with momentum from the same initial weights, the parameter update
against S full-batch steps of a float64 copy on the same windows::

    distance = ||theta_method - theta_ref|| / ||theta_ref - theta_0||

0 is one big batch exactly; float32 rounding alone gives about 1e-6.
"""
from __future__ import annotations

import copy
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from common import QUICK, Timer, accelerator, median, rotate

from gradaccum import Accumulator, causal_lm_loss
from gradaccum.tasks.data import load_task
from gradaccum.tasks.models import TinyTransformer

M = 4                     # sequences per micro-batch
NS: Sequence[int] = (1, 4, 16) if QUICK else (1, 2, 4, 8, 16)
REPEATS = 2 if QUICK else 4
MICRO_BATCHES_PER_BLOCK = 16 if QUICK else 24
STEPS = 3                 # windows for the distance
LR = 0.1
METHODS = ("gradaccum", "hand", "accelerate", "trainer", "trainer-exact", "lightning", "lightning-exact")

Batch = Dict[str, torch.Tensor]


# -- models --------------------------------------------------------------------------------------

class TinyLM(nn.Module):
    """TinyTransformer for every method: ``forward(input_ids, labels, attention_mask)`` returns the
    logits, or with ``as_trainer_model`` a dict with the mean loss, as custom Trainer models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyTransformer(vocab=256, max_len=64)
        self.as_trainer_model = False

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> Any:
        logits = self.net(input_ids)  # causal, right padding: padding never reaches a real token
        if self.as_trainer_model:
            return {"loss": causal_lm_loss(logits, labels)[0]}
        return logits


def gpt2() -> Optional[nn.Module]:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def logits_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    if isinstance(model, TinyLM):
        return model(batch["input_ids"])
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def lm_loss(model: nn.Module, batch: Batch):
    return causal_lm_loss(logits_of(model, batch), batch["labels"])  # (mean, count)


# -- data ----------------------------------------------------------------------------------------

class TextWindows:
    """The text task's byte sequences in a fixed shuffled order, cut into windows of N x M."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device
        self.task = load_task("text")
        self.order = torch.randperm(self.task.num_train, generator=torch.Generator().manual_seed(0)).tolist()

    def gather(self, idx: Sequence[int]) -> Batch:
        b = self.task.gather(idx)
        b["attention_mask"] = (b["labels"] != -100).long()
        return {k: v.to(self.device) for k, v in b.items()}

    def indices(self, window: int, n: int) -> List[int]:
        start = window * n * M
        return [self.order[i % len(self.order)] for i in range(start, start + n * M)]

    def window(self, window: int, n: int) -> List[Batch]:
        idx = self.indices(window, n)
        return [self.gather(idx[k * M:(k + 1) * M]) for k in range(n)]

    def tokens(self, batches: Sequence[Batch]) -> int:
        return sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)


# -- the four methods: each returns a function running windows [first, last) -----------------------

def _gradaccum(model: nn.Module, windows: List[List[Batch]], precision: str = "fp32") -> Callable[[int, int], None]:
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), precision=precision)
    return lambda a, b: [acc.step(windows[w], lm_loss) for w in range(a, b)] and None


def _hand(model: nn.Module, windows: List[List[Batch]]) -> Callable[[int, int], None]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def run(a: int, b: int) -> None:
        for w in range(a, b):
            for mb in windows[w]:
                (lm_loss(model, mb)[0] / len(windows[w])).backward()
            opt.step()
            opt.zero_grad()
    return run


def _accelerate(model: nn.Module, windows: List[List[Batch]]) -> Optional[Callable[[int, int], None]]:
    n = len(windows[0])
    accel = accelerator(n)
    if accel is None:
        return None
    a_model, a_opt = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))

    def run(a: int, b: int) -> None:
        accelerator(n)  # realign: the Trainer shares Accelerate's gradient state
        for w in range(a, b):
            for mb in windows[w]:
                with accel.accumulate(a_model):
                    accel.backward(lm_loss(a_model, mb)[0])
                    a_opt.step()
                    a_opt.zero_grad()
    return run


class _Clock:
    """Trainer callback: the time at the end of every optimizer step."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
                clock.ends.append(time.perf_counter())
        self.callback = Callback()
        self.ends: List[float] = []


def _trainer(model: nn.Module, data: TextWindows, n: int, windows: int,
             exact: bool = False) -> Optional[Callable[[int], List[float]]]:
    """A Trainer over windows 0..windows-1 in order; calling it trains ``k`` windows from window 0
    and returns the seconds of windows 1..k-1 (the first one includes the Trainer's start)."""
    try:
        import transformers
        from transformers import PrinterCallback, Trainer, TrainingArguments
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    cls = Trainer
    if exact:
        from gradaccum.integrations.hf_trainer import ExactTrainer as cls
    if isinstance(model, TinyLM):
        model.as_trainer_model = not exact  # ExactTrainer computes the loss from the logits
    idx = [i for w in range(windows) for i in data.indices(w, n)]
    dataset = [{"idx": i} for i in idx]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="gradaccum-bench-"), per_device_train_batch_size=M,
        gradient_accumulation_steps=n, max_steps=windows, max_grad_norm=0.0, report_to="none",
        save_strategy="no", logging_strategy="no", eval_strategy="no", disable_tqdm=True,
        use_cpu=data.device.type == "cpu",
        dataloader_num_workers=0, train_sampling_strategy="sequential", remove_unused_columns=False, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    clock = _Clock()
    head = {"head": "causal_lm"} if exact else {}  # ExactTrainer cannot name TinyLM's head from its class
    trainer = cls(model=model, args=args, train_dataset=dataset, optimizers=(opt, sched),
                      data_collator=lambda items: data.gather([it["idx"] for it in items]),
                      callbacks=[clock.callback], **head)
    trainer.remove_callback(PrinterCallback)  # it prints each train()'s summary

    def run(k: int) -> List[float]:
        trainer.args.max_steps = k
        clock.ends.clear()
        trainer.train()
        return [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return run


def _lightning(model: nn.Module, data: TextWindows, n: int, windows: int,
               exact: bool) -> Optional[Callable[[int], List[float]]]:
    """A Lightning fit over windows 0..windows-1 in order (a new ``pl.Trainer`` per call, as users
    fit); calling it trains ``k`` windows and returns the seconds of windows 1..k-1."""
    try:
        import warnings

        import pytorch_lightning as pl
    except ImportError:
        return None
    from gradaccum.integrations.lightning import ExactAccumulation

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    micro = [mb for w in range(windows) for mb in data.window(w, n)]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            return lm_loss(self.model, batch)[0]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return opt

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.ends: List[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            if (batch_idx + 1) % n == 0:
                self.ends.append(time.perf_counter())

    lit = Lit()

    def run(k: int) -> List[float]:
        clock = Clock()
        callbacks: List[Any] = [clock]
        if exact:
            callbacks.append(ExactAccumulation(num_items=lambda b: int((b["labels"][:, 1:] != -100).sum())))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=k, accumulate_grad_batches=n, logger=False,
                             callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, num_sanity_val_steps=0)
        trainer.fit(lit, torch.utils.data.DataLoader(micro[:k * n], batch_size=None))
        return [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return run


# -- distance from one big batch ------------------------------------------------------------------

def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def _framework(name: str, model: nn.Module, data: TextWindows, n: int,
               windows: int) -> Optional[Callable[[int], List[float]]]:
    if name.startswith("trainer"):
        return _trainer(model, data, n, windows, exact=name.endswith("exact"))
    return _lightning(model, data, n, windows, exact=name.endswith("exact"))


def reference(base: nn.Module, data: TextWindows, n: int) -> torch.Tensor:
    """S full-batch steps of a float64 copy: each window as one batch padded to its longest."""
    model = copy.deepcopy(base).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for w in range(STEPS):
        mean, _ = lm_loss(model, data.gather(data.indices(w, n)))
        mean.backward()
        opt.step()
        opt.zero_grad()
    return _flat(model)


def distances(base: nn.Module, data: TextWindows, n: int) -> Dict[str, float]:
    theta0, ref = _flat(base), reference(base, data, n)
    windows = [data.window(w, n) for w in range(STEPS)]
    out: Dict[str, float] = {}
    for name in METHODS:
        model = copy.deepcopy(base)
        if name in ("trainer", "trainer-exact", "lightning", "lightning-exact"):
            run = _framework(name, model, data, n, STEPS)
            if run is None:
                continue
            run(STEPS)
        else:
            fn = {"gradaccum": _gradaccum, "hand": _hand, "accelerate": _accelerate}[name](model, windows)
            if fn is None:
                continue
            fn(0, STEPS)
        out[name] = float((_flat(model) - ref).norm() / (ref - theta0).norm())
    return out


# -- speed ----------------------------------------------------------------------------------------

def speeds(base: nn.Module, data: TextWindows, n: int) -> Dict[str, Dict[str, float]]:
    """Tokens per second of each method, windows 1..W, order rotated every repeat."""
    w = max(2, MICRO_BATCHES_PER_BLOCK // n)
    windows = [data.window(i, n) for i in range(w + 1)]
    tokens = data.tokens([mb for win in windows[1:] for mb in win]) / w  # per window
    timer = Timer(torch.device("cpu"))
    runs: Dict[str, Callable[[], float]] = {}
    for name in METHODS:
        model = copy.deepcopy(base)
        if name in ("trainer", "trainer-exact", "lightning", "lightning-exact"):
            trainer = _framework(name, model, data, n, w + 1)
            if trainer is not None:
                runs[name] = lambda t=trainer: sum(t(w + 1)) / w
            continue
        fn = {"gradaccum": _gradaccum, "hand": _hand, "accelerate": _accelerate}[name](model, windows)
        if fn is not None:
            fn(0, 1)  # warm-up
            runs[name] = lambda f=fn: timer(lambda: f(1, w + 1)) / w
    samples: Dict[str, List[float]] = {k: [] for k in runs}
    for r in range(REPEATS):
        for name in rotate(list(runs), r):
            samples[name].append(runs[name]())
    out = {}
    for name, s in samples.items():
        ratios = [a / b for a, b in zip(s, samples["hand"])]
        out[name] = {"window_ms": 1e3 * median(s), "tokens_per_s": tokens / median(s),
                     "time_vs_hand": median(ratios)}
    return out


def transformer() -> List[dict]:
    data = TextWindows()
    rows = []
    for label, base in (("TinyTransformer", TinyLM()), ("GPT-2 (tiny)", gpt2())):
        if base is None:
            continue
        params = sum(p.numel() for p in base.parameters())
        for n in NS:
            speed = speeds(base, data, n)
            dist = distances(base, data, n)
            windows = [data.window(i, n) for i in range(STEPS)]
            padded = sum(int(b["labels"].numel()) for win in windows for b in win)
            real = sum(int((b["labels"] != -100).sum()) for win in windows for b in win)
            for name in METHODS:
                if name not in speed:
                    continue
                rows.append({"model": label, "params": params, "N": n, "method": name,
                             "tokens_per_s": speed[name]["tokens_per_s"], "window_ms": speed[name]["window_ms"],
                             "time_vs_hand": speed[name]["time_vs_hand"], "distance": dist.get(name),
                             "padding": 1 - real / padded})
    return rows
