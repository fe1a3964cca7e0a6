"""TRL's GRPO and RLOO with every optimizer step one big batch of the chosen ``loss_type``: drop-ins that
generate and count each step's micro-batches first (:mod:`gradaccum.rl`), then drive the Trainer's one
window (docs/guides/trl.md, "GRPO and RLOO")."""
from __future__ import annotations

import collections
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .._weights import Closing, backward_weight
from ..errors import ConfigurationError, NotExactError
from ..rl import ITEMS, StepCount, local_counts, trl_divisor, trl_entropy_mean
from .hf_driver import TrainerDriver, refuse_untested, serves_the_window
from ._versions import require
from .hf_moe import trl_router_balance

require("trl", "gradaccum.integrations.trl")
try:
    from trl import GRPOTrainer, RLOOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("gradaccum.integrations.trl_rl needs TRL: pip install 'gradaccum[hf]' (or pip install trl)") from exc

__all__ = ["ExactGRPOTrainer", "ExactRLOOTrainer"]


def _loss_type(trainer: Any) -> str:
    return "rloo" if isinstance(trainer, RLOOTrainer) else trainer.loss_type


class _ExactRL(TrainerDriver):
    """The driver shared by :class:`ExactGRPOTrainer` and :class:`ExactRLOOTrainer`: count the step
    first, then weigh each micro-batch's summed terms by ``W / N`` (skip the step where N = 0)."""

    empty_window_note = ("here: an optimizer step whose completions hold no token on any rank (every completion "
                         "mask 0, e.g. every completion truncated under mask_truncated_completions); the step's "
                         "data is consumed")
    _resume_rng: Optional[str] = None  # a checkpoint whose random state this step generates from (a resume)
    _rng_loaded_early = False
    _controller: Optional[Tuple[float, float]] = None  # TRL's entropy controller, kept over a skipped step

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _refuse_what_is_not_exact(self)
        self.last_step_count: Optional[StepCount] = None  # the last step's counts, all ranks: for logs and tests
        self._prepared: Deque[Dict[str, Any]] = collections.deque()
        self._captured: Optional[List[Any]] = None  # the entropies TRL's loss saw, while compute_loss runs
        #: ``W / max(T, 1)``: the entropy bonus is a second mean, over the step's T completion tokens (a mean
        #: over no token weighs a zero sum)
        self._bonus_weight: Optional[float] = None
        self.router_balance = trl_router_balance(self)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: Optional[str], trial: Any) -> Tuple[int, int]:
        """On a resume, TRL's micro-batch counter at its position (docs/guides/trl.md, "GRPO and RLOO")."""
        epochs, batches = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        self._resume_rng, self._rng_loaded_early = None, False  # nothing left from an earlier train()
        if resume_from_checkpoint is not None and not self.args.ignore_data_skip:  # type: ignore[attr-defined]
            self._step = batches  # type: ignore[attr-defined]  # micro-batches of this epoch already trained
            self._resume_rng = resume_from_checkpoint if batches > 0 else None  # else the Trainer loads it first
        return epochs, batches

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        """The Trainer's restore of the checkpoint's random state, unless :meth:`get_batch_samples` did it."""
        if not self._rng_loaded_early:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        self._rng_loaded_early = False

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Tuple[List[Any], None]:
        """The step's micro-batches, generated (or taken from TRL's buffer) before its first backward, in
        TRL's order; their completion tokens and sequences summed over the ranks in one all-reduce."""
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if self._resume_rng is not None:  # resumed inside an epoch: the random state the step generated from
            checkpoint, self._resume_rng = self._resume_rng, None
            self._load_rng_state(checkpoint)
            self._rng_loaded_early = True
        self.model.train()  # type: ignore[attr-defined]  # TRL's _prepare_inputs reads the mode
        first = self._step  # type: ignore[attr-defined]  # TRL's micro-batch counter picks the buffered slice
        prepared: List[Dict[str, Any]] = []
        try:
            for i, raw in enumerate(batch_samples):
                self._step = first + i
                prepared.append(super()._prepare_inputs(raw))  # type: ignore[misc]
        finally:
            self._step = first
        self._prepared = collections.deque(prepared)  # whole, or not at all where _prepare_inputs raised
        counts = local_counts([_loss_mask(b) for b in prepared], self.accelerator.device)  # type: ignore[attr-defined]
        tokens, rows = self.summed_over_ranks(counts).tolist()  # [completion tokens, sequences], ints
        self.last_step_count = StepCount.of(_loss_type(self), tokens, rows, getattr(self, "max_completion_length", None))
        window = self.open_window(self.last_step_count.items, len(prepared),
                                  routed=lambda: [_model_inputs(b) for b in prepared])
        self._bonus_weight = float(backward_weight(1, max(tokens, 1), self.grad_divisor))  # W / T
        if window.empty and getattr(self, "use_adaptive_entropy", False):  # N = 0: the controller kept as it is
            self._controller = (self.entropy_coef, self._last_world_entropy)  # type: ignore[attr-defined]
        return batch_samples, None

    def _prepare_inputs(self, generation_batch: Any) -> Dict[str, Any]:
        """Training: the next micro-batch that :meth:`get_batch_samples` prepared; evaluation: TRL's."""
        if not self.model.training:  # type: ignore[attr-defined]
            return super()._prepare_inputs(generation_batch)  # type: ignore[misc]
        if not self._prepared:
            raise RuntimeError(f"{type(self).__name__}: a training micro-batch ran before get_batch_samples prepared "
                               "its step (do not override get_batch_samples away, or call training_step alone)")
        return self._prepared.popleft()

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)  # type: ignore[misc]
        if self._captured is not None:
            self._captured.append(out[1])
        return out

    @serves_the_window
    def compute_loss(self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
        """Training: this micro-batch's summed terms times ``W / N`` (the entropy bonus's times
        ``W / T``), with TRL's loss, metrics and logs computed as TRL computes them. Evaluation: TRL's."""
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]
        if self._window is None or self._bonus_weight is None:
            raise RuntimeError(f"{type(self).__name__}.compute_loss in training before get_batch_samples counted "
                               "the step")
        # the entropy coefficient TRL applies in this step (0 where off; adaptive: the previous step's decision)
        off = not getattr(self, "_entropy_bonus_enabled", False) or (
            self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target)
        coef = 0.0 if off else float(self.entropy_coef)
        trl_loss = super().compute_loss  # type: ignore[misc]  # TRL's loss, metrics and logs
        self._captured = []
        try:  # an MoE model: the forward replayed as counted, its router logits read, TRL's own aux term off
            loss, part = self.balanced(model, _model_inputs(inputs) if self._balance is not None else inputs,
                                       lambda: trl_loss(model, inputs, return_outputs, num_items_in_batch))
        finally:
            captured, self._captured = self._captured, None
        mask = _loss_mask(inputs)
        k = self.current_gradient_accumulation_steps  # type: ignore[attr-defined]
        if coef != 0.0:  # TRL subtracted coef times its entropy mean: taken back out, as TRL computed it
            entropy_sum, trl_mean = trl_entropy_mean(captured[0], mask, accumulation=k)
            loss = loss + coef * trl_mean
        divisor = trl_divisor(_loss_type(self), mask, accumulation=k, steps_per_generation=self.args.steps_per_generation,
                              max_completion_length=getattr(self, "max_completion_length", None),
                              generation_tokens=inputs.get("num_items_in_batch"), world=self.accelerator.num_processes)
        loss = loss * divisor * self._sum_weight  # W / N: TRL's division undone (gradaccum.rl.trl_divisor)
        if coef != 0.0:  # the entropy bonus, weighed over the step's tokens: W / T
            loss = loss - coef * entropy_sum * self._bonus_weight
        return loss if part is None else loss + part  # coef * this micro-batch's part of the step's LBL, times W

    def _window_ends(self, closing: Closing) -> None:
        """The step's LBL over every rank logged as TRL's ``aux_loss``; a skipped step's entropy controller undone."""
        if self._balance is not None:
            total = self.summed_over_ranks(self._balance.total)
            self._metrics["train"]["aux_loss"].append(float(total))  # type: ignore[attr-defined]
        if not closing.steps and self._controller is not None:  # as the last step taken left it, its log gone
            self.entropy_coef, self._last_world_entropy = self._controller  # type: ignore[attr-defined]
            self._controller = None
            logged = self._metrics["train"].get("entropy_coef")  # type: ignore[attr-defined]
            if logged:
                logged.pop()
        super()._window_ends(closing)


