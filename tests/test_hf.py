"""Hugging Face transformers as a client we did not write (#10): tiny GPT-2 and Llama, random init,
dropout 0, float64, on right-padded variable-length batches, against one float64 full-batch step.

Every window is a list of micro-batches, each padded to its own longest sequence, so micro-batches
hold different numbers of target tokens; two windows in a row (7 sequences, then 3) make the windows
uneven too and carry optimizer state over.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from gradaccum import Accumulator, count_targets, num_steps  # noqa: E402
from helpers import RTOL, assert_params_close, make_optimizer  # noqa: E402
from hf_helpers import (gpt2, llama, lm_loss, micro_batches, naive_step, pad, reference_step,  # noqa: E402
                        sequences, unpad, update_error)

# two windows of sequences of different lengths: 7 sequences (37 tokens), then 3 (14)
WINDOWS = [sequences([9, 3, 6, 2, 8, 5, 4], seed=1), sequences([7, 2, 5], seed=2)]
# how each window is cut into micro-batches (sequences per micro-batch)
SPLITS = {
    "1-each": ([1] * 7, [1, 1, 1]),
    "2-2-2-1": ([2, 2, 2, 1], [2, 1]),
    "3-4": ([3, 4], [1, 2]),
    "whole": ([7], [3]),
}
MULTI = [name for name, (a, b) in SPLITS.items() if len(a) > 1]


def count(mb) -> int:
    return count_targets(mb["labels"])


def run_pair(make, split: str, opt_name: str, *, num_items=None, loss_fn=lm_loss, prepare=None, loss_rel=1e-12):
    """(accumulated model, reference model, start): the same two windows, both ways."""
    model = make()
    if prepare is not None:
        prepare(model)
    start = copy.deepcopy(model)
    ref = make()
    acc = Accumulator(model, make_optimizer(opt_name, model.parameters()))
    ref_opt = make_optimizer(opt_name, ref.parameters())
    for window, cut in zip(WINDOWS, SPLITS[split]):
        result = acc.step(micro_batches(window, cut), loss_fn, num_items=num_items)
        ref_loss = reference_step(ref, ref_opt, window)
        assert result.loss == pytest.approx(ref_loss, rel=loss_rel)
        assert result.num_items == count_targets(pad(window)["labels"])
    assert acc.steps == 2
    return model, ref, start


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_gpt2_causal_lm_loss_is_exact(split, opt_name):
    """``causal_lm_loss(outputs.logits, labels)`` weighs each micro-batch by its target tokens."""
    model, ref, _ = run_pair(gpt2, split, opt_name)
    assert_params_close(model, ref)


@pytest.mark.parametrize("split", MULTI)
def test_gpt2_naive_loop_is_measurably_not_exact(split):
    """The peers' ``loss / K`` loop on the same micro-batches is off by percent, not by 1e-10."""
    model, ref, start = gpt2(), gpt2(), gpt2()
    opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", ref.parameters())
    for window, cut in zip(WINDOWS, SPLITS[split]):
        naive_step(model, opt, micro_batches(window, cut))
        reference_step(ref, ref_opt, window)
    assert update_error(model, ref, start) > 1e-3  # 1e7 times the tolerance the Accumulator meets


def test_gpt2_tied_weights_stay_tied_and_exact():
    """lm_head and wte are one tensor: it gets one gradient, scaled once, stepped once. The counts come
    from loss_fn, so the second window's gradient is rescaled at the boundary (R / N != 1)."""
    model, ref, _ = run_pair(gpt2, "2-2-2-1", "adamw")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    assert_params_close(model, ref)


def test_gpt2_frozen_embeddings_stay_put_and_the_rest_is_exact():
    """wte (tied to lm_head) and wpe frozen, the optimizer built over all parameters with weight decay,
    as users do: the frozen ones never get a gradient and do not move by a bit."""
    def freeze(m):
        m.transformer.wte.weight.requires_grad_(False)
        m.transformer.wpe.weight.requires_grad_(False)

    def make():
        m = gpt2()
        freeze(m)
        return m

    model, ref, start = run_pair(make, "3-4", "adamw")
    for name in ("transformer.wte.weight", "transformer.wpe.weight"):
        p, s = model.get_parameter(name), start.get_parameter(name)
        assert p.grad is None and torch.equal(p, s), name
    assert_params_close(model, ref)


