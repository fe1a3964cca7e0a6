"""MoELoss: a mixture-of-experts model's own loss (token loss + coef * load balancing) over the whole
window, in float64 against one big-batch step on the model's own loss (``model(**batch, labels=...)
.loss``), for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE built from configs (integrations/moe_models.py).

transformers' load-balancing sums are float32 even in a float64 model: both sides run
``moe_models.float64_balance_loss`` (the same function in float64), so rtol 1e-10 sees the method.
Windows: micro-batches of 2, 3 and 1 padded sequences (each padded to its own longest, the big batch
to the window's), then a short last window of 2; SGD with momentum, with and without clipping.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from integrations import moe_models as M  # noqa: E402
from integrations import scenarios as S  # noqa: E402
from gradaccum import Accumulator, ConfigurationError, MoELoss, NotExactError, ReplayError  # noqa: E402
from gradaccum.moe import MoEOutput  # noqa: E402
from gradaccum._maths import balance_loss_part, router_statistics  # noqa: E402
from hf_helpers import pad, unpad  # noqa: E402

WINDOWS = [S.rank_micro_batches(0, [2, 3, 1], seed=3), S.rank_micro_batches(1, [2], seed=3)]


@pytest.fixture(autouse=True)
def float64_islands():
    with M.float64_balance_loss():
        yield


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def big_batch(model, windows, clip=None):
    """One step per window on the model's own loss over the window as one padded batch."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    for window in windows:
        batch = pad([s for mb in window for s in unpad(mb)])
        opt.zero_grad()
        model(**batch).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def accumulated(model, windows, loss, clip=None):
    model = copy.deepcopy(model)
    acc = Accumulator(model, optimizer(model.parameters()), max_grad_norm=clip)
    results = [acc.step(list(window), loss(model)) for window in windows]
    return model, results


@pytest.mark.parametrize("family", M.FAMILIES)
def test_statistics_are_the_models_own_balance_loss(family):
    """router_statistics + balance_loss_part give the model's own aux_loss on a padded batch, and the
    micro-batches' parts with the window's counts sum to the window's (rtol 1e-12)."""
    model = M.moe_model(family)
    window = WINDOWS[0]
    batch = pad([s for mb in window for s in unpad(mb)])
    out = model(**batch)
    C, P, T = router_statistics(out.router_logits, 2, batch["attention_mask"].reshape(-1))
    whole = balance_loss_part(P, C, T, T)
    torch.testing.assert_close(whole, out.aux_loss, rtol=1e-12, atol=0)
    parts = []
    for mb in window:
        o = model(**mb)
        _, p, _ = router_statistics(o.router_logits, 2, mb["attention_mask"].reshape(-1))
        parts.append(balance_loss_part(p, C, T, T))
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=0)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("family", M.FAMILIES)
def test_exact_is_the_big_batch_on_the_models_own_loss(family, clip):
    """MoELoss.for_hf_model equals one big-batch step per window on the model's own loss (rtol 1e-10),
    the reported loss is that loss; per-micro-batch balancing (the model's own loss per micro-batch,
    and mode='micro_batch') is measurably off: the test has teeth."""
    model = M.moe_model(family)
    ref = big_batch(model, WINDOWS, clip)
    exact, results = accumulated(model, WINDOWS, MoELoss.for_hf_model, clip)
    assert S.params_close(exact, ref) is None, S.params_close(exact, ref)
    first = pad([s for mb in WINDOWS[0] for s in unpad(mb)])
    assert results[0].loss == pytest.approx(model(**first).loss.item(), rel=1e-12)
    assert [r.num_items for r in results] == [sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in w)
                                              for w in WINDOWS]
    naive, _ = accumulated(model, WINDOWS, lambda m: own_loss_per_micro_batch, clip)
    cheap, _ = accumulated(model, WINDOWS, lambda m: MoELoss.for_hf_model(m, mode="micro_batch"), clip)
    assert S.max_diff(naive, ref) > 1e-6 and S.max_diff(cheap, ref) > 1e-6


def own_loss_per_micro_batch(model, mb):
    """The model's own loss on the micro-batch (aux term per micro-batch), weighted by its targets."""
    return model(**mb).loss, (mb["labels"][:, 1:] != -100).sum()


