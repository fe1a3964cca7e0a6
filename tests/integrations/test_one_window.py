"""Every loop drives the one window: the Accumulator, ExactTrainer and Lightning's ExactAccumulation
each weigh, decide and count through :class:`gradaccum._weights.WindowWeights` (issue 37), once per
window, and each keeps what it learned in an AccumulatorState. A driver that derived a weight or a
verdict again would pass its own exactness tests and fail here.

Which exactness tests fail when the one implementation is broken (a wrong weight, the micro-batch's
count taken for the window's, the skip, W forgotten) is listed in the commit that added this file;
test_weights.py checks the object itself."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pytorch_lightning")

from integrations import scenarios as S  # noqa: E402
from gradaccum import Accumulator  # noqa: E402
from gradaccum._weights import WindowWeights  # noqa: E402
from hf_helpers import gpt2  # noqa: E402
from helpers import mse, regression_batch, regression_model  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture
def calls(monkeypatch):
    """How often each step of WindowWeights ran, and on which state."""
    seen: Counter = Counter()
    states = set()
    for name in ("mean_weight", "sum_weight", "close", "record"):
        real = getattr(WindowWeights, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            states.add(id(self.state))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(WindowWeights, name, counted)
    seen.states = states  # type: ignore[attr-defined]
    return seen


def test_the_accumulator_drives_it(calls):
    model = regression_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for seed in (1, 2):
        acc.step([regression_batch(3, seed=seed), regression_batch(5, seed=seed + 10)], mse)
    assert calls["mean_weight"] == 4 and calls["record"] == 2 and calls["close"] == 2  # once per count and window
    assert calls.states == {id(acc.state)} and acc.state.steps == 2


def test_exact_trainer_drives_it(calls):
    micro = S.rank_micro_batches(0, [2, 3, 1, 2])  # windows of 3 and 1 micro-batches
    _, trainer = S.hf_fit(gpt2(), [micro], exact=True)
    assert calls["sum_weight"] == 2 and calls["close"] == 2 and calls["record"] == 2  # W / N once per window
    assert calls.states == {id(trainer.accumulator_state)} and trainer.accumulator_state.steps == 2


def test_lightning_drives_it(calls):
    micro = S.masked_batches(1)  # windows of 2: the middle one holds no item
    _, trainer, cb = S.masked_fit(micro, exact=True)
    assert calls["mean_weight"] == 6 and calls["close"] == 3 and calls["record"] == 3
    assert calls.states == {id(cb.state)} and (cb.state.steps, cb.state.skipped) == (2, 1)
    assert trainer.global_step == 2
