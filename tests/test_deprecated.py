"""The old public names of renamed concepts (one name per concept, #37): each still reads the new
name and says so with a DeprecationWarning naming the replacement."""
from types import SimpleNamespace

import pytest
import torch

from gradaccum import Accumulator
from gradaccum._state import AccumulatorState


def test_the_accumulators_old_names_read_the_state_and_warn():
    model = torch.nn.Linear(2, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.state.reference, acc.state.count_ratio = 6.0, 2.0
    with pytest.warns(DeprecationWarning, match=r"Accumulator.reference_items is deprecated: read .state.reference"):
        assert acc.reference_items == 6.0
    with pytest.warns(DeprecationWarning, match=r"read .state.count_ratio"):
        assert acc.count_ratio == 2.0
    with pytest.warns(DeprecationWarning, match=r"AccumulatorState.first_reference is deprecated: read .reference"):
        assert acc.state.first_reference == 6.0
    with pytest.raises(AttributeError):  # read-only: the state owns R
        acc.state.first_reference = 1.0


@pytest.mark.parametrize("module, cls, old", [("gradaccum.integrations.hf_trainer", "ExactTrainer", "windows_skipped"),
                                              ("gradaccum.integrations.lightning", "ExactAccumulation", "skipped_windows")])
def test_the_trainer_drivers_old_skip_counts_read_skipped(module, cls, old):
    owner = getattr(pytest.importorskip(module), cls)
    stand_in = SimpleNamespace(skipped=3)
    with pytest.warns(DeprecationWarning, match=rf"read \.skipped$"):
        assert getattr(owner, old).fget(stand_in) == 3
    assert isinstance(owner.skipped, property)


@pytest.mark.parametrize("key, saved, skipped", [
    ("TrainerWindowState", {"attributes": {"saved": {"steps": 5, "skipped": 2}}}, 2),
    ("_StateCallback", {"attributes": {"saved": {"steps": 5, "skipped": 2}}}, 2),  # the name before the rename
    ("_Skips", {"attributes": {"windows": 2}}, 2),  # the first checkpoints: only the skipped windows
    ("SomethingElse", {"attributes": {"saved": {"skipped": 9}}}, 0)])
def test_the_trainers_saved_state_loads_under_each_name_it_was_saved_as(key, saved, skipped):
    hf_trainer = pytest.importorskip("gradaccum.integrations.hf_trainer")
    callback = hf_trainer.TrainerWindowState()
    callback.load({key: saved})
    assert callback.accumulator_state.skipped == skipped
