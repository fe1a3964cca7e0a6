"""Hugging Face ``Trainer`` and ``ExactTrainer`` on one process, against one float64 step per window.

Data (scenarios.py): 7 micro-batches of 1-3 padded sequences (3-30 tokens), one micro-batch per
dataset item (batch size 1, a collator that unwraps), ``gradient_accumulation_steps=3``: windows of
3, 3 and 1 micro-batches (short last window); SGD with momentum and a LambdaLR schedule passed in.
Two models the stock Trainer gets wrong: GPT-2 as ``GPT2LMHeadModel(config)`` builds it (``loss_type``
None: it counts the unshifted labels) and Llama behind a ``forward`` with no ``**kwargs`` (it
divides by the steps). The other heads (heads.py: tiny BERT classifiers) against the model's own loss
over each window as one batch; a window without items; the evaluation loss over the whole set.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from integrations import heads as H  # noqa: E402
from integrations import scenarios as S  # noqa: E402
from gradaccum import causal_lm_loss, count_targets  # noqa: E402
from gradaccum.integrations.hf_trainer import ExactTrainer  # noqa: E402
from hf_helpers import gpt2, llama, pad, unpad  # noqa: E402

MICRO = S.rank_micro_batches(0, S.SIZES[0])
WINDOWS = S.windows_of([MICRO], S.ACCUM)
MODELS = {"gpt2-stock-loss-type": lambda: S.stock(gpt2()), "llama-plain-forward": lambda: S.PlainForward(llama())}
HEAD = {"llama-plain-forward": "causal_lm"}  # a model class ExactTrainer cannot name


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", list(MODELS))
def test_exact_where_the_stock_trainer_is_not(name, clip):
    """Params equal the reference at rtol 1e-10 (Llama's float32 RMSNorm included: the window's N is
    known before its first backward); the stock Trainer is off by more than 1e-6; the logged loss of
    every step is the window's mean token loss (to the float32 the Trainer logs in); global_step counts windows."""
    model = MODELS[name]()
    ref = S.reference(model, WINDOWS, clip=clip)
    exact, trainer = S.hf_fit(model, [MICRO], exact=True, clip=clip, head=HEAD.get(name))
    stock, _ = S.hf_fit(model, [MICRO], exact=False, clip=clip)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    if clip is not None and name.startswith("gpt2"):
        # the stock Trainer's GPT-2 error is a uniform 0.943x, which a clip that engages rescales away
        assert S.max_diff(stock, ref) < 1e-6
    else:
        assert S.max_diff(stock, ref) > 1e-6
    assert trainer.state.global_step == len(WINDOWS) == 3
    assert trainer.last_window_items == count_targets(pad(WINDOWS[-1])["labels"])
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx(ref.window_losses, rel=1e-6)  # the Trainer sums its log in float32
    if clip is not None:  # the clip engaged: the pre-clip norms it logged exceed the limit
        assert all(h["grad_norm"] > 2 * clip for h in trainer.state.log_history if "grad_norm" in h)


def test_checkpoint_resume_is_the_uninterrupted_run(tmp_path):
    """A checkpoint after every step; resuming from step 1 of 3 gives the same parameters, bit for bit,
    as the run that never stopped (counts, optimizer and scheduler state come back)."""
    model = S.stock(gpt2())
    straight, _ = S.hf_fit(model, [MICRO], exact=True, out=str(tmp_path / "a"), save=True)
    resumed, trainer = S.hf_fit(model, [MICRO], exact=True, out=str(tmp_path / "b"),
                                resume=str(tmp_path / "a" / "checkpoint-1"))
    assert trainer.state.global_step == 3
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))


@pytest.mark.parametrize("kind", list(H.KINDS))
def test_every_head_is_exact(kind):
    """Sequence classification (single-label with ignored labels, regression with num_labels=1,
    multi-label) and token classification: ExactTrainer equals one step per window on the model's own
    loss over the window (rtol 1e-10); the stock Trainer, whose heads take **kwargs so that it neither
    divides by the accumulation steps nor passes a count the head uses, takes about K times the step."""
    model, micro = H.bert(kind), H.micro_batches(kind, S.SIZES[0])
    ref = H.reference(model, micro)
    exact, trainer = S.hf_fit(model, [micro], exact=True)
    stock, _ = S.hf_fit(model, [micro], exact=False)
    assert trainer.head == ("token_classification" if kind == "token" else "sequence_classification")
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert S.max_diff(stock, ref) > 1e-3


