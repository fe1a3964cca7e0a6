"""A micro-batch of 0 items weighs nothing, also when its loss is a masked mean ``sum / count`` (nan over no
item, with a nan gradient: its graph turns the incoming 0 into ``0 / 0``), on one process and in Lightning.

Each test runs a window whose micro-batch 1 holds no item against the float64 big batch of the window's
items (the empty micro-batch dropped), and shows the stock path on the same data ending with nan weights,
so the test has teeth. The torchrun case (the empty micro-batch on one rank only, and as a rank's last, the
reducing one) is the scenario ``ddp_a_micro_batch_of_no_item_weighs_nothing`` in tests/distributed/worker.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradaccum import Accumulator
from helpers import assert_params_close, regression_batch, regression_model

MASKS = [[1, 1, 0], [0, 0], [1, 0, 1, 1]]  # micro-batch 1: no item


def _window():
    batches = [regression_batch(len(m), seed=60 + k) for k, m in enumerate(MASKS)]
    return [(x, y, torch.tensor(m, dtype=torch.float64)) for (x, y), m in zip(batches, MASKS)]


def masked_mean(model: nn.Module, batch) -> torch.Tensor:
    """The mean over the items the mask keeps: nan, with a nan gradient, over a micro-batch of 0 items."""
    x, y, m = batch
    return (((model(x) - y) ** 2).mean(1) * m).sum() / m.sum()


def _big_batch(model: nn.Module, windows: int = 2) -> nn.Module:
    """SGD on the window's items as one float64 batch (the empty micro-batch adds none)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y, m = (torch.cat(parts) for parts in zip(*_window()))
    for _ in range(windows):
        opt.zero_grad(set_to_none=True)
        masked_mean(ref, (x, y, m)).backward()
        opt.step()
    return ref


def _stock_gradient(model: nn.Module) -> list:
    """The stock loop's window: each micro-batch's loss / k backpropagated (also with weight 0: the same nan)."""
    model = copy.deepcopy(model)
    for batch in _window():
        (masked_mean(model, batch) / len(MASKS)).backward()
    return [p.grad for p in model.parameters()]


def test_the_stock_path_ends_with_nan():
    """The teeth: the stock loop's gradient is nan, and so is a zero-weighted backward of the empty
    micro-batch alone (no weight on its loss cleans the 0 / 0 inside its graph)."""
    model = regression_model()
    assert not all(torch.isfinite(g).all() for g in _stock_gradient(model))
    (masked_mean(model, _window()[1]).nan_to_num(0.0) * 0.0).backward()
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())


COUNTS = {"int": lambda b: int(b[2].sum()), "float": lambda b: float(b[2].sum()), "tensor": lambda b: b[2].sum()}


@pytest.mark.parametrize("compute_grad_norm", [False, True], ids=["no-norm", "norm"])
@pytest.mark.parametrize("count", list(COUNTS))
def test_step_with_a_micro_batch_of_no_item_is_the_big_batch(count, compute_grad_norm):
    """acc.step over two windows, counted by an int or float (its backward skipped) or a tensor (its
    gradient replaced by 0 on the device): no step skipped, N = 5, the float64 big batch at rtol 1e-10."""
    model = regression_model()
    ref = _big_batch(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      compute_grad_norm=compute_grad_norm)
    for _ in range(2):
        result = acc.step(_window(), masked_mean, num_items=COUNTS[count])
        assert not result.skipped and result.num_items == 5, result
        assert result.grad_norm is None or torch.isfinite(torch.tensor(result.grad_norm))
    assert_params_close(model, ref)