def _model_inputs(inputs: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """What TRL's forward of a training micro-batch routes (its prompt and completion, padding masked)."""
    if "pixel_values" in inputs:
        raise ConfigurationError("the MoE router loss over the step is computed from the prompt and completion "
                                 "tokens alone, and this micro-batch holds images (pixel_values): train a multimodal "
                                 "MoE model with router_aux_loss_coef=0.0")
    return {"input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)}


def _loss_mask(inputs: Dict[str, Any]) -> torch.Tensor:
    """The completion tokens TRL's loss counts: ``completion_mask`` times ``tool_mask`` where tools ran."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def _refuse_what_is_not_exact(trainer: Any) -> None:
    """What no weighting makes one big batch, or is not tested here: refused in one line with the fix."""
    name, args = type(trainer).__name__, type(trainer.args).__name__
    loss_type = _loss_type(trainer)
    if loss_type not in ITEMS:
        known = ", ".join(sorted(k for k in ITEMS if k != "rloo"))
        raise NotExactError(f"{name}: loss_type={loss_type!r} is not one gradaccum knows how to make one big batch "
                            f"(supported: {known}); pass {args}(..., loss_type='dapo') or another of them")
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        raise NotExactError(f"{name}: top_entropy_quantile={trainer.top_entropy_quantile} keeps the tokens above a "
                            "quantile of each micro-batch's entropies, which couples the micro-batch's tokens, so no "
                            f"weighting makes the step one big batch; pass {args}(..., top_entropy_quantile=1.0)")
    refuse_untested(trainer, "training with GRPO and RLOO")


class ExactGRPOTrainer(_ExactRL, GRPOTrainer):  # type: ignore[misc]
    """``GRPOTrainer`` whose every optimizer step is one big batch of its ``loss_type``: each micro-batch
    backpropagates its summed terms times ``W / N`` (``W`` processes), so that the step is on the gradient of

        sum_{ranks, k} sum_{i in k} sum_t l_it m_it / d_i  /  N   -   entropy_coef * sum_{ranks,k,i,t} H_it m_it / T

    with ``l_it`` TRL's per-token term (ratio times advantage, plus ``beta`` times the KL term), ``m_it``
    the completion (and tool) mask, ``d_i`` sequence i's tokens ``n_i`` for ``grpo``/``sapo`` (else 1),
    ``T`` the step's completion tokens and ``N`` what the loss type averages over
    (:func:`gradaccum.rl.step_items`: the step's sequences, ``dr_grpo``'s sequences times
    ``max_completion_length``, or ``T``), plus ``coef * LBL`` of the step's whole batch for an MoE model
    (:class:`gradaccum.moe.Routing`). A step of ``N = 0`` is skipped. ``last_step_count`` holds
    the last step's counts, ``accumulator_state`` the steps taken and skipped.

    Raises:
        NotExactError: ``top_entropy_quantile < 1``, a ``loss_type`` not in :data:`gradaccum.rl.ITEMS`,
            an MoE family whose router loss is not computed over the step.
        ConfigurationError: DeepSpeed, FSDP, DataParallel in one process.
    """


class ExactRLOOTrainer(_ExactRL, RLOOTrainer):  # type: ignore[misc]
    """``RLOOTrainer`` whose every optimizer step is ``sum_i l_i / S``, the mean of its per-sequence terms
    over the step's ``S`` sequences on every rank (TRL: each micro-batch's mean, divided by the
    accumulation steps); otherwise as :class:`ExactGRPOTrainer`."""
