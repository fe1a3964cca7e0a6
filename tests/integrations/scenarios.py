"""Runs shared by the in-process tests (test_lightning.py, test_hf_trainer.py) and the torchrun worker
(hf_worker.py): a framework trains a tiny float64 causal LM on padded micro-batches of uneven sizes, and
a float64 reference steps once per window on the union of every rank's micro-batches of that window.

Data: ``rank_micro_batches(rank, world, sizes)`` gives each rank its own micro-batches (sequence
counts from ``sizes``, lengths 3-30, each padded to its own longest). No DistributedSampler anywhere:
every rank is handed exactly its list (Lightning: ``use_distributed_sampler=False``, each rank its own
DataLoader; HF Trainer: one dataset interleaving the ranks' lists, which its sampler deals back one
item per rank in turn), so the reference knows what each window held on every rank. The number of micro-batches is not a multiple of the accumulation: the last window is short.
"""
from __future__ import annotations

import contextlib
import copy
import tempfile
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from gradaccum import causal_lm_loss, count_targets
from hf_helpers import pad, unpad

Batch = Dict[str, torch.Tensor]
LR = 0.1

# micro-batch sizes (sequences) per rank; 7 micro-batches with accumulation 3: windows 3, 3, 1
SIZES = {0: [2, 3, 1, 2, 3, 1, 2], 1: [3, 1, 2, 2, 1, 3, 2]}
ACCUM = 3
BLOCKS = ("GPT2Block", "LlamaDecoderLayer")  # the transformer blocks FSDP2 shards one by one


def float64_rmsnorm(model: nn.Module) -> nn.Module:
    """Llama's RMSNorm computes in float32 even in a float64 model. Under Lightning, whose loop shows
    a window's count only after its backwards, that float32 island rounds ``grad * W / R`` instead of
    the big batch's ``grad / N`` (about 1e-7 relative); this variant computes it in the input dtype,
    so the test isolates the weighting. Returns the model, changed in place."""
    import types

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(forward, module)
    return model


class PlainForward(nn.Module):
    """A model whose ``forward(input_ids, attention_mask, labels)`` takes no ``**kwargs``, as custom
    models do: the stock Trainer then cannot pass ``num_items_in_batch`` and divides by the steps."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def stock(model: nn.Module) -> nn.Module:
    """As the model class builds it: hf_helpers sets ``loss_type`` so the stock Trainer counts shifted
    targets; a ``GPT2LMHeadModel(config)`` has ``loss_type`` None, which this restores."""
    model.loss_type = None
    return model


def rank_micro_batches(rank: int, sizes: Sequence[int], seed: int = 0) -> List[Batch]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out = []
    for n in sizes:
        lengths = torch.randint(3, 31, (n,), generator=g).tolist()
        out.append(pad([torch.randint(1, 50, (k,), generator=g) for k in lengths]))
    return out


def windows_of(per_rank: Sequence[Sequence[Batch]], accum: int) -> List[List[torch.Tensor]]:
    """Every window's sequences, over all ranks: what one big batch per step holds."""
    steps = -(-len(per_rank[0]) // accum)
    return [[s for mbs in per_rank for mb in mbs[w * accum:(w + 1) * accum] for s in unpad(mb)]
            for w in range(steps)]


def stepped_windows(per_rank: Sequence[Sequence[Batch]], accum: int) -> List[List[torch.Tensor]]:
    """The windows one big batch per step takes when some micro-batches have every label -100: their
    sequences hold no target, so they are left out, and a window left with none takes no step."""
    steps = -(-len(per_rank[0]) // accum)
    windows = [[s for mbs in per_rank for mb in mbs[w * accum:(w + 1) * accum]
                if (mb["labels"] != -100).any() for s in unpad(mb)] for w in range(steps)]
    return [w for w in windows if w]


def make_optimizer(params) -> tuple:
    # SGD with momentum: a uniformly mis-scaled gradient (the stock Trainer's 0.943x) moves the
    # parameters by as much less; Adam would divide most of it away
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))  # a schedule that matters
    return opt, sched


def lm_logits(model: nn.Module, mb: Batch) -> torch.Tensor:
    return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits


