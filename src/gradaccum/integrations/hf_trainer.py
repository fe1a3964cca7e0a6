"""Hugging Face ``Trainer``: exact gradient accumulation for any causal LM.

    trainer = ExactTrainer(model=model, args=args, train_dataset=dataset)   # instead of Trainer(...)

The stock Trainer counts ``num_items_in_batch`` only for models it recognises (a GPT-2 built from a
config has ``loss_type`` None, so it counts the unshifted labels) and falls back to ``loss / N`` for
models whose ``forward`` takes no ``num_items_in_batch``. :class:`ExactTrainer` counts the targets
itself and computes the loss itself, so neither matters.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gradaccum.integrations.hf_trainer needs transformers: pip install 'gradaccum[hf]' "
        "(or pip install 'transformers>=4.46')"
    ) from exc

__all__ = ["ExactTrainer", "causal_lm_loss_sum", "count_causal_targets"]


def _targets(batch: Dict[str, Any], shift: bool, ignore_index: int) -> torch.Tensor:
    """The labels the loss is over: ``shift_labels`` if the collator gave them, else ``labels[:, 1:]``."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch.get("labels")
    if labels is None:
        raise ValueError("ExactTrainer: a training batch has no 'labels'; it needs them to count the targets "
                         "and compute the loss (use a collator such as DataCollatorForLanguageModeling(mlm=False))")
    return labels[..., 1:] if shift else labels


def count_causal_targets(batch: Dict[str, Any], *, shift: bool = True, ignore_index: int = -100) -> torch.Tensor:
    """Targets of one batch: ``labels[..., 1:] != ignore_index`` (after the causal shift), counted on
    the labels' device; a collator's ``shift_labels`` are counted as given."""
    return (_targets(batch, shift, ignore_index) != ignore_index).sum()


def causal_lm_loss_sum(logits: torch.Tensor, batch: Dict[str, Any], *, shift: bool = True,
                       ignore_index: int = -100) -> torch.Tensor:
    """Sum over the batch's targets of the next-token cross-entropy, in the logits' dtype (float16 and
    bfloat16 logits are raised to float32; float64 stays float64)."""
    if "shift_labels" in batch:
        logits, targets = logits, batch["shift_labels"]  # already aligned with every position
    elif shift:
        logits, targets = logits[..., :-1, :], batch["labels"][..., 1:]
    else:
        targets = batch["labels"]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="sum")