def test_a_window_without_items_is_skipped(tmp_path):
    """A window whose every label is -100 (float64 GPT-2, AdamW with weight decay): no optimizer step (the
    weights equal a reference that never saw the window, so weight decay did not move them), no scheduler
    step, global_step not advanced, no checkpoint for it, skipped counts it. Resuming from the
    checkpoint after it skips its data too (bit-identical to the straight run). The stock Trainer steps on it."""
    micro = S.rank_micro_batches(0, [2, 3, 1, 2, 3, 1, 2, 2, 1, 3])  # windows of 3, 3, 3 and 1
    for mb in micro[3:6]:
        mb["labels"] = torch.full_like(mb["labels"], -100)
    windows = [w for i, w in enumerate(S.windows_of([micro], S.ACCUM)) if i != 1]
    model = S.stock(gpt2())
    ref = S.reference(model, windows, optimizer=adamw)
    exact, trainer = S.hf_fit(model, [micro], exact=True, optimizer=adamw, out=str(tmp_path / "a"), save=True)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert trainer.state.global_step == 3 and trainer.skipped == 1
    assert trainer.lr_scheduler.last_epoch == 3
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == [f"checkpoint-{i}" for i in (1, 2, 3)]
    saved = json.loads((tmp_path / "a" / "checkpoint-1" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["TrainerWindowState"]["attributes"]["saved"]["skipped"] == 0  # not saved again by the skip
    kept = json.loads((tmp_path / "a" / "checkpoint-2" / "trainer_state.json").read_text())
    assert {k: v for k, v in kept["stateful_callbacks"]["TrainerWindowState"]["attributes"]["saved"].items()
            if k in ("steps", "skipped")} == {"steps": 2, "skipped": 1}  # the skip is in the checkpoint after it
    resumed, again = S.hf_fit(model, [micro], exact=True, optimizer=adamw, out=str(tmp_path / "b"),
                              resume=str(tmp_path / "a" / "checkpoint-2"))
    assert again.state.global_step == 3 and again.skipped == 1
    assert all(torch.equal(p, q) for p, q in zip(exact.parameters(), resumed.parameters()))
    stock, _ = S.hf_fit(model, [micro], exact=False, optimizer=adamw)
    assert not S.max_diff(stock, ref) < 1e-6  # nan, or a step on the empty window


def adamw(params):
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def test_evaluation_loss_is_the_item_weighted_mean_over_the_set():
    """eval_loss is the mean over every target of the evaluation set (rtol 1e-12), not the Trainer's mean
    of batch means weighted by the batch size."""
    model = S.stock(gpt2())
    exact = S.hf_fit(model, [MICRO], exact=True, max_steps=1, per_device_eval_batch_size=1)[1]
    stock = S.hf_fit(model, [MICRO], exact=False, max_steps=1, per_device_eval_batch_size=1)[1]
    every = pad([s for mb in MICRO for s in unpad(mb)])
    exact.model.eval()
    with torch.no_grad():
        ref = causal_lm_loss(S.lm_logits(exact.model, every), every["labels"])[0].item()
    got = exact.evaluate(S.ListDataset(MICRO))["eval_loss"]
    assert got == pytest.approx(ref, rel=1e-12)
    assert stock.evaluate(S.ListDataset(MICRO))["eval_loss"] != pytest.approx(ref, rel=1e-4)


def test_evaluation_loss_is_the_batch_mean():
    model = S.stock(gpt2()).eval()
    trainer = S.hf_fit(model, [MICRO], exact=True, max_steps=1)[1]
    mb = MICRO[1]
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(mb))
        ref = S.causal_lm_loss(S.lm_logits(trainer.model, mb), mb["labels"])[0]
    assert loss.dtype == torch.float64 and torch.allclose(loss, ref, rtol=1e-14, atol=0)


def test_errors_name_the_argument_and_the_fix():
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="compute_loss_func"):
        ExactTrainer(model=gpt2(), args=args, compute_loss_func=lambda *a, **k: 0)
    trainer = ExactTrainer(model=gpt2(), args=args)
    with pytest.raises(ValueError, match="no 'labels'"):
        trainer.get_batch_samples(iter([{"input_ids": torch.zeros(1, 3, dtype=torch.long)}]), 1)
    with pytest.raises(ValueError, match=r"cannot tell the head of PlainForward; pass head= one of causal_lm"):
        ExactTrainer(model=S.PlainForward(gpt2()), args=args)
    with pytest.raises(ValueError, match=r"head='seq2seq'\): supported heads are causal_lm"):
        ExactTrainer(model=gpt2(), args=args, head="seq2seq")


