"""The old public names of renamed concepts (one name per concept, #37): each still reads the new
name and says so with a DeprecationWarning naming the replacement."""
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


@pytest.mark.parametrize("key, saved, skipped", [
    ("TrainerWindowState", {"attributes": {"saved": {"steps": 5, "skipped": 2}}}, 2),
    ("_StateCallback", {"attributes": {"saved": {"steps": 5, "skipped": 2}}}, 0),  # pre-release names: not read
    ("SomethingElse", {"attributes": {"saved": {"skipped": 9}}}, 0)])
def test_the_trainers_saved_state_loads_under_its_name_only(key, saved, skipped):
    hf_trainer = pytest.importorskip("gradaccum.integrations.hf_trainer")
    callback = hf_trainer.TrainerWindowState()
    callback.load({key: saved})
    assert callback.accumulator_state.skipped == skipped