def enable_checkpointing(model) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("make, first", [(gpt2, lambda m: m.transformer.h[0].ln_1),
                                         (llama, lambda m: m.model.layers[0].input_layernorm)],
                         ids=["gpt2", "llama"])
def test_gradient_checkpointing_is_exact(make, first):
    """Non-reentrant checkpointing recomputes each block in backward (counted: the block's first module
    runs twice per micro-batch) and the step still equals one big batch without checkpointing."""
    calls = []

    def prepare(m):
        enable_checkpointing(m)
        first(m).register_forward_pre_hook(lambda *args: calls.append(1))

    model, ref, _ = run_pair(make, "2-2-2-1", "sgd", num_items=count, prepare=prepare)
    assert len(calls) == 2 * (4 + 2), "checkpointing did not recompute the block in backward"
    assert_params_close(model, ref)


def test_linear_warmup_schedule_steps_once_per_optimizer_step():
    """transformers' ``get_linear_schedule_with_warmup`` sized by ``num_steps`` and given as
    ``scheduler=``: one step per window, the short last window included, and the same learning rates
    as the reference."""
    from transformers import get_linear_schedule_with_warmup

    loader = [pad(s) for s in (WINDOWS[0][:2], WINDOWS[0][2:3], WINDOWS[0][3:5], WINDOWS[0][5:],
                               WINDOWS[1][:2], WINDOWS[1][2:], WINDOWS[0][:3], WINDOWS[1])]
    accum = 3
    total = num_steps(len(loader), accum)
    assert total == 3  # 3 + 3 + 2 micro-batches

    def schedule(opt):
        return get_linear_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=total + 1)

    model, ref = gpt2(), gpt2()
    opt, ref_opt = make_optimizer("adamw", model.parameters()), make_optimizer("adamw", ref.parameters())
    sched, ref_sched = schedule(opt), schedule(ref_opt)
    results = list(Accumulator(model, opt, scheduler=sched).train(loader, lm_loss, accum_steps=accum))
    ref_lrs = []
    for w in range(total):
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        window = [s for mb in loader[w * accum:(w + 1) * accum] for s in unpad(mb)]
        reference_step(ref, ref_opt, window, ref_sched)
    assert [r.lr for r in results] == ref_lrs and ref_lrs[0] == 0.0 and len(set(ref_lrs)) == 3
    assert sched.last_epoch == ref_sched.last_epoch == total
    assert_params_close(model, ref)


@pytest.mark.parametrize("split", list(SPLITS))
def test_llama_exact_when_token_counts_are_known_up_front(split):
    """Llama's RMSNorm computes in float32 even in a float64 model.

    Its float32 part rounds the same as in the full batch only when the gradient reaching it is the
    full batch's, i.e. when every micro-batch's backward weighs exactly ``tokens_k / tokens`` from the
    start. ``num_items=count_targets`` gives the Accumulator the window's token count before the first
    backward, so it does: agreement to ~1e-15. With the counts coming from ``loss_fn`` only, the
    backward weighs ``tokens_k / R`` (R a reference count) and one exact rescaling follows, which is
    exact in float64 but lets the float32 RMSNorm round differently: ~1e-6 from the full batch.
    """
    model, ref, _ = run_pair(llama, split, "adamw", num_items=count)
    assert_params_close(model, ref)