def test_a_head_that_does_not_fit_the_model_is_refused_naming_it_and_the_head_that_fits():
    """ExactTrainer(head="causal_lm") on a sequence classifier failed at the first batch, frames deep in the loss's
    shapes; it is refused when the trainer is built, naming head=, the model's class and the head that fits. The
    head the class has passes, and so does any head of a model whose class the Auto mappings do not name."""
    from transformers import TrainingArguments

    from gradaccum import ConfigurationError

    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    with pytest.raises(ConfigurationError) as info:
        ExactTrainer(model=H.bert("single_label"), args=args, head="causal_lm")
    assert str(info.value) == (
        "ExactTrainer(head='causal_lm') does not fit the model, a BertForSequenceClassification, whose head is "
        "sequence_classification (its logits and labels are shaped for that head, not for causal_lm): pass "
        "head='sequence_classification', or leave head= out (ExactTrainer reads it from the model's class)")
    with pytest.raises(ConfigurationError, match=r"^ExactTrainer\(head='token_classification'\) does not fit the "
                                                 r"model, a GPT2LMHeadModel, whose head is causal_lm"):
        ExactTrainer(model=gpt2(), args=args, head="token_classification")
    fits = ExactTrainer(model=H.bert("single_label"), args=args, head="sequence_classification")
    assert fits.head == "sequence_classification"
    assert ExactTrainer(model=S.PlainForward(gpt2()), args=args, head="causal_lm").head == "causal_lm"


@pytest.mark.parametrize("ignore_index", ["x", None, 0.5, True])
def test_an_ignore_index_that_is_not_an_int_is_refused_as_the_trainer_is_built(ignore_index):
    """A probe: ExactTrainer(ignore_index="x") was built, and failed at the first count, deep in the maths."""
    from transformers import TrainingArguments

    from gradaccum import ConfigurationError

    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    with pytest.raises(ConfigurationError, match=rf"^ExactTrainer\(ignore_index={ignore_index!r}\) must be an int: "
                                                 "the label value the data collator pads with"):
        ExactTrainer(model=gpt2(), args=args, ignore_index=ignore_index)


def test_windows_skipped_under_max_steps_are_said_when_the_run_ends_short():
    """A probe: windows of no item are skipped and global_step does not count them, so a run sized by max_steps
    ended a step short (its schedule not run out), without a word. The run ends with a warning naming both."""
    empty = {k: v.clone() for k, v in MICRO[0].items()}
    empty["labels"][:] = -100
    data = [MICRO[0], MICRO[1], MICRO[2], empty, empty, empty, MICRO[3], MICRO[4], MICRO[5]]
    with pytest.warns(UserWarning, match=r"took 2 optimizer steps of max_steps=3: 1 windows were skipped"):
        _, trainer = S.hf_fit(gpt2(), [data], exact=True, max_steps=3)
    assert trainer.state.global_step == 2 and trainer.skipped == 1

    from transformers import TrainerCallback

    class StopAfterOne(TrainerCallback):  # early stopping: a run a callback ends is short on purpose (a review)
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 1

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, stopped = S.hf_fit(gpt2(), [[empty, empty, empty] + data[:6]], exact=True, max_steps=3,
                              callbacks=[StopAfterOne()])
    assert stopped.state.global_step == 1 and stopped.skipped == 1


