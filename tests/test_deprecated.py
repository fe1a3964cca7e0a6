"""The old public names of renamed concepts (one name per concept, #37): the Accumulator's still read the
new name and say so with a DeprecationWarning naming the replacement; a Trainer checkpoint saved under a
pre-release key is refused, not read as fresh."""
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
    ("SomethingElse", {"attributes": {"saved": {"skipped": 9}}}, 0)])
def test_the_trainers_saved_state_loads_under_its_name_only(key, saved, skipped):
    hf_trainer = pytest.importorskip("gradaccum.integrations.hf_trainer")
    callback = hf_trainer.TrainerWindowState()
    callback.load({key: saved})
    assert callback.accumulator_state.skipped == skipped


@pytest.mark.parametrize("key", ["_StateCallback", "_Skips"])
def test_a_checkpoint_under_a_pre_release_key_is_refused_not_read_as_fresh(key):
    """Read as fresh, its 2 skipped windows would move the resumed data position, silently."""
    hf_trainer = pytest.importorskip("gradaccum.integrations.hf_trainer")
    from gradaccum import ConfigurationError

    callback = hf_trainer.TrainerWindowState()
    with pytest.raises(ConfigurationError, match=rf"holds \['{key}'\].*resume it with the gradaccum that wrote it"):
        callback.load({key: {"attributes": {"saved": {"steps": 5, "skipped": 2}}}})