def test_a_loss_fn_counting_its_items_on_the_device():
    """loss_fn returns ``(masked mean, mask.sum())``: the count is a tensor at the backward (not counted up
    front), the window the big batch."""
    model = regression_model()
    ref = _big_batch(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(2):
        result = acc.step(_window(), lambda m, b: (masked_mean(m, b), b[2].sum()))
        assert not result.skipped and result.num_items == 5, result
    assert_params_close(model, ref)


def test_a_hand_written_window_under_autocast_skips_the_empty_backward():
    """The hand-written loop under bf16 autocast (a micro-batch context of its own): the empty micro-batch's
    backward is skipped, its graph released: the step is the other micro-batches' alone, finite (SGD would
    carry a nan gradient into every weight it touched)."""
    model = regression_model().float()
    start = copy.deepcopy(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    with acc.window(len(MASKS)) as window:
        for batch in _window():
            batch = tuple(t.float() for t in batch)
            with window.micro_batch():
                window.backward(masked_mean(model, batch), int(batch[2].sum()))
        result = window.step()
    assert not result.skipped and result.num_items == 5
    assert all(torch.isfinite(p).all() and not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))


@pytest.mark.parametrize("count", ["int", "tensor"])
def test_every_label_ignored_still_weighs_nothing(count):
    """F.cross_entropy with every label ignored: a nan value with a zero gradient (what worked before)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    labels = torch.tensor([0, 2, -100, 1, -100])
    parts = [(x[:3], labels[:3]), (x[3:3], labels[3:3]), (x[3:], labels[3:])]
    ref = copy.deepcopy(model)
    nn.functional.cross_entropy(ref(x), labels).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    targets = (lambda b: (b[1] != -100).sum()) if count == "tensor" else (lambda b: int((b[1] != -100).sum()))
    result = acc.step(parts, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), num_items=targets)
    assert not result.skipped and result.num_items == 3
    assert_params_close(model, ref)


# -- Lightning ---------------------------------------------------------------------------------------

def test_lightning_a_micro_batch_of_no_item_is_the_big_batch(monkeypatch):
    """ExactAccumulation, one window of 3 micro-batches (accumulate 3), micro-batch 1 of no item, counted by
    an int, by a CPU tensor (read on the host) and by a tensor compared on the device (as an accelerator's
    is): the float64 big batch; Lightning's own accumulation on the same data is nan."""
    pl = pytest.importorskip("pytorch_lightning")
    from gradaccum.integrations.lightning import ExactAccumulation

    class Module(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return masked_mean(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def fit(callbacks) -> nn.Module:
        module = Module(regression_model())
        trainer = pl.Trainer(max_epochs=2, accumulate_grad_batches=len(MASKS), callbacks=callbacks, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", devices=1)
        trainer.fit(module, torch.utils.data.DataLoader(_window(), batch_size=None))
        return module.net

    ref = _big_batch(regression_model())
    for count in ("int", "tensor"):
        assert_params_close(fit([ExactAccumulation(num_items=COUNTS[count])]), ref)
    import gradaccum._empty as empty_module

    monkeypatch.setattr(empty_module, "host_count", lambda n: n)  # the accelerator's path
    assert_params_close(fit([ExactAccumulation(num_items=COUNTS["tensor"])]), ref)
    stock = fit([])
    assert not all(torch.isfinite(p).all() for p in stock.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_backward_of_a_host_count_of_0_is_skipped(precision):
    """One process: a micro-batch counted 0 on the host reduces nothing, so its backward is not run at all
    (its graph released): exact, and it costs nothing; a CPU tensor's count is read on the host as well
    (an accelerator's is compared on the device: the test below)."""
    model = regression_model().float() if precision == "bf16" else regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    ran = []
    for count in (COUNTS["int"], COUNTS["tensor"]):
        with acc.window(len(MASKS)) as window:
            for k, batch in enumerate(_window()):
                batch = tuple(t.to(next(model.parameters()).dtype) for t in batch)
                with window.micro_batch():
                    loss = masked_mean(model, batch)
                    loss.register_hook(lambda grad, k=k: ran.append(k))
                    window.backward(loss, count(batch))
            assert not window.step().skipped
    assert ran == [0, 2, 0, 2]


def test_weighing_nothing_brings_zero_only_where_empty():
    """Under ``weighing_nothing`` a backward brings each parameter 0 where the micro-batch is empty (the
    nan of 0 / 0 included), and its gradient unchanged where a device flag says it is not empty."""
    from gradaccum._empty import weighing_nothing

    model = regression_model()
    x, y, m = _window()[1]
    with weighing_nothing(model.parameters(), True):
        masked_mean(model, (x, y, m)).backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    x, y, m = _window()[0]
    masked_mean(ref, (x, y, m)).backward()
    with weighing_nothing(model.parameters(), m.sum() == 0):  # not empty: passed on unchanged
        masked_mean(model, (x, y, m)).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


def test_an_accelerator_s_tensor_count_is_compared_on_the_device(monkeypatch):
    """A tensor count on an accelerator is not read on the host (no sync per micro-batch): every such
    micro-batch backpropagates under ``weighing_nothing`` with the comparison on the device. Here CPU
    tensors are made to take that path (``host_count`` leaves them tensors), and the windows, counted up
    front or by ``loss_fn``, and Lightning's, are still the float64 big batch."""
    import gradaccum._empty as empty_module
    import gradaccum._window as window_module

    ran = []
    weighing = window_module.weighing_nothing

    def recorded(params, empty):
        ran.append(empty)
        return weighing(params, empty)

    monkeypatch.setattr(empty_module, "host_count", lambda n: n)
    monkeypatch.setattr(window_module, "weighing_nothing", recorded)
    for loss_fn, num_items in ((masked_mean, COUNTS["tensor"]), (lambda m, b: (masked_mean(m, b), b[2].sum()), None)):
        model = regression_model()
        ref = _big_batch(model)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for _ in range(2):
            result = acc.step(_window(), loss_fn, num_items=num_items)
            assert not result.skipped and result.num_items == 5, result
        assert_params_close(model, ref)
    assert len(ran) == 2 * 2 * len(MASKS) and all(isinstance(e, torch.Tensor) for e in ran)  # every micro-batch
    assert [bool(e) for e in ran[:len(MASKS)]] == [False, True, False]