def test_the_hf_models_guides_table_is_what_a_llama_measures_with_and_without_counts_up_front():
    """docs/guides/hf-models.md's table: a tiny float64 Llama (RMSNorm in float32) stepped with and without
    ``num_items=count_targets``, under SGD and AdamW. With the counts up front the step is the big batch's;
    without them the boundary's rescale lets the float32 part round otherwise, which AdamW amplifies. The
    first row is float64 rounding (AdamW amplifies it to about 1e-14), whose last digits are the CPU's: quoted
    and measured need only both be below 1e-10. The second is float32 rounding, which another CPU's kernels round
    otherwise: its cells need only be within 2x of this measurement."""
    from transcripts import DOCS

    measured = {}
    for row, num_items in (("with `num_items=count_targets`", count), ("without `num_items`", None)):
        for opt_name in ("sgd", "adamw"):
            model, ref, start = run_pair(llama, "2-2-2-1", opt_name, num_items=num_items, loss_rel=1e-6)
            measured[row, opt_name] = update_error(model, ref, start)
    assert max(measured["with `num_items=count_targets`", o] for o in ("sgd", "adamw")) < RTOL, measured
    assert measured["without `num_items`", "adamw"] > 1e-7 and measured["without `num_items`", "sgd"] > 1e-9, measured
    lines = (DOCS / "guides" / "hf-models.md").read_text().splitlines()
    for row in ("with `num_items=count_targets`", "without `num_items`"):
        cells = next(line for line in lines if line.startswith(f"| {row} |")).strip("| ").split(" | ")[1:]
        if row.startswith("with "):
            assert all(float(q) < RTOL for q in cells), cells
        else:
            assert all(0.5 < measured[row, o] / float(q) < 2 for q, o in zip(cells, ("sgd", "adamw"))), (cells, measured)


def test_hf_outputs_loss_is_float32_while_causal_lm_loss_on_the_logits_is_exact():
    """Issue item 8, still so in transformers 5.23: in a float64 model ``outputs.loss`` comes back
    float32 (its loss upcasts logits with ``.float()``, which *down*casts float64), so a ``loss_fn``
    built on it is exact only to float32's ~1e-8. ``causal_lm_loss`` on the float64 logits is exact."""
    model = gpt2()
    mb = pad(WINDOWS[1])
    out = model(**mb)
    assert out.logits.dtype == torch.float64 and out.loss.dtype == torch.float32

    def hf_loss(m, mb):  # a bare mean over the targets; num_items= weighs it by them
        return m(**mb).loss

    errors = {}
    for name, loss_fn in (("causal_lm_loss", lm_loss), ("outputs.loss", hf_loss)):
        model, ref, start = run_pair(gpt2, "2-2-2-1", "sgd", num_items=count, loss_fn=loss_fn, loss_rel=1e-6)
        errors[name] = update_error(model, ref, start)
    assert errors["causal_lm_loss"] < RTOL, errors
    assert 10 * RTOL < errors["outputs.loss"] < 1e-5, errors  # float32's rounding: ~1e-7


def hf_loss(m, mb):
    """A Hugging Face model's own loss: a bare mean over the micro-batch's targets."""
    return m(**mb).loss


def test_hf_outputs_loss_on_padded_batches_without_num_items_is_refused_before_any_backward():
    """Issue 47: ``acc.step(window, lambda m, b: m(**b).loss)`` on padded micro-batches would weigh each
    by its rows, not its targets. Refused before the first backward (nothing moved, no gradient), with
    the fix; the fix is exact, and saying "rows" runs the off step the refusal saves the user from."""
    from gradaccum import NotExactError

    model = gpt2()
    start = copy.deepcopy(model)
    acc = Accumulator(model, make_optimizer("sgd", model.parameters()))
    with pytest.raises(NotExactError, match=r"labels' hold the ignore index -100.*num_items=lambda mb: "
                                            r"gradaccum.count_targets\(mb\['labels'\]\).*num_items='rows'"):
        acc.step(micro_batches(WINDOWS[0], SPLITS["2-2-2-1"][0]), hf_loss)
    assert acc.steps == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))
    with pytest.raises(NotExactError, match="num_items"):  # the loop of micro-batches, too
        list(acc.train([pad(WINDOWS[0][:3]), pad(WINDOWS[0][3:])], hf_loss, accum_steps=2))
    assert acc.steps == 0 and all(p.grad is None for p in model.parameters())

    ref = gpt2()
    ref_opt = make_optimizer("sgd", ref.parameters())
    result = acc.step(micro_batches(WINDOWS[0], SPLITS["2-2-2-1"][0]), hf_loss, num_items="rows")  # said so
    reference_step(ref, ref_opt, WINDOWS[0])
    assert result.num_items == 7 and update_error(model, ref, start) > 1e-2  # what the refusal saves
    exact, ref, start = run_pair(gpt2, "2-2-2-1", "sgd", num_items=count, loss_fn=hf_loss, loss_rel=1e-6)
    assert update_error(exact, ref, start) < 1e-5  # float32's rounding of outputs.loss, as above


