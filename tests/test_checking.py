"""check_equivalence: the verdict, the suspects it names, the splits it refuses, the hints it gives,
and the model left exactly as found."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradaccum import check_equivalence
from gradaccum.checking import SplitError
from helpers import mse, regression_batch, regression_model


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            [m.training for m in model.modules()], torch.get_rng_state())


def _assert_untouched(model, saved):
    state, grads, modes, rng = saved
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    for n, p in model.named_parameters():
        assert (p.grad is None and grads[n] is None) or torch.equal(p.grad, grads[n])
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)


def test_checker_passes_a_plain_model_and_leaves_it_as_found():
    model = regression_model()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    saved = _state(model)
    report = check_equivalence(model, mse, regression_batch(10), 3, rtol=1e-10)
    assert report.equivalent and report.max_rel_diff < 1e-12 and report.suspects == [] and report.hints == []
    assert report.loss_full == pytest.approx(report.loss_accumulated, rel=1e-12)
    _assert_untouched(model, saved)


def test_checker_names_batchnorm_and_restores_its_running_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()
    model[1].running_mean.fill_(0.5)
    saved = _state(model)
    report = check_equivalence(model, mse, regression_batch(12), 4)
    assert not report.equivalent and report.max_rel_diff > 1e-3
    names = [name for name, _ in report.suspects]
    assert names == ["1"], report.suspects
    assert "BatchNorm" in report.suspects[0][1] and "depends on the other items" in report.suspects[0][1]
    _assert_untouched(model, saved)
    assert "NOT equivalent" in str(report) and "suspect module '1': BatchNorm1d" in str(report)  # a name, not a list number
    assert report.hints == []  # a mean loss: no word about sums


class _Tracked(nn.Module):
    """Linear -> InstanceNorm1d over 2 channels of 3 -> Linear: each item normalized on its own."""

    def __init__(self, track: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 6).double(), nn.Linear(6, 1).double()
        self.n = nn.InstanceNorm1d(2, track_running_stats=track).double()

    def forward(self, x):
        return self.b(self.n(self.a(x).view(-1, 2, 3)).view(-1, 6))


@pytest.mark.parametrize("track", [True, False])
def test_an_instance_norm_tracking_running_statistics_is_named_and_the_accumulator_warns(track):
    """A probe: InstanceNorm(track_running_stats=True) was reported equivalent, and trained without a word,
    though its running statistics, updated once per micro-batch, end far from one big batch's (the gradient is
    the big batch's). Now named, not equivalent, and warned about once; without tracking it is equivalent."""
    from gradaccum import Accumulator

    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    model = _Tracked(track)
    saved = _state(model)
    report = check_equivalence(model, loss, (x, y), micro_batch_size=4)
    _assert_untouched(model, saved)
    assert report.max_rel_diff < 1e-12 and report.equivalent is not track, report
    assert [name for name, _ in report.suspects] == (["n"] if track else []), report
    big, acc = _Tracked(track), Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    big(x)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        acc.step((x, y), loss, micro_batch_size=4)
    told = [str(w.message) for w in said if "track running statistics" in str(w.message)]
    assert len(told) == (1 if track else 0), told
    if track:
        assert "(n)" in told[0] and "track_running_stats=False" in told[0]
        assert not torch.allclose(model.n.running_mean, big.n.running_mean)  # what the warning is about


def test_a_batchnorm_in_eval_beside_a_tracking_instance_norm_gets_the_instance_norm_warning():
    """A review: the warning's text was chosen by any BatchNorm, one in eval (a frozen backbone's) included."""
    from gradaccum import Accumulator

    model = _Tracked(True)
    model.frozen = nn.BatchNorm1d(1).double().eval()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=r"InstanceNorm layers that track running statistics \(n\)"):
        acc.step((x, y), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), micro_batch_size=4)


@pytest.mark.parametrize("limit, equivalent", [(0.5, True), (0.05, False)])
def test_a_gradient_hook_is_checked_at_the_size_the_window_gives_its_gradient(limit, equivalent):
    """A probe: a clamping hook that never fires in training (each micro-batch's weighted gradient, and one big
    batch's, stay under 0.5) was reported NOT equivalent (2.0 apart), because the check's big batch
    backpropagated N times the mean loss, which the clamp cut. The check now weighs as training does; a clamp
    that does fire (0.05) is still not equivalent, as training with it is not one big batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-limit, limit))
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 1, dtype=torch.float64)
    loss = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()  # noqa: E731
    report = check_equivalence(model, loss, (x, y), micro_batch_size=8)
    assert report.equivalent is equivalent, report
    assert (report.max_rel_diff < 1e-12) is equivalent, report


def test_a_module_drawing_from_its_own_generator_is_left_as_found():
    """A probe: the check advanced a module's own torch.Generator, so the model was not left as found."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.gen = nn.Linear(5, 3).double(), torch.Generator().manual_seed(1)

        def forward(self, x):
            return self.linear(x) + 0.1 * torch.randn(x.shape[0], 3, generator=self.gen, dtype=x.dtype)

    model = Noisy()
    state = model.gen.get_state()
    check_equivalence(model, mse, regression_batch(8), micro_batch_size=4)
    assert torch.equal(model.gen.get_state(), state)