class ExactTrainer(Trainer):
    """A ``transformers.Trainer`` whose gradient accumulation is exactly one big batch, for any model.

    Every optimizer step is on the gradient of the mean token loss over the whole window, every
    micro-batch of it on every rank:

        grad = sum_{ranks, k in window} grad(S_k) / N,   N = sum_{ranks, k in window} n_k,

    where ``S_k`` is micro-batch k's summed next-token cross-entropy over its ``n_k`` targets
    (``labels[:, 1:] != -100``, counted after the causal shift whatever the model's ``loss_type``).

    How: ``get_batch_samples`` (called once per window with the window's micro-batches) counts
    ``N`` and all-reduces it across ranks; ``compute_loss`` runs the model *without* ``labels`` and
    returns ``W * S_k / N`` (``W`` ranks, because DDP averages gradients over them) computed from
    the logits in their own dtype. ``loss_is_scaled_for_ga = True`` tells the Trainer not to divide
    by the accumulation steps. So the model's own loss, ``num_items_in_batch`` in its ``forward``,
    ``loss_type`` and ``average_tokens_across_devices`` play no part. The logged ``loss`` is the
    window's mean token loss over all ranks. Clipping (``max_grad_norm``), the scheduler, logging
    and checkpoints are the Trainer's, on the exact gradient. Evaluation's ``compute_loss`` returns
    the batch's mean token loss.

    Args:
        *args: As for ``transformers.Trainer``.
        shift_labels: ``True`` (default) for causal LMs: position t predicts ``labels[:, t + 1]``.
            ``False`` for models whose logits align with ``labels`` (token classification).
        ignore_index: Label value that is not a target. Default -100.
        **kwargs: As for ``transformers.Trainer``; ``compute_loss_func`` is refused (this class is
            the loss).

    Raises:
        ValueError: ``compute_loss_func`` is passed, ``label_smoothing_factor`` is not 0, the
            Trainer runs DataParallel over several GPUs in one process (``n_gpu > 1``), a batch has
            no ``labels``, or the model returns no ``logits``.

    Example:
        >>> from transformers import TrainingArguments
        >>> args = TrainingArguments("out", per_device_train_batch_size=8, gradient_accumulation_steps=4,
        ...                          max_grad_norm=1.0)   # doctest: +SKIP
        >>> ExactTrainer(model=model, args=args, train_dataset=ds, data_collator=collator).train()  # doctest: +SKIP

    Limits: data parallelism only (DDP, or FSDP, whose gradients are averaged the same way: untested
    here); no tensor/context/sequence parallelism, DeepSpeed, SageMaker MP or label smoothing.
    Tested with transformers 5.23; versions without ``Trainer.loss_is_scaled_for_ga`` are handled
    by declaring the model as taking loss kwargs, which is what made them skip the division.
    """

    loss_is_scaled_for_ga = True  # compute_loss returns the window-normalized loss (read by training_step)

    def __init__(self, *args: Any, shift_labels: bool = True, ignore_index: int = -100, **kwargs: Any) -> None:
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("ExactTrainer(compute_loss_func=...): ExactTrainer computes the loss itself (the "
                             "next-token cross-entropy from the logits); drop compute_loss_func, or use Trainer")
        super().__init__(*args, **kwargs)
        if getattr(self.args, "label_smoothing_factor", 0.0):
            raise ValueError(f"ExactTrainer: label_smoothing_factor={self.args.label_smoothing_factor} is not "
                             "supported; set it to 0")
        if self.args.n_gpu > 1:
            raise ValueError(f"ExactTrainer: n_gpu={self.args.n_gpu} (DataParallel in one process) splits each "
                             "batch without telling the loss; launch one process per GPU (torchrun) instead")
        if "loss_is_scaled_for_ga" not in vars(Trainer):
            # transformers before 5.x: training_step divides by the accumulation steps unless the model
            # "accepts loss kwargs"; nothing else reads it here because compute_loss and
            # get_batch_samples are overridden.
            self.model_accepts_loss_kwargs = True
        self.shift_labels = shift_labels
        self.ignore_index = ignore_index
        self.last_window_items: Optional[int] = None  # N of the last window, all ranks: for logs and tests

    # -- the window's count ----------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: Optional[torch.device] = None) -> Tuple[List[Any], Optional[torch.Tensor]]:
        """The window's micro-batches and ``N``, their targets summed over every rank.

        Overrides the public ``Trainer.get_batch_samples`` (one call per optimizer step, with that
        step's micro-batches: fewer on the short last window of an epoch)."""
        batch_samples: List[Any] = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        device = device if device is not None else self.args.device
        local = sum((count_causal_targets(b, shift=self.shift_labels, ignore_index=self.ignore_index).to(device)
                     for b in batch_samples), torch.zeros((), dtype=torch.long, device=device))
        total = self.accelerator.gather(local.reshape(1)).sum() if self.accelerator.num_processes > 1 else local
        self.last_window_items = int(total)
        return batch_samples, total

    # -- the loss --------------------------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        """Training: ``W * S_k / N`` with ``N`` from :meth:`get_batch_samples`. Evaluation: the
        batch's mean token loss ``S / n``. Both from the logits, in their dtype."""
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        outputs = model(**model_inputs)
        if isinstance(outputs, torch.Tensor):
            logits: Optional[torch.Tensor] = outputs  # a bare tensor from forward is taken as the logits
        elif isinstance(outputs, dict):
            logits = outputs.get("logits")
        elif isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
            logits = outputs[0]  # return_dict=False without labels: logits come first
        else:
            logits = getattr(outputs, "logits", None)
        if logits is None:
            raise ValueError("ExactTrainer: the model returned no 'logits'; ExactTrainer computes the loss from them "
                             f"(got {type(outputs).__name__}). Return logits from forward when no labels are given")
        total = causal_lm_loss_sum(logits, inputs, shift=self.shift_labels, ignore_index=self.ignore_index)
        if model.training:
            if num_items_in_batch is None:
                raise RuntimeError("ExactTrainer.compute_loss in training got num_items_in_batch=None; it is "
                                   "ExactTrainer.get_batch_samples' window count (do not override that away)")
            n = torch.as_tensor(num_items_in_batch, device=total.device).to(total.dtype).clamp(min=1)
            loss = total * self.accelerator.num_processes / n
        else:
            n = count_causal_targets(inputs, shift=self.shift_labels, ignore_index=self.ignore_index)
            loss = total / n.to(total.device, total.dtype).clamp(min=1)
        if return_outputs:
            return loss, outputs
        return loss