def test_a_routing_that_differs_between_passes_is_caught():
    """A forward that draws its own randomness (not replayed) and routes by it: the second pass
    routes otherwise and the window raises before its step; the parameters are unchanged."""
    model = M.moe_model("mixtral")
    hf = MoELoss.for_hf_model(model)
    gen = torch.Generator().manual_seed(0)

    def forward(m, batch):
        out = hf.forward(m, batch)
        noise = torch.randn(out.router_logits[0].shape, generator=gen, dtype=torch.float64) * 10
        return out._replace(router_logits=[out.router_logits[0] + noise, *out.router_logits[1:]])

    acc = Accumulator(model, optimizer(model.parameters()))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ReplayError, match="routed its tokens to other experts"):
        acc.step(list(WINDOWS[0]), MoELoss(forward, num_experts=4, top_k=2, coef=M.COEF))
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_router_jitter_is_replayed():
    """Mixtral's router jitter (random in training) draws the same in both passes: exact against a big
    batch that draws per micro-batch as the passes do would be circular, so this checks that the
    window steps (no routing mismatch) and that the step leaves the random state where one pass of
    forwards leaves it."""
    model = M.moe_model("mixtral", router_jitter_noise=0.3)
    acc = Accumulator(model, optimizer(model.parameters()))
    torch.manual_seed(7)
    acc.step(list(WINDOWS[0]), MoELoss.for_hf_model(model))
    after = torch.rand(1)
    torch.manual_seed(7)
    with torch.no_grad():
        for mb in WINDOWS[0]:
            model(**mb)
    assert torch.equal(after, torch.rand(1))


def test_refusals():
    """A model without the term, a bad mode, and MoELoss called as a per-micro-batch loss_fn."""
    with pytest.raises(ValueError, match="no load-balancing term"):
        MoELoss.for_hf_model(M.moe_model("olmoe", router_aux_loss_coef=0.0))
    with pytest.raises(ValueError, match=r"mode='big'"):
        MoELoss(lambda m, b: None, num_experts=4, top_k=2, coef=0.1, mode="big")
    with pytest.raises(NotExactError, match="acc.step"):
        MoELoss(lambda m, b: None, num_experts=4, top_k=2, coef=0.1)(None, None)
    # an attention_mask not (batch, sequence): the model's own balance would read it as such, so no count is its
    from gradaccum.integrations.hf_router import hf_token_mask

    mask = torch.ones(2, 1, 5, 5)
    with pytest.raises(ConfigurationError, match=r"has shape \(2, 1, 5, 5\): pass the 2-D padding mask"):
        hf_token_mask({"attention_mask": mask})
    assert hf_token_mask({"attention_mask": torch.ones(2, 5)}).shape == (10,) and hf_token_mask({}) is None


def test_the_checker_names_the_load_balancing_term():
    """check_equivalence on an MoE model trained on its own loss (aux term per micro-batch): not
    equivalent, and the hint names router_aux_loss_coef and MoELoss; without the term, no such hint."""
    from gradaccum import check_equivalence

    batch = pad([s for mb in WINDOWS[0] for s in unpad(mb)])
    report = check_equivalence(M.moe_model("qwen2_moe"), own_loss_per_micro_batch, batch, 3)
    assert not report.equivalent
    assert any("router_aux_loss_coef=0.2" in h and "MoELoss" in h for h in report.hints), report.hints
    plain = check_equivalence(M.moe_model("qwen2_moe", output_router_logits=False), own_loss_per_micro_batch, batch, 3)
    assert not any("router_aux_loss_coef" in h for h in plain.hints)


def test_accumulator_train_is_the_big_batch_per_window():
    """acc.train over a loader of micro-batches (accum_steps=3: windows of 3, 3 and a short 1) with
    MoELoss.for_hf_model: one big-batch step per window on the model's own loss (rtol 1e-10)."""
    model = M.moe_model("olmoe")
    micro = S.rank_micro_batches(0, S.SIZES[0])
    windows = [[s for mb in micro[i:i + 3] for s in unpad(mb)] for i in range(0, len(micro), 3)]
    ref = big_batch(model, [[pad(w)] for w in windows], clip=0.5)
    net = copy.deepcopy(model)
    acc = Accumulator(net, optimizer(net.parameters()), max_grad_norm=0.5)
    results = list(acc.train(micro, MoELoss.for_hf_model(net), accum_steps=3))
    assert [r.micro_batches for r in results] == [3, 3, 1]
    assert S.params_close(net, ref) is None, S.params_close(net, ref)


