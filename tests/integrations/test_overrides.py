"""A user's subclass of a Trainer driver that overrides ``compute_loss`` or ``training_step`` (issue 47):
the most common Trainer customisation, and before this silently a step ``gradient_accumulation_steps``
times too large. Each override is exact or refused: refused where the class is written when it does
not call the driver's method and declares nothing; weighed when it declares what its loss averages
over (``exact_items``); checked in training when it calls ``super()`` and then changes the loss. Against
one float64 step per window (scenarios.py: windows of 3, 3 and 1 micro-batches of padded sequences),
with the stock Trainer under the same override measured beside it.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from integrations import scenarios as S  # noqa: E402
from gradaccum import NotExactError, causal_lm_loss  # noqa: E402
from gradaccum.integrations.hf_trainer import ExactTrainer  # noqa: E402
from hf_helpers import gpt2  # noqa: E402

MICRO = S.rank_micro_batches(0, S.SIZES[0])
WINDOWS = S.windows_of([MICRO], S.ACCUM)


def token_mean(model, inputs):
    """The model's mean next-token loss over the micro-batch's targets, in float64 (outputs.loss is float32)."""
    return causal_lm_loss(model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits,
                          inputs["labels"])[0]


def own_loss(base, **declared):
    """``class Mine(base)`` whose compute_loss is the model's token mean, logged, without ``super()``."""
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = token_mean(model, inputs)
        self.seen = getattr(self, "seen", 0) + 1  # "extra logging"
        return loss

    return type("Mine", (base,), {"compute_loss": compute_loss, **declared})


