"""The Trainer drivers' saved window state: a checkpoint loads under its own key only, and one saved under a
pre-release key is refused, not read as fresh."""
import pytest

hf_trainer = pytest.importorskip("gradaccum.integrations.hf_trainer")

from gradaccum import ConfigurationError  # noqa: E402


@pytest.mark.parametrize("key, saved, skipped", [
    ("TrainerWindowState", {"attributes": {"saved": {"steps": 5, "skipped": 2}}}, 2),
    ("SomethingElse", {"attributes": {"saved": {"skipped": 9}}}, 0)])
def test_the_trainers_saved_state_loads_under_its_name_only(key, saved, skipped):
    callback = hf_trainer.TrainerWindowState()
    callback.load({key: saved})
    assert callback.accumulator_state.skipped == skipped


@pytest.mark.parametrize("key", ["_StateCallback", "_Skips"])
def test_a_checkpoint_under_a_pre_release_key_is_refused_not_read_as_fresh(key):
    """Read as fresh, its 2 skipped windows would move the resumed data position, silently."""
    callback = hf_trainer.TrainerWindowState()
    with pytest.raises(ConfigurationError, match=rf"holds \['{key}'\].*resume it with the gradaccum that wrote it"):
        callback.load({key: {"attributes": {"saved": {"steps": 5, "skipped": 2}}}})
