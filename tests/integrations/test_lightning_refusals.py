"""Misuse of ``ExactAccumulation`` that would train away from one big batch is refused before the
first step, in one error that says the fix: a second callback (however it got onto the Trainer) and
a strategy that accumulates by itself (DeepSpeed). Tiny float64 regressions, so each fit is quick."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pl = pytest.importorskip("pytorch_lightning")

from integrations import scenarios as S  # noqa: E402
from gradaccum.integrations import lightning as exact_lightning  # noqa: E402
from gradaccum.integrations.lightning import ExactAccumulation  # noqa: E402
from gradaccum.errors import NotExactError  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:pytorch_lightning"),
              pytest.mark.filterwarnings("ignore::UserWarning:lightning_fabric")]

SIZES = [5, 1, 3, 2, 4]  # accumulate 2: windows of 6, 5 and 4 rows


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64))
            for n in SIZES]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


class Regression(pl.LightningModule):
    """The MSE over a batch's rows; ``model_callbacks`` is what ``configure_callbacks`` returns."""

    def __init__(self, model_callbacks=()) -> None:
        super().__init__()
        self.net = _net()
        self.model_callbacks = list(model_callbacks)

    def training_step(self, batch, batch_idx):
        x, y = batch[:2]
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def configure_callbacks(self):
        return self.model_callbacks


def _fit(lit: Regression, callbacks, **kwargs) -> pl.Trainer:
    S.quiet()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2, logger=False,
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, **kwargs)
    trainer.fit(lit, DataLoader(_batches(), batch_size=None))
    return trainer


def _reference() -> nn.Module:
    """One SGD step per window on the window's rows."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = _batches()
    for w in range(3):
        x, y = (torch.cat(parts) for parts in zip(*batches[2 * w:2 * w + 2]))
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return net


class MyExact(ExactAccumulation):
    """A user's subclass, e.g. one that logs N."""


TWO_CALLBACKS = {
    "trainer-two": lambda: ([ExactAccumulation(), ExactAccumulation(num_items=len)], []),
    "trainer-same-instance-twice": lambda: ([exact := ExactAccumulation(), exact], []),
    "module-two": lambda: ([], [ExactAccumulation(), ExactAccumulation()]),
    # Lightning drops a Trainer callback only for a module callback of its class or a subclass
    "trainer-subclass-plus-module-base": lambda: ([MyExact()], [ExactAccumulation()]),
}


@pytest.mark.parametrize("where", list(TWO_CALLBACKS))
def test_a_second_callback_is_refused_before_any_step(where):
    """Two ExactAccumulation callbacks, from the Trainer, the LightningModule's configure_callbacks(),
    or one from each: one ValueError naming both and the fix, raised in setup (no step taken, the
    weights as they were)."""
    trainer_cbs, module_cbs = TWO_CALLBACKS[where]()
    lit = Regression(module_cbs)
    before = copy.deepcopy(lit.net.state_dict())
    with pytest.raises(ValueError, match=r"holds 2 ExactAccumulation callbacks \(trainer\.callbacks\[\d\] = "
                                         r"\w+\(num_items=.*\); trainer\.callbacks\[\d\] = .*"
                                         r"Keep exactly one.*configure_callbacks\(\)") as caught:
        _fit(lit, trainer_cbs)
    assert caught.value.args[0].count("(num_items=") == 2  # both named
    assert all(torch.equal(p, before[k]) for k, p in lit.net.state_dict().items())


def test_two_callbacks_would_train_away_from_one_big_batch(monkeypatch):
    """What the refusal prevents: with the check switched off, two callbacks each weigh every
    micro-batch and rescale every step, and the fit lands far from one big batch per window, where
    one callback equals it at rtol 1e-10."""
    one = Regression()
    _fit(one, [ExactAccumulation()])
    assert S.params_close(one.net, _reference()) is None
    monkeypatch.setattr(exact_lightning, "_refuse_a_second_callback", lambda trainer: None)
    two = Regression()
    _fit(two, [ExactAccumulation(), ExactAccumulation()])
    assert S.max_diff(two.net, _reference()) > 1e-3


