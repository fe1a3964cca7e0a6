"""gradaccum's refusals are one family: a GradaccumError (a ValueError), by kind."""

import pytest
import torch

import gradaccum
from gradaccum import Accumulator, ConfigurationError, GradaccumError, SplitError, check_equivalence


def _acc():
    model = torch.nn.Linear(3, 1)
    return model, Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_every_kind_is_a_gradaccum_error_and_a_value_error():
    for cls in (gradaccum.ConfigurationError, gradaccum.NotExactError, gradaccum.SplitError,
                gradaccum.RankAgreementError):
        assert issubclass(cls, GradaccumError) and issubclass(cls, ValueError)
    assert issubclass(gradaccum.NotExactError, ConfigurationError)


def test_a_bad_argument_is_a_configuration_error():
    model, acc = _acc()
    with pytest.raises(ConfigurationError, match="epochs must be an int >= 0"):
        acc.train([], lambda m, b: m(b).sum(), accum_steps=2, epochs=-1)
    with pytest.raises(ConfigurationError, match="max_grad_norm"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=-1.0)


def test_a_batch_that_cannot_be_split_is_a_split_error():
    _, acc = _acc()
    x, y = torch.randn(4, 3), torch.randn(5, 1)
    with pytest.raises(SplitError, match="leading dimension"):
        acc.step((x, y), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1][:4]), micro_batch_size=2)
    model = torch.nn.Linear(3, 1)
    with pytest.raises(SplitError) as refused:  # the checker's split carries the sizes
        check_equivalence(model, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                          (torch.randn(4, 3), torch.randn(4, 1)), micro_batch_size=4)
    assert refused.value.micro_batch_size == 4 and refused.value.items == 4


def test_the_checkers_split_error_is_the_one_error():
    from gradaccum.checking import SplitError as checking_split

    assert checking_split is SplitError