def test_a_bare_loss_on_labels_without_padding_is_weighed_by_rows_as_before():
    """Labels with no -100: every row holds as many targets, so rows weigh exactly; no refusal."""
    seqs = sequences([5, 5, 5, 5, 5], seed=3)
    model, ref = gpt2(), gpt2()
    acc = Accumulator(model, make_optimizer("sgd", model.parameters()))
    assert not (pad(seqs)["labels"] == -100).any()
    acc.step(micro_batches(seqs, [2, 3]), hf_loss)
    reference_step(ref, make_optimizer("sgd", ref.parameters()), seqs)
    assert_params_close(model, ref, rtol=1e-6, atol=1e-9)  # outputs.loss is float32


def test_a_bare_loss_on_labels_of_other_lengths_or_padded_tuples_is_refused_and_counting_is_exact():
    """Two probes: micro-batches bucketed by length (no -100, but 4 and 9 targets a row) and padded micro-batches
    handed over as tuples (as a TensorDataset gives them) escaped the padded-labels refusal: each micro-batch was
    weighed by its rows, 0.82 and 0.18 of the step's move off one big batch, in silence. Both are refused before
    any backward; counting the targets is exact (to outputs.loss's float32)."""
    from gradaccum import NotExactError

    seqs = sequences([4, 4, 9, 9, 9], seed=5)
    bucketed = micro_batches(seqs, [2, 3])
    assert not any((mb["labels"] == -100).any() for mb in bucketed)
    model, ref = gpt2(), gpt2()
    start = copy.deepcopy(model)
    acc = Accumulator(model, make_optimizer("sgd", model.parameters()))
    with pytest.raises(NotExactError, match=r"'labels' differ in length \(\[4\], \[9\] after the rows\).*"
                                            r"num_items='rows'"):
        acc.step(bucketed, hf_loss)
    tuples = [(mb["input_ids"], mb["attention_mask"], mb["labels"]) for mb in micro_batches(WINDOWS[0], [2, 2, 2, 1])]
    with pytest.raises(NotExactError, match=r"hold the ignore index -100.*wherever a tuple holds the labels"):
        acc.step(tuples, lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss)
    assert acc.steps == 0 and all(p.grad is None for p in model.parameters())
    acc.step(bucketed, hf_loss, num_items=count)
    reference_step(ref, make_optimizer("sgd", ref.parameters()), seqs)
    assert update_error(model, ref, start) < 1e-5  # float32's rounding of outputs.loss
    naive, naive_start = gpt2(), gpt2()
    Accumulator(naive, make_optimizer("sgd", naive.parameters())).step(bucketed, hf_loss, num_items="rows")
    assert update_error(naive, ref, naive_start) > 1e-2  # what the refusal saves


def test_uint8_images_in_a_tuple_are_no_labels():
    """A review: a tuple of uint8 images (where -100 wraps to 156) and class labels was refused as padded labels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 3)).double()
    images = torch.full((8, 3, 4, 4), 156, dtype=torch.uint8)
    batch = (images, torch.randint(0, 3, (8,)))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0].double() / 255), b[1])  # noqa: E731
    assert Accumulator(model, make_optimizer("sgd", model.parameters())).step(batch, loss, micro_batch_size=3).step == 1


def test_check_equivalence_names_the_token_count_and_takes_num_items():
    """The checker on ``outputs.loss`` over a padded batch names the count of targets as the cause (not
    a loss that couples the items), and with ``num_items=`` it reports equivalence."""
    from gradaccum import check_equivalence

    batch = pad(WINDOWS[0])
    report = check_equivalence(gpt2(), hf_loss, batch, 2)
    assert not report.equivalent and report.max_rel_diff > 1e-2
    assert len(report.hints) == 1 and "count_targets" in report.hints[0] and "WindowLoss" not in report.hints[0]
    fixed = check_equivalence(gpt2(), hf_loss, batch, 2, num_items=count)
    assert fixed.equivalent and fixed.hints == [], str(fixed)
    said_rows = check_equivalence(gpt2(), hf_loss, batch, 2, num_items="rows")  # the mistake said out loud
    assert not said_rows.equivalent and "count_targets" in said_rows.hints[0]