def test_a_module_callback_replaces_the_trainers_own():
    """Lightning's rule: a callback from configure_callbacks() replaces the Trainer's callbacks of its
    class. Trainer(callbacks=[ExactAccumulation()]) plus a module returning ExactAccumulation() is
    therefore one callback (the module's), and the fit is exact."""
    module_cb = ExactAccumulation()
    lit = Regression([module_cb])
    trainer = _fit(lit, [ExactAccumulation()])
    assert [cb for cb in trainer.callbacks if isinstance(cb, ExactAccumulation)] == [module_cb]
    assert module_cb.last_window_items == 4
    assert S.params_close(lit.net, _reference()) is None


def test_a_strategy_that_accumulates_by_itself_is_refused():
    """DeepSpeed accumulates inside its engine (``handles_gradient_accumulation``): the per-micro-batch
    weights cannot be applied, so the fit is refused in setup with the strategies that work."""
    from pytorch_lightning.strategies import SingleDeviceStrategy

    class Accumulating(SingleDeviceStrategy):  # stands in for DeepSpeedStrategy, which needs deepspeed
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    lit = Regression()
    before = copy.deepcopy(lit.net.state_dict())
    with pytest.raises(NotExactError, match=r"strategy Accumulating accumulates gradients itself \(DeepSpeed\).*"
                                           r"use strategy='ddp' or ModelParallelStrategy"):
        _fit(lit, [ExactAccumulation()], strategy=Accumulating(device=torch.device("cpu")))
    assert all(torch.equal(p, before[k]) for k, p in lit.net.state_dict().items())


def test_a_bad_count_stops_the_fit_and_leaves_the_module_as_it_was():
    """A negative count is refused with its source named, before its micro-batch's backward; the
    hooks the callback wrapped for the fit are removed although Lightning skips teardown after an
    exception (the module can be fitted again, e.g. with a fixed callback)."""
    lit = Regression()
    with pytest.raises(ValueError, match=r"num_items\(batch\) must be a finite number >= 0.*got -1"):
        _fit(lit, [ExactAccumulation(num_items=lambda batch: -1)])
    assert "training_step" not in vars(lit) and "lr_scheduler_step" not in vars(lit)
    _fit(lit, [ExactAccumulation()])


def test_a_batch_without_a_leading_dimension_to_count_says_how_to_count_it():
    """The default count is the batch's leading dimension; tensors that disagree on it have none, and
    the error says so and how to count instead (num_items=, or a count from training_step)."""
    lit = Regression()
    x, y, per_sequence = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64), torch.ones(2)
    batches = [(x, y, per_sequence)] * 2
    with pytest.raises(ValueError, match=r"counts a batch's items by its leading dimension, but the tensors in "
                                         r"batch disagree.*batch\[0\] has 3 items but batch\[2\] has 2.*"
                                         r"pass num_items=lambda batch: <its item count>, or return \(mean_loss, count\)"):
        S.quiet()
        pl.Trainer(accelerator="cpu", max_epochs=1, accumulate_grad_batches=2, logger=False,
                   callbacks=[ExactAccumulation()], enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False).fit(lit, DataLoader(batches, batch_size=None))


def test_lbfgs_is_refused_naming_it_before_any_step():
    """A probe: LBFGS, which the guide lists as unsupported (it calls its closure several times a step), failed
    with an error about a batch holding no tensor, or an AttributeError, naming neither it nor the fix."""
    class WithLBFGS(Regression):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    lit = WithLBFGS()
    before = [p.detach().clone() for p in lit.parameters()]
    with pytest.raises(ValueError, match=r"ExactAccumulation: LBFGS calls its closure.*first-order optimizer"):
        _fit(lit, [ExactAccumulation()])
    assert all(torch.equal(a, b) for a, b in zip(before, lit.parameters()))