def test_a_metric_returned_beside_the_loss_is_told_apart_from_a_count():
    """A probe returned (loss, accuracy): the accuracy weighed each micro-batch (3.3e-2 off one big batch after
    three steps) and the check's hint pointed at WindowLoss. It now says the pair's second value is the count."""
    model = regression_model()
    batch = regression_batch(12)

    def loss_and_share(m, b):
        out = m(b[0])
        return nn.functional.mse_loss(out, b[1]), (out > b[1]).double().mean()

    report = check_equivalence(model, loss_and_share, batch, micro_batch_size=4)
    assert not report.equivalent and len(report.hints) == 1, report
    assert "second value is taken as the count of items" in report.hints[0] and "WindowLoss" not in report.hints[0]


def test_checker_names_dropout_and_functional_randomness():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x):
            return self.lin(x) + 0.1 * torch.randn_like(self.lin(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Dropout(0.3), Noisy()).double()
    saved = _state(model)
    report = check_equivalence(model, mse, regression_batch(8), 2)
    names = dict(report.suspects)
    assert "1" in names and "Dropout" in names["1"]
    assert "2" in names and "random" in names["2"]
    assert not report.equivalent
    _assert_untouched(model, saved)
    model.eval()  # in eval mode dropout is off, but the noise module still draws
    assert "1" not in dict(check_equivalence(model, mse, regression_batch(8), 2).suspects)


@pytest.mark.parametrize("layers", [1, 2])
def test_dropout_is_not_equivalent_even_where_this_split_happens_to_match(layers):
    """One dropout layer on the CPU, its micro-batches run in order, draws exactly the full batch's
    masks (the generator fills them item after item): the gradients match to rounding. Two layers
    draw layer by layer in the full batch and micro-batch by micro-batch when accumulated, so they
    differ. Either way the masks depend on the split, as the docs and ``check --help`` say: NOT
    equivalent, with the reason (it said "equivalent" for one layer)."""
    torch.manual_seed(0)
    body = [module for _ in range(layers) for module in (nn.Linear(5, 5), nn.Dropout(0.5))]
    model = nn.Sequential(*body, nn.Linear(5, 3)).double()
    report = check_equivalence(model, mse, regression_batch(8), 4)
    assert not report.equivalent, report
    text = str(report)
    assert text.startswith("NOT equivalent") and "suspect module '1': Dropout (p=0.5)" in text, text
    if layers == 1:
        assert report.max_rel_diff < 1e-12, report  # this split matched ...
        assert "matched on this split by chance" in text and "several layers" in text, text  # ... and why
        # the first line says what is true before the explanation (#40 item 4): not "NOT equivalent: 1e-16"
        assert text.startswith("NOT equivalent (the model draws random numbers in forward, which differ with the "
                               "split; this split matched): max relative gradient difference"), text
    else:
        assert report.max_rel_diff > 1e-3, report
        assert text.startswith("NOT equivalent: max relative gradient difference"), text  # the gradients differ


def test_a_split_into_one_micro_batch_is_refused_like_the_command_line_refuses_it():
    model = regression_model()
    with pytest.raises(SplitError, match=r"micro_batch_size=10 on a batch of 10 items gives one micro-batch, which is "
                                         r"only compared with itself; pass micro_batch_size=5 or less") as refused:
        check_equivalence(model, mse, regression_batch(10), 10)
    assert (refused.value.micro_batch_size, refused.value.items, refused.value.suggestion) == (10, 10, 5)
    assert isinstance(refused.value, ValueError)


def test_batchnorm_on_a_one_item_micro_batch_is_named_with_the_size_and_the_model_left_as_found():
    """16 items in micro-batches of 5 leave one of 1 item, which BatchNorm in training mode cannot
    normalize: the refusal names BatchNorm, the micro-batch and a size that works (it was torch's
    "Expected more than 1 value per channel", which the command line blamed on the user's loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()
    saved = _state(model)
    with pytest.raises(SplitError) as refused:
        check_equivalence(model, mse, regression_batch(16), 5)
    text = str(refused.value)
    assert text.startswith("micro_batch_size=5 on a batch of 16 items leaves micro-batch 4 of 4 with 1 item, which "
                           "BatchNorm in training mode (module '1') cannot normalize"), text
    assert "pass micro_batch_size=4, which leaves 2 or more in each" in text and "NOT equivalent" in text, text
    assert refused.value.suggestion == 4
    _assert_untouched(model, saved)
    assert check_equivalence(model, mse, regression_batch(16), refused.value.suggestion).suspects[0][0] == "1"


@pytest.mark.parametrize("micro_batch_size, ratio", [(8, "2"), (4, "4")])
def test_a_summed_loss_is_told_to_return_the_mean(micro_batch_size, ratio):
    """reduction="sum" makes the full batch's loss the accumulated one times the number of (equal)
    micro-batches: the report says loss_fn must return the mean."""
    model = regression_model()
    summed = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1], reduction="sum")  # noqa: E731
    report = check_equivalence(model, summed, regression_batch(16), micro_batch_size)
    assert not report.equivalent
    assert report.loss_full / report.loss_accumulated == pytest.approx(16 / micro_batch_size, rel=0.05)
    (hint,) = report.hints
    assert hint.startswith(f"the full batch's loss is {ratio} times the accumulated one") and "must return the mean" in hint
    assert f"  hint: {hint}" in str(report)


def test_a_module_taking_a_dict_is_compared_by_the_tensor_inside_it():
    """Modules are compared by their first input and output tensor, found by the one walker over
    batches (batching.first_tensor), dicts included. A per-item block that takes a dict after a
    module that mixes items is not named: its input already differs (its own input was unseen, and
    the block was named beside the real culprit)."""
    class Mix(nn.Module):
        def forward(self, x):
            return x - x.mean(0)  # each item's output depends on the others

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, inputs):
            return self.lin(inputs["x"])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.block = Mix(), Block()

        def forward(self, x):
            return self.block({"x": self.mix(x)})

    report = check_equivalence(Model().double(), mse, regression_batch(8), 4)
    assert not report.equivalent and [name for name, _ in report.suspects] == ["mix"], report


def test_a_loss_that_couples_the_items_is_recognised_and_window_loss_shown_exact():
    """Issue 27, item 7: in-batch negatives through a plain loss_fn are NOT equivalent although no
    module is to blame; the hint names WindowLoss, and given one the checker finds it exact."""
    from contrastive import DualEncoder, in_batch_negatives, pair_batch, window_loss

    model = DualEncoder(dropout=0.0)
    batch = pair_batch(12, seed=3)
    saved = _state(model)
    plain = check_equivalence(model, lambda m, b: in_batch_negatives(*m(*b), m.log_scale), batch, 4, rtol=1e-10)
    assert not plain.equivalent and plain.suspects == [] and plain.max_rel_diff > 1e-2
    assert "couples the batch's items" in str(plain) and "WindowLoss(encode, loss)" in str(plain)
    _assert_untouched(model, saved)
    cached = check_equivalence(model, window_loss(lambda: model.log_scale), batch, 4, rtol=1e-10)
    assert cached.equivalent and cached.max_rel_diff < 1e-12 and cached.hints == [], cached
    assert abs(cached.loss_full - cached.loss_accumulated) < 1e-12
    _assert_untouched(model, saved)


def test_the_coupled_loss_hint_is_for_the_loss_alone():
    """A statistic over the batch in the loss couples its items too (hinted); where a module explains
    the difference (BatchNorm), the report names the module, not the loss."""
    spread = check_equivalence(regression_model(), lambda m, b: m(b[0]).std(), regression_batch(12), 4)
    assert not spread.equivalent and spread.suspects == [] and "couples the batch's items" in str(spread)
    batchnorm = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)).double()
    report = check_equivalence(batchnorm, lambda m, b: m(b[0]).pow(2).mean(), regression_batch(12), 4)
    assert report.suspects and "couples" not in str(report)


def test_a_window_loss_on_a_batch_that_is_one_tensor_is_checked():
    """Issue 34, item 1: a batch that is one tensor (an encoder of its own rows, SimCLR-like) split
    into bare-tensor micro-batches went to acc.step as an ambiguous list and failed, blaming the
    user's functions; the checker hands the Accumulator the batch and the split size instead."""
    from gradaccum import WindowLoss

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(12, 4, dtype=torch.float64)

    def spread(m, z):  # couples the rows: their spread around the batch's mean, and that mean
        return (z - z.mean(0)).pow(2).mean() + z.mean(0).pow(2).sum()

    report = check_equivalence(model, WindowLoss(lambda m, b: m(b), spread), x, 5, rtol=1e-10)
    assert report.equivalent and report.max_rel_diff < 1e-12, report
    plain = check_equivalence(model, lambda m, b: spread(m, m(b)), x, 5, rtol=1e-10)
    assert not plain.equivalent and plain.max_rel_diff > 1e-3


def test_a_window_loss_is_checked_without_asking_num_items_of_the_whole_batch():
    """A loss over the window is one item on the whole batch: ``num_items``, which a WindowLoss never
    reads, is not called there either (a count that fails on that batch raises nothing)."""
    from gradaccum import WindowLoss

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(12, 4, dtype=torch.float64)
    spread = lambda m, z: (z - z.mean(0)).pow(2).mean() + z.mean(0).pow(2).sum()  # noqa: E731

    def never(batch):
        raise KeyError("labels")

    report = check_equivalence(model, WindowLoss(lambda m, b: m(b), spread), x, 5, rtol=1e-10, num_items=never)
    assert report.equivalent, report