def reference(model: nn.Module, windows: Sequence[Sequence[torch.Tensor]], clip: Optional[float] = None,
              epochs: int = 1, optimizer=make_optimizer) -> nn.Module:
    """One float64 step per window: mean over every target of the window, backward, clip, step."""
    model = copy.deepcopy(model)
    opt, sched = optimizer(model.parameters())
    model.window_losses = []  # the mean loss of every step, to compare with what the frameworks log
    for _ in range(epochs):
        for window in windows:
            opt.zero_grad(set_to_none=True)
            mb = pad(window)
            loss = causal_lm_loss(lm_logits(model, mb), mb["labels"])[0]
            model.window_losses.append(loss.item())
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
    return model


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def params_close(a: nn.Module, b: nn.Module) -> Optional[str]:
    """None when every parameter matches at rtol 1e-10, else the first mismatch."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        try:
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        except AssertionError as e:
            return f"{name}: {str(e).splitlines()[0]} (max diff {max_diff(a, b):.3e})"
    return None


def quiet() -> None:
    """The frameworks' harmless notices on tiny CPU runs (few dataloader workers, no logger)."""
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # e.g. "loss_type=None ... Using the default loss"
    except ImportError:
        pass


# -- Lightning ------------------------------------------------------------------------------------

def lightning_module(model: nn.Module, *, return_count: bool = False, shard: bool = False):
    """A LightningModule training ``model`` on padded micro-batches; ``shard``: FSDP2 in
    ``configure_model`` (each transformer block, then the root, over the data-parallel mesh), as
    Lightning's ``ModelParallelStrategy`` requires."""
    import pytorch_lightning as pl

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.logged: List[float] = []

        def training_step(self, batch: Batch, batch_idx: int) -> Any:
            mean, n = causal_lm_loss(lm_logits(self.model, batch), batch["labels"])
            self.log("train_loss", mean, batch_size=int(n))
            self.logged.append(mean.item())
            return (mean, n) if return_count else mean

        def configure_optimizers(self) -> Any:
            opt, sched = make_optimizer(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class ShardedLitLM(LitLM):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in [m for m in self.model.modules() if type(m).__name__ in BLOCKS]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return ShardedLitLM() if shard else LitLM()


def lightning_fit(model: nn.Module, micro_batches: Sequence[Batch], *, exact: bool, accum: int = ACCUM,
                  clip: Optional[float] = None, world: int = 1, epochs: int = 1, return_count: bool = False,
                  callbacks: Sequence[Any] = (), ckpt_path: Optional[str] = None, root: Optional[str] = None,
                  checkpointing: bool = False, fsdp2: bool = False):
    """Train a copy of ``model`` with Lightning; returns (lightning module, trainer, callback).
    ``world`` > 1: ``strategy="ddp"``, or with ``fsdp2`` Lightning's ``ModelParallelStrategy`` with
    every rank data-parallel (the parameters are then sharded DTensors)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from gradaccum.integrations.lightning import ExactAccumulation

    quiet()
    lit = lightning_module(copy.deepcopy(model), return_count=return_count, shard=fsdp2)
    exact_cb = None
    cbs = list(callbacks)
    if exact:
        exact_cb = ExactAccumulation() if return_count else ExactAccumulation(
            num_items=lambda b: count_targets(b["labels"]))
        cbs.append(exact_cb)
    if fsdp2:
        from pytorch_lightning.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "ddp" if world > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs,
        accumulate_grad_batches=accum, gradient_clip_val=clip, callbacks=cbs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpointing,
        use_distributed_sampler=False, default_root_dir=root or tempfile.mkdtemp(prefix="gradaccum-pl-"),
        num_sanity_val_steps=0, deterministic=False)
    loader = DataLoader(list(micro_batches), batch_size=None, shuffle=False)
    trainer.fit(lit, loader, ckpt_path=ckpt_path)
    return lit, trainer, exact_cb


# -- Lightning: windows of 0 items ------------------------------------------------------------------

# rows per micro-batch on each rank; accumulate 2: windows 0, 1, 2. Window 1 counts 0 items on every
# rank (skipped); window 2 counts 0 items on rank 0 only (it steps on rank 1's items).
MASKED_SIZES = {0: [3, 2, 2, 1, 4, 3], 1: [2, 4, 1, 3, 2, 2]}
MASKED_ACCUM = 2
EMPTY = {0: {2, 3, 4, 5}, 1: {2, 3}}  # micro-batches whose every mask is 0


def masked_batches(rank: int) -> List[tuple]:
    """``(x, y, mask)`` micro-batches in float64: the rows whose mask is 1 are the items."""
    g = torch.Generator().manual_seed(5 + rank)
    out = []
    for k, n in enumerate(MASKED_SIZES[rank]):
        mask = (torch.rand(n, generator=g) < 0.7).long()
        mask[0] = 1
        if k in EMPTY[rank]:
            mask.zero_()
        out.append((torch.randn(n, 4, generator=g, dtype=torch.float64),
                    torch.randn(n, 2, generator=g, dtype=torch.float64), mask))
    return out


def masked_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def masked_mse(net: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mean squared error over the rows whose mask is 1 (0 when there is none)."""
    x, y, mask = batch
    per_row = ((net(x) - y) ** 2).mean(-1)
    return (per_row * mask).sum() / mask.sum().clamp(min=1)


def adamw(params) -> tuple:
    """AdamW with weight decay and a per-step schedule: a step on a zero gradient still moves the
    weights and the schedule."""
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def masked_reference(per_rank: Sequence[Sequence[tuple]]) -> nn.Module:
    """One float64 AdamW step per window on the union of every rank's rows, as the core takes it: a
    window whose masks are all 0 has no loss and takes no step (no weight decay, no scheduler step)."""
    net = masked_net()
    opt, sched = adamw(net.parameters())
    for w in range(-(-len(per_rank[0]) // MASKED_ACCUM)):
        parts = [mb for mbs in per_rank for mb in mbs[w * MASKED_ACCUM:(w + 1) * MASKED_ACCUM]]
        joined = [torch.cat(column) for column in zip(*parts)]
        if joined[2].sum() == 0:
            continue
        opt.zero_grad()
        masked_mse(net, joined).backward()
        opt.step()
        sched.step()
    return net


class EpochBatches(torch.utils.data.IterableDataset):
    """Another list of micro-batches per epoch (``epochs[e]`` in epoch ``e``, read from the Trainer's
    loop when the epoch's iteration starts, so a resumed fit sees the epoch it resumes in): a data
    pipeline whose epochs differ, as a reshuffle per epoch does."""

    def __init__(self, epochs: Sequence[Sequence[tuple]]) -> None:
        self.epochs, self.trainer = [list(e) for e in epochs], None

    def bind(self, trainer: Any) -> "EpochBatches":
        self.trainer = trainer
        return self

    def __iter__(self) -> Iterator[tuple]:
        # the epochs the loop has finished: restored on resume (current_epoch is still the saved one
        # when a fit resumed from an epoch's end starts iterating)
        return iter(self.epochs[self.trainer.fit_loop.epoch_progress.current.processed])  # type: ignore[union-attr]


def masked_fit(micro_batches: Sequence[tuple], *, exact: bool, world: int = 1, epochs: int = 1, max_steps: int = -1,
               callbacks: Sequence[Any] = (), ckpt_path: Optional[str] = None, root: Optional[str] = None):
    """Fit a masked regression with Lightning (``ExactAccumulation`` counting the mask, or
    Lightning's own accumulation); returns (net, trainer, callback). ``callbacks`` (a ModelCheckpoint)
    turn checkpointing on; ``ckpt_path`` resumes."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from gradaccum.integrations.lightning import ExactAccumulation

    class MaskedRegression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = masked_net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return masked_mse(self.net, batch)

        def configure_optimizers(self) -> Any:
            opt, sched = adamw(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    quiet()
    lit = MaskedRegression()
    cb = ExactAccumulation(num_items=lambda batch: batch[2].sum()) if exact else None
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_epochs=epochs,
                         max_steps=max_steps, accumulate_grad_batches=MASKED_ACCUM,
                         callbacks=([cb] if cb else []) + list(callbacks), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(callbacks),
                         use_distributed_sampler=False,
                         default_root_dir=root or tempfile.mkdtemp(prefix="gradaccum-pl-"))
    data = list(micro_batches) if not isinstance(micro_batches, EpochBatches) else micro_batches.bind(trainer)
    trainer.fit(lit, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return lit.net, trainer, cb


# -- Hugging Face Trainer -----------------------------------------------------------------------------

class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def interleaved(per_rank: Sequence[Sequence[Batch]]) -> List[Batch]:
    """Rank 0's first micro-batch, rank 1's first, rank 0's second, ...: the Trainer's distributed
    sampler (batch size 1, not split) deals item i to rank i % W, so each rank gets exactly its own list.
    Every rank holds as many micro-batches, so the length is a multiple of W and nothing is padded or
    duplicated; window w on all ranks is items [w A W, (w + 1) A W)."""
    return [mbs[k] for k in range(len(per_rank[0])) for mbs in per_rank]


def fsdp_on_cpu(cls: type, optimizer=make_optimizer) -> type:
    """``cls`` (a Trainer class) under Accelerate's FSDP on the CPU, its optimizer and scheduler from
    ``optimizer`` (under FSDP the Trainer refuses ``optimizers=``: it builds them in ``create_optimizer``,
    before Accelerate shards the model, and Accelerate then points the optimizer at the shards).

    Accelerate turns FSDP on for accelerators only: on the CPU it keeps ``MULTI_CPU`` and the Trainer
    runs DDP even with ``fsdp`` set. The class sets Accelerate's distributed type to FSDP with the
    Trainer's own plugin as the Trainer builds its Accelerator; everything after that is the stacks'
    FSDP code on gloo (``fully_shard`` per block and on the root, ``set_requires_gradient_sync`` inside
    a window, the DTensor gradient-norm clip). Leave with :func:`fsdp_state_restored`."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class OnCPU(cls):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

        def create_optimizer(self, model: Any = None) -> Any:
            if self.optimizer is None:
                self.optimizer, self._made_scheduler = optimizer(self.model.parameters())
            return self.optimizer

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                self.lr_scheduler = self._made_scheduler
            return self.lr_scheduler

    OnCPU.__name__ = OnCPU.__qualname__ = f"{cls.__name__}OnCPUFSDP"
    return OnCPU


@contextlib.contextmanager
def fsdp_state_restored() -> Iterator[None]:
    """Accelerate's process-wide state back to what this process runs (``fsdp_on_cpu`` changed it), on
    the way out: the next Trainer in the process builds its Accelerator on that shared state."""
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState, PartialState

        if AcceleratorState._shared_state:
            AcceleratorState._shared_state["distributed_type"] = PartialState().distributed_type
            AcceleratorState._shared_state.pop("fsdp_plugin", None)


def hf_fit(model: nn.Module, per_rank: Sequence[Sequence[Batch]], *, exact: bool, accum: int = ACCUM,
           clip: Optional[float] = None, epochs: int = 1, out: Optional[str] = None,
           save: bool = False, resume: Optional[str] = None, max_steps: int = -1,
           trainer_cls: Optional[type] = None, head: Optional[str] = None, optimizer=make_optimizer,
           fsdp_version: Optional[int] = None, callbacks: Sequence[Any] = (), **arguments):
    """Train a copy of ``model`` with the HF Trainer, one pre-padded micro-batch per dataset item
    (``per_device_train_batch_size=1`` and a collator that unwraps), so micro-batches keep their
    uneven sizes and paddings; sequential order (``train_sampling_strategy="sequential"``). ``head`` goes
    to ExactTrainer (a model it cannot name, such as PlainForward, needs it); ``arguments`` to
    TrainingArguments. ``fsdp_version``: under Accelerate's FSDP of that version (:func:`fsdp_on_cpu`),
    each of :data:`BLOCKS` sharded, then the root; the model returned then holds the shards (DTensors)."""
    from transformers import Trainer, TrainingArguments

    from gradaccum.integrations.hf_trainer import ExactTrainer

    quiet()
    cls = trainer_cls or (ExactTrainer if exact else Trainer)
    model = copy.deepcopy(model)
    if fsdp_version is None:
        optimizers = optimizer(model.parameters())
    else:
        cls, optimizers = fsdp_on_cpu(cls, optimizer), (None, None)
        blocks = sorted({type(m).__name__ for m in model.modules()} & set(BLOCKS))
        arguments.update(fsdp="full_shard", fsdp_config={"fsdp_version": fsdp_version,
                                                         "transformer_layer_cls_to_wrap": blocks})
    args = TrainingArguments(
        output_dir=out or tempfile.mkdtemp(prefix="gradaccum-hf-"), per_device_train_batch_size=1,
        gradient_accumulation_steps=accum, num_train_epochs=epochs, max_steps=max_steps,
        max_grad_norm=clip if clip is not None else 0.0, report_to="none", logging_strategy="steps",
        logging_steps=1, save_strategy="steps" if save else "no", save_steps=1, eval_strategy="no",
        disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
        remove_unused_columns=False, seed=0, data_seed=0, ddp_find_unused_parameters=False, **arguments)
    extra = {"head": head} if head is not None and issubclass(cls, ExactTrainer) else {}
    with fsdp_state_restored() if fsdp_version is not None else contextlib.nullcontext():
        trainer = cls(model=model, args=args, train_dataset=ListDataset(interleaved(per_rank)),
                      optimizers=optimizers, data_collator=lambda items: items[0], callbacks=list(callbacks),
                      **extra)
        from transformers import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # it prints every log line
        trainer.train(resume_from_checkpoint=resume)
    return model, trainer


class NanOnCall:
    """A forward hook making the output of the module's ``call``-th forward (from 0) nan: the micro-batch
    that runs it has a nan loss and a nan gradient. Registered on a model before a fit copies it, each copy
    counts its own calls from 0 (the hook is deep-copied with the model)."""

    def __init__(self, call: int) -> None:
        self.call, self.calls = call, 0

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> Optional[torch.Tensor]:
        self.calls += 1
        return output * float("nan") if self.calls - 1 == self.call else None


def all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())