def test_an_own_compute_loss_without_super_is_refused_where_the_class_is_written():
    """Undeclared, it would be stepped as plain accumulation (GA times too large a step): refused at class
    creation with both fixes; so is a training_step that does not call the driver's."""
    with pytest.raises(TypeError, match=r"class Mine: its compute_loss replaces ExactTrainer's.*"
                                        r"Call super\(\).compute_loss\(model, inputs, return_outputs=return_outputs, "
                                        r"num_items_in_batch=num_items_in_batch\).*exact_items = 'head'"):
        own_loss(ExactTrainer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return torch.tensor(0.0)

    with pytest.raises(TypeError, match=r"its training_step replaces ExactTrainer's, which closes the window.*"
                                        r"super\(\).training_step\(model, inputs, num_items_in_batch\)"):
        type("Stepper", (ExactTrainer,), {"training_step": training_step})
    with pytest.raises(TypeError, match=r"exact_items='tokens': supported are 'head'"):
        own_loss(ExactTrainer, exact_items="tokens")


def test_a_mixin_s_compute_loss_before_the_driver_is_checked_as_the_class_s_own():
    """The compute_loss that runs is checked, wherever it is written: a mixin before ExactTrainer in the bases
    without super() is refused where the class is written; one that calls super() and changes the loss, in
    training; so is a declaration over a compute_loss that calls super(), and one with no compute_loss of its own."""
    class LossMixin:
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss

    class AddsATerm:
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 1.5

    class StepMixin:
        def training_step(self, model, inputs, num_items_in_batch=None):
            return torch.tensor(0.0)

    with pytest.raises(TypeError, match=r"class Mine: LossMixin.compute_loss replaces ExactTrainer's"):
        type("Mine", (LossMixin, ExactTrainer), {})
    with pytest.raises(TypeError, match=r"class Mine: StepMixin.training_step replaces ExactTrainer's"):
        type("Mine", (StepMixin, ExactTrainer), {})
    with pytest.raises(NotExactError, match=r"Tweaked.compute_loss returned another loss"):
        S.hf_fit(S.stock(gpt2()), [MICRO], exact=True, trainer_cls=type("Tweaked", (AddsATerm, ExactTrainer), {}))

    def eval_by_super(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super(Both, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return token_mean(model, inputs)

    with pytest.raises(TypeError, match=r"class Both declares exact_items = 'head' and Both.compute_loss calls "
                                        r"super\(\).compute_loss.*Remove the super\(\) call"):
        Both = type("Both", (ExactTrainer,), {"compute_loss": eval_by_super, "exact_items": "head"})
    with pytest.raises(TypeError, match=r"Lone.exact_items='rows' declares a compute_loss of its own, but the "
                                        r"compute_loss that runs is Trainer's"):
        type("Lone", (ExactTrainer,), {"exact_items": "rows"})


def test_a_declared_own_compute_loss_is_weighed_exactly_where_the_stock_trainer_is_not():
    """``exact_items = "head"``: ExactTrainer calls the override and weighs its mean by the micro-batch's
    targets: the float64 big batch at rtol 1e-10. The stock Trainer under the same override divides by
    the steps (3, 3 and 1 micro-batches): off."""
    from transformers import Trainer

    model = S.stock(gpt2())
    ref = S.reference(model, WINDOWS)
    exact, trainer = S.hf_fit(model, [MICRO], exact=True, trainer_cls=own_loss(ExactTrainer, exact_items="head"))
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert trainer.seen == len(MICRO)  # the override ran on every micro-batch
    stock, _ = S.hf_fit(model, [MICRO], exact=False, trainer_cls=own_loss(Trainer))
    assert S.max_diff(stock, ref) > 1e-4


def test_an_override_that_calls_super_is_exact_and_one_that_changes_its_loss_is_refused():
    """Logging around ``super().compute_loss``: exact. Changing what it returned (a term added per
    micro-batch), or returning without calling it in training: refused at the first micro-batch, before
    its backward (the weights did not move)."""
    def logged(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super(Logged, self).compute_loss(model, inputs, return_outputs=return_outputs,
                                               num_items_in_batch=num_items_in_batch)
        self.logged = getattr(self, "logged", 0) + 1
        return out

    Logged = type("Logged", (ExactTrainer,), {"compute_loss": logged})
    model = S.stock(gpt2())
    ref = S.reference(model, WINDOWS)
    exact, trainer = S.hf_fit(model, [MICRO], exact=True, trainer_cls=Logged)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert trainer.logged == len(MICRO)

    def tweaked(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super(Tweaked, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss + 0.01 * sum(p.pow(2).sum() for p in model.parameters())

    def sidestepped(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super(Sidestepped, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return token_mean(model, inputs)

    Tweaked = type("Tweaked", (ExactTrainer,), {"compute_loss": tweaked})
    Sidestepped = type("Sidestepped", (ExactTrainer,), {"compute_loss": sidestepped})
    for cls, did in ((Tweaked, "returned another loss than the one super"),
                     (Sidestepped, "returned without calling super")):
        with pytest.raises(NotExactError, match=rf"{cls.__name__}.compute_loss {did}.*exact_items = 'head'"):
            S.hf_fit(model, [MICRO], exact=True, trainer_cls=cls)


def test_the_trl_and_sentence_transformers_drivers_refuse_an_own_compute_loss_too():
    """The same check for every driver: a compute_loss of one's own without super() is refused where the
    class is written (GRPO/RLOO and sentence-transformers take no declaration: their loss is the driver's)."""
    pytest.importorskip("trl")
    from gradaccum.integrations.trl import ExactGRPOTrainer, ExactSFTTrainer

    with pytest.raises(TypeError, match=r"its compute_loss replaces ExactSFTTrainer's.*exact_items = 'head'"):
        own_loss(ExactSFTTrainer)
    with pytest.raises(TypeError, match=r"its compute_loss replaces ExactGRPOTrainer's.*and return what it returns$"):
        own_loss(ExactGRPOTrainer)
    pytest.importorskip("sentence_transformers")
    from gradaccum.integrations.sentence_transformers import ExactSentenceTransformerTrainer

    with pytest.raises(TypeError, match=r"replaces ExactSentenceTransformerTrainer's"):
        own_loss(ExactSentenceTransformerTrainer)


def test_a_class_weighted_mean_is_one_big_batch_as_the_window_loss_the_refusals_name():
    """``cross_entropy(weight=class_weights)`` divides by the batch's summed weights, not its rows: declared
    ``exact_items = "rows"`` it trains away from one big batch (a probe: 0.18 after one window), so the
    refusals name a ``WindowLoss`` for it, and ``ExactTrainer(compute_loss_func=WindowLoss(...))`` is one big
    batch's at rtol 1e-10 (BERT, windows of 3, 3 and 1 micro-batches of 1 to 3 rows)."""
    import copy
    import functools

    from gradaccum import WindowLoss
    from integrations import heads as H

    weights = torch.tensor([1.0, 5.0, 0.2], dtype=torch.float64)
    logits = lambda m, b: m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # noqa: E731
    weighted = lambda z, y: torch.nn.functional.cross_entropy(z, y, weight=weights)  # noqa: E731
    model, mbs = H.bert("single_label"), H.micro_batches("single_label", S.SIZES[0], seed=1)
    g = torch.Generator().manual_seed(3)
    for mb in mbs:
        mb["labels"] = torch.randint(0, 3, mb["labels"].shape, generator=g)
    ref = copy.deepcopy(model)
    opt, sched = S.make_optimizer(ref.parameters())
    for w in range(0, len(mbs), S.ACCUM):
        opt.zero_grad(set_to_none=True)
        whole = H.join(mbs[w:w + S.ACCUM])
        weighted(logits(ref, whole), whole["labels"]).backward()
        opt.step()
        sched.step()
    window_loss = WindowLoss(lambda m, b: {"logits": logits(m, b), "labels": b["labels"]},
                             lambda m, r: weighted(r["logits"], r["labels"]))
    exact, _ = S.hf_fit(model, [mbs], exact=True, trainer_cls=functools.partial(ExactTrainer,
                                                                               compute_loss_func=window_loss))
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return weighted(logits(model, inputs), inputs["labels"])

    with pytest.raises(TypeError, match=r"'rows' \(the batch's rows; not for a class-weighted mean.*WindowLoss"):
        type("Weighted", (ExactTrainer,), {"compute_loss": compute_loss})  # undeclared: refused, naming both
    rows = type("Weighted", (ExactTrainer,), {"exact_items": "rows", "compute_loss": compute_loss})
    declared, _ = S.hf_fit(model, [mbs], exact=True, trainer_cls=rows)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    assert S.max_diff(declared, ref) > 1e-3


def test_a_training_step_that_skips_super_for_a_micro_batch_is_refused_before_the_step():
    """A probe: a training_step override that returns zeros for long inputs (not calling super()) left those
    micro-batches' items in the window's N (0.13 off one big batch, as the stock Trainer), the window never
    closed, and a nan in a later window was stepped on. Refused at the window's step, before any parameter moves."""
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen == 2:  # the first window's second micro-batch: "too long"
            return torch.zeros(())
        return super(Skipping, self).training_step(model, inputs, num_items_in_batch)

    Skipping = type("Skipping", (ExactTrainer,), {"training_step": training_step})
    model = gpt2()
    with pytest.raises(NotExactError, match=r"Skipping: the Trainer's loop reached the window's optimizer step after 2 "
                                            r"of its 3 micro-batches went through Skipping.training_step"):
        S.hf_fit(model, [MICRO], exact=True, trainer_cls=Skipping)


def test_labels_changed_before_super_are_refused_at_the_first_micro_batch():
    """An override that masks each sequence's first targets (a prompt) and then returns ``super().compute_loss``
    unchanged: the window's N was counted from the collated labels, so every step was off by their ratio (a
    probe: 0.17 after one window, as the stock Trainer under the same override). Refused at the first
    micro-batch, before its backward, naming the data collator; the same mask in the collator trains (its
    exactness on labels with -100 anywhere is the padded windows' of test_hf_trainer.py)."""
    def masked(inputs):
        labels = inputs["labels"].clone()
        labels[:, :3] = -100
        return {**inputs, "labels": labels}

    def in_place(inputs):  # a second probe: masked in place, the collated tensors are the handed ones (the CPU)
        inputs["labels"][:, :3] = -100
        return inputs

    for mask in (masked, in_place):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, mask=mask):
            return super(Masking, self).compute_loss(model, mask(inputs), return_outputs=return_outputs,
                                                     num_items_in_batch=num_items_in_batch)

        Masking = type("Masking", (ExactTrainer,), {"compute_loss": compute_loss})
        model = gpt2()
        with pytest.raises(NotExactError, match=r"Masking.compute_loss was handed \d+ items where the window counted "
                                                r"\d+ .*in the data collator"):
            S.hf_fit(model, [[{k: v.clone() for k, v in mb.items()} for mb in MICRO]], exact=True,
                     trainer_cls=Masking)
    _, trainer = S.hf_fit(model, [[masked(mb) for mb in MICRO]], exact=True)
    assert trainer.state.global_step == len(WINDOWS)