@pytest.mark.parametrize("head", ["causal_lm", "token_classification"])
def test_a_token_head_on_a_model_whose_logits_are_one_per_row_is_refused_at_the_first_micro_batch(head):
    """A probe: a class the Auto mappings do not name (here PlainForward around a sequence classifier) takes any
    head=; head="causal_lm" on one whose logits are one row per example trained in silence (7.2e-3 off, worse
    than the stock Trainer), pairing each row's logits with the next row's label. Refused, naming the shapes."""
    from gradaccum import ConfigurationError

    model = S.PlainForward(H.bert("single_label"))
    with pytest.raises(ConfigurationError, match=rf"ExactTrainer\(head='{head}'\): the model's logits \(\d+, 3\) "
                                                 r"and its labels \(\d+,\)"):
        S.hf_fit(model, [H.micro_batches("single_label", [2, 3, 1])], exact=True, head=head)


def test_a_trainer_subclass_before_exact_trainer_is_refused_with_the_fix():
    """Another Trainer before ExactTrainer in the MRO would run its compute_loss with ExactTrainer's
    window count; a compute_loss whose reduction is unknown cannot be weighted. Both refused where
    the class is written; a declared one (exact_items = "rows") is accepted."""
    from transformers import Trainer

    class Mine(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(TypeError, match=r"Write class Wrong\(ExactTrainer, Mine\)"):
        type("Wrong", (Mine, ExactTrainer), {})
    with pytest.raises(TypeError, match=r"cannot tell how Mine.compute_loss reduces.*exact_items = 'rows'"):
        type("Unknown", (ExactTrainer, Mine), {})
    assert type("Declared", (ExactTrainer, Mine), {"exact_items": "rows"})


def stand_in(stack: str, base: type = ExactTrainer) -> type:
    """``base`` with the Trainer's flag for ``stack`` ("fsdp1", "fsdp2", "deepspeed") raised as the Trainer
    raises it from TrainingArguments(fsdp=..., deepspeed=...), without the rest: deepspeed is not a test
    dependency (see docs/guides/hf-trainer.md) and Accelerate's FSDP1 plugin needs an accelerator."""
    import types

    class StandIn(base):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if stack == "deepspeed":
                self.is_deepspeed_enabled = True
            else:
                self.is_fsdp_enabled = True
                self.accelerator.state.fsdp_plugin = types.SimpleNamespace(fsdp_version=int(stack[-1]))

    StandIn.__name__ = StandIn.__qualname__ = base.__name__  # as the user's class is named in the message
    return StandIn


def declared_rows() -> type:
    """A Trainer subclass whose own compute_loss returns a mean over the rows, declared to ExactTrainer."""
    from transformers import Trainer

    class Mine(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return type("ExactMine", (ExactTrainer, Mine), {"exact_items": "rows"})


REFUSALS = {
    "fsdp1": (ExactTrainer, r"FSDP with fsdp_version=1 is not supported .*use fsdp_version=2: "
                            r"fsdp_config=\{'fsdp_version': 2\}"),
    "deepspeed": (ExactTrainer, r"ExactTrainer under DeepSpeed: the engine manages gradient accumulation itself.*"
                                r"add \"managed_gradient_accumulation\": false to the DeepSpeed config"),
    "fsdp2": (declared_rows(), r"FSDP2 is tested where ExactTrainer computes the model's loss, not under "
                               r"ExactMine's own compute_loss \(items: rows\); train it with DDP"),
}


@pytest.mark.parametrize("stack", list(REFUSALS))
def test_sharded_stacks_not_tested_are_refused_with_the_fix(stack):
    """FSDP1 (fsdp_version=1), DeepSpeed managing its own accumulation, and FSDP2 under a trainer's own
    compute_loss (TRL's, or one declared with exact_items) are refused in one line that names the fix,
    before any training; FSDP2 where ExactTrainer computes the loss is tested in test_distributed.py, and
    DeepSpeed with a caller-owned boundary in tests/distributed/test_deepspeed.py."""
    from transformers import TrainingArguments

    base, message = REFUSALS[stack]
    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    with S.fsdp_state_restored(), pytest.raises(ValueError, match=message):
        stand_in(stack, base)(model=gpt2(), args=args)


@pytest.mark.parametrize("n_gpu, deepspeed, fsdp, tp, named", [
    (2, False, False, 1, "n_gpu=2 (DataParallel in one process"), (1, True, False, 1, "DeepSpeed"),
    (1, False, True, 1, "FSDP"), (2, True, True, 1, "n_gpu=2 (DataParallel"),
    (1, False, False, 2, "tp_size=2 (one batch held by several processes)")])
def test_a_stack_a_path_is_not_tested_under_is_refused_naming_it_and_the_fix(n_gpu, deepspeed, fsdp, tp, named):
    """The one refusal of an untested stack (GRPO/RLOO, a WindowLoss, ExactTrainer's DataParallel, and
    tensor parallelism, which every driver refuses) names the driver, the path, the stack and DDP as the
    fix; a stack a path is tested under passes."""
    import re
    from types import SimpleNamespace

    from gradaccum.errors import ConfigurationError
    from gradaccum.integrations.hf_driver import refuse_untested

    class ExactGRPOStandIn:
        args = SimpleNamespace(n_gpu=n_gpu)
        is_deepspeed_enabled, is_fsdp_enabled = deepspeed, fsdp
        accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(tp_size=tp, cp_size=None, sp_size=1))

    with pytest.raises(ConfigurationError, match=rf"^ExactGRPOStandIn: training with GRPO and RLOO is not tested here "
                                                 rf"under {re.escape(named)}.*; train with DDP \(one process per device"):
        refuse_untested(ExactGRPOStandIn(), "training with GRPO and RLOO")
    if n_gpu == 1 and tp == 1:
        refuse_untested(ExactGRPOStandIn(), "training", deepspeed=False, fsdp=False)  # ExactTrainer's own check
    elif tp > 1:
        with pytest.raises(ConfigurationError, match="tp_size=2"):
            refuse_untested(ExactGRPOStandIn(), "training", deepspeed=False, fsdp=False)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["norm-for-the-log", "norm-for-the-clip"])