def test_the_cheaper_modes_are_what_they_say():
    """mode='micro_batch' is the model's own loss per micro-batch weighted by its items (1e-12); on a
    window of one micro-batch every mode is the big batch (the cheap ones to the float32 islands'
    rounding); on several, prefix and micro_batch are not, and differ from each other."""
    model = M.moe_model("qwen3_moe")
    per_mb, _ = accumulated(model, WINDOWS, lambda m: MoELoss.for_hf_model(m, mode="micro_batch"))
    own, _ = accumulated(model, WINDOWS, lambda m: own_loss_per_micro_batch)
    assert S.max_diff(per_mb, own) < 1e-12
    single = [[pad([s for mb in w for s in unpad(mb)])] for w in WINDOWS]
    ref = big_batch(model, WINDOWS)
    for mode in ("micro_batch", "prefix", "exact"):
        one, _ = accumulated(model, single, lambda m: MoELoss.for_hf_model(m, mode=mode))
        if mode == "exact":
            assert S.params_close(one, ref) is None, S.params_close(one, ref)
        else:  # a (mean, count) loss_fn: R is fixed at the first backward, and Qwen3-MoE's float32
            assert S.max_diff(one, ref) < 1e-7  # router and RMSNorm round grad * W / R (about 1e-8)
    prefix, _ = accumulated(model, WINDOWS, lambda m: MoELoss.for_hf_model(m, mode="prefix"))
    assert S.max_diff(prefix, ref) > 1e-6 and S.max_diff(prefix, per_mb) > 1e-9


def test_router_logits_outside_the_graph_are_refused():
    """A forward whose router logits are detached (as a reentrant checkpoint would leave them) would
    add no load-balancing gradient: refused, naming use_reentrant."""
    hf = MoELoss.for_hf_model(M.moe_model("olmoe"))

    def detached(m, batch):
        out = hf.forward(m, batch)
        return out._replace(router_logits=[t.detach() for t in out.router_logits])

    model = M.moe_model("olmoe")
    acc = Accumulator(model, optimizer(model.parameters()))
    with pytest.raises(NotExactError, match="use_reentrant"):
        acc.step(list(WINDOWS[0]), MoELoss(detached, num_experts=4, top_k=2, coef=M.COEF))


def test_a_micro_batch_of_routed_tokens_without_items_is_refused():
    """A micro-batch whose every label is ignored still routes tokens: its share of the balance gradient
    has no item weight in exact mode, so the window is refused before any backward (parameters unchanged)."""
    model = M.moe_model("mixtral")
    window = [dict(mb) for mb in WINDOWS[0]]
    window[1]["labels"] = torch.full_like(window[1]["labels"], -100)
    acc = Accumulator(model, optimizer(model.parameters()))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(NotExactError, match="no loss item"):
        acc.step(window, MoELoss.for_hf_model(model))
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_the_checker_checks_what_it_recommends():
    """check_equivalence(model, MoELoss.for_hf_model(model), ...) (#40 item 4): the oracle is the token loss
    plus coef times the whole batch's load-balancing loss, which is the model's own loss on the batch; exact
    mode is equivalent to rounding, mode='micro_batch' is not, with a hint that names mode='exact'."""
    from gradaccum import check_equivalence

    batch = pad([s for mb in WINDOWS[0] for s in unpad(mb)])
    for family in ("mixtral", "qwen2_moe"):
        model = M.moe_model(family)
        with torch.no_grad():
            own = model(**batch).loss.item()
        exact = check_equivalence(model, MoELoss.for_hf_model(model), batch, 2)
        assert exact.equivalent and exact.max_rel_diff < 1e-12, exact
        assert exact.loss_full == pytest.approx(own, rel=1e-12) and exact.hints == []
        cheap = check_equivalence(model, MoELoss.for_hf_model(model, mode="micro_batch"), batch, 2)
        assert not cheap.equivalent and cheap.max_rel_diff > 1e-3, cheap
        assert cheap.hints == ["MoELoss(mode='micro_batch') computes the load-balancing term from part of the window, "
                               "which is another objective than the big batch's: mode='exact' computes it over the "
                               "whole window"]


