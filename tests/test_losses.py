from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradaccum import causal_lm_loss, token_cross_entropy


def test_causal_shift_and_count():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, 4, -100], [5, 6, -100, -100, -100]])
    mean, count = causal_lm_loss(logits, labels)
    assert count.item() == 3 + 1
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert mean.item() == pytest.approx(expected.item(), rel=1e-12)
    assert mean.dtype == torch.float64


def test_no_target_gives_zero_weight_not_nan():
    mean, count = causal_lm_loss(torch.randn(1, 3, 4), torch.tensor([[1, -100, -100]]))
    assert count.item() == 0 and mean.item() == 0.0


def test_low_precision_logits_are_upcast():
    mean, _ = token_cross_entropy(torch.randn(4, 3).bfloat16(), torch.tensor([0, 1, 2, 0]))
    assert mean.dtype == torch.float32


def test_shape_errors():
    with pytest.raises(ValueError, match="do not match targets"):
        token_cross_entropy(torch.randn(4, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"expects logits \(batch, seq, vocab\)"):
        causal_lm_loss(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