def test_a_window_whose_loss_is_not_finite_is_skipped(clip):
    """Micro-batch 4 (window 1 of 3) gives nan logits, so its loss and the window's gradient are nan (float64
    GPT-2, AdamW with weight decay). ExactTrainer skips that window, read from the norm the Trainer measures
    anyway (for its clip, or for its log): the parameters equal a reference that never saw the window
    (rtol 1e-10; weight decay did not move them), no scheduler step, global_step not advanced, skipped
    counts it, one warning. The stock Trainer steps on it and ends with nan parameters."""
    windows = [w for i, w in enumerate(WINDOWS) if i != 1]
    model = S.stock(gpt2())
    ref = S.reference(model, windows, clip=clip, optimizer=adamw)
    model.lm_head.register_forward_hook(S.NanOnCall(4))
    with pytest.warns(UserWarning, match=r"ExactTrainer: a window's gradient was not finite \(norm nan\)") as said:
        exact, trainer = S.hf_fit(model, [MICRO], exact=True, clip=clip, optimizer=adamw)
    assert len([w for w in said if "not finite" in str(w.message)]) == 1
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert trainer.state.global_step == 2 and trainer.skipped == 1 and trainer.accumulator_state.steps == 2
    assert trainer.lr_scheduler.last_epoch == 2
    stock, _ = S.hf_fit(model, [MICRO], exact=False, clip=clip, optimizer=adamw)
    assert not S.all_finite(stock)


def test_nonfinite_raise_stops_at_the_window_naming_it_and_the_fix():
    """``nonfinite = "raise"`` (a class attribute here; ``nonfinite=`` is the argument): FloatingPointError
    at the window whose gradient is nan, before its step, naming the window and the fix. A value other than
    'skip' and 'raise' is refused naming the argument, the value and the fix, before the Trainer is built."""
    class Raising(ExactTrainer):
        nonfinite = "raise"

    model = S.stock(gpt2())
    model.lm_head.register_forward_hook(S.NanOnCall(4))
    with pytest.raises(FloatingPointError, match=r"Raising: the gradient of window 2 of this run \(after 1 optimizer "
                                                 r"steps.*has the norm nan.*Raising\(nonfinite='skip'\)"):
        S.hf_fit(model, [MICRO], exact=True, optimizer=adamw, trainer_cls=Raising)
    with pytest.raises(ValueError, match=r"ExactTrainer\(nonfinite='ignore'\): nonfinite must be 'skip' .* or 'raise'"):
        ExactTrainer(model=gpt2(), nonfinite="ignore")