@pytest.mark.parametrize("mode", ["exact", "micro_batch", "prefix"])
def test_every_mode_checks_its_arguments_alike(mode):
    """#40 item 3: num_experts=8 against a 4-expert router, and a forward that returns no router logits, are
    refused in every mode (the cheaper ones took them silently), naming the argument, the value and the fix
    (not an internal function); parameters unchanged."""
    model = M.moe_model("mixtral")
    hf = MoELoss.for_hf_model(model)
    acc = Accumulator(model, optimizer(model.parameters()))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ConfigurationError) as wrong:
        acc.step(list(WINDOWS[0]), MoELoss(hf.forward, num_experts=8, top_k=2, coef=M.COEF, mode=mode))
    assert str(wrong.value) == ("MoELoss(num_experts=8): the router logits have 4 experts (their last dimension); pass "
                                "num_experts=4 (the router's), or return that router's logits")
    with pytest.raises(ConfigurationError) as empty:
        acc.step(list(WINDOWS[0]), MoELoss(lambda m, b: hf.forward(m, b)._replace(router_logits=[]), num_experts=4,
                                           top_k=2, coef=M.COEF, mode=mode))
    text = str(empty.value)
    assert text.startswith("MoELoss: the forward returned no router logits (router_logits=[])") and \
        "output_router_logits=True" in text and "router_statistics" not in text, text
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["exact", "micro_batch", "prefix"])
def test_num_items_is_refused_as_a_window_loss_refuses_it(mode):
    """#40 item 3: acc.step / acc.train with an MoELoss and num_items= (whose counts come from its forward)
    refused before anything runs, as a WindowLoss refuses it."""
    model = M.moe_model("olmoe")
    acc = Accumulator(model, optimizer(model.parameters()))
    moe = MoELoss.for_hf_model(model, mode=mode)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ConfigurationError, match=r"^num_items=<function .*> was given with an MoELoss: its item "
                                                 r"counts come from its forward \(MoEOutput.num_items\), so num_items "
                                                 r"would not be read; drop num_items$"):
        acc.step(list(WINDOWS[0]), moe, num_items=lambda mb: 1)
    with pytest.raises(ConfigurationError, match="drop num_items"):
        list(acc.train(list(WINDOWS[0]), moe, accum_steps=2, num_items=lambda mb: 1))
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_moe_errors_name_the_argument_the_value_and_the_fix():
    """#40 item 5: each refusal a gradaccum.errors kind that names the argument, the value and the fix."""
    with pytest.raises(ConfigurationError) as linear:
        MoELoss.for_hf_model(torch.nn.Linear(2, 2))
    assert type(linear.value) is ConfigurationError and str(linear.value).startswith(
        "MoELoss.for_hf_model(Linear): the model has no Hugging Face config (model.config)")
    assert "its config" not in str(linear.value) and "MoELoss(forward, num_experts=" in str(linear.value)
    with pytest.raises(ConfigurationError) as off:  # the docstring's kind: ConfigurationError, not NotExactError
        MoELoss.for_hf_model(M.moe_model("olmoe", router_aux_loss_coef=0.0))
    assert type(off.value) is ConfigurationError and "ConfigurationError: the model has no Hugging Face config, or " \
        "its config has no load-balancing term" in " ".join(MoELoss.for_hf_model.__doc__.split())
    assert "router_aux_loss_coef=0.0" in str(off.value), off.value
    for coef in (None, "0.1", -1.0, float("nan")):
        with pytest.raises(ConfigurationError, match=rf"^MoELoss\(coef={coef!r}\): coef is the load-balancing "
                                                     r"weight \(transformers' router_aux_loss_coef\), a finite number "
                                                     r">= 0, e.g. coef=0.02$"):
            MoELoss(lambda m, b: None, num_experts=4, top_k=2, coef=coef)
    model = M.moe_model("mixtral")
    acc = Accumulator(model, optimizer(model.parameters()))
    unlabelled = [{k: v for k, v in mb.items() if k != "labels"} for mb in WINDOWS[0]]
    with pytest.raises(ConfigurationError, match=r"^MoELoss.for_hf_model: a micro-batch has no 'labels' \(its keys: "
                                                 r"\['attention_mask', 'input_ids'\]\); add the targets as "
                                                 r"batch\['labels'\]"):
        acc.step(unlabelled, MoELoss.for_hf_model(model))
    tuples = [(mb["input_ids"], mb["labels"]) for mb in WINDOWS[0]]
    for mode in ("exact", "micro_batch"):
        with pytest.raises(ConfigurationError, match=r"^MoELoss.for_hf_model: a micro-batch is a tuple; it takes dicts "
                                                     r"of the model's inputs with labels"):
            acc.step(tuples, MoELoss.for_hf_model(model, mode=mode))
