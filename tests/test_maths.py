"""The boundary's maths on plain numbers: the backward weight, the boundary scale, the clip
coefficient and the verdict, each alone (see gradaccum._weights for the derivation)."""
from __future__ import annotations

import math

import pytest
import torch

from gradaccum._weights import Verdict, backward_weight, boundary_scale, clip_coefficient, verdict


@pytest.mark.parametrize("counts, world", [([4, 4, 3], 1), ([5, 1], 2), ([1, 2, 3, 4, 5], 4)])
def test_weights_times_the_boundary_scale_give_n_k_over_N(counts, world):
    """Whatever R is, w_k * (R / N) / W = n_k / N: the window's mean gradient is exact."""
    n = sum(counts) * world  # every rank holds the same counts here
    for reference in (float(n), 7.0, 1000.0):
        scale = boundary_scale(reference, n)
        for c in counts:
            assert math.isclose(backward_weight(c, reference, world) * scale / world, c / n, rel_tol=1e-15)


def test_reference_equal_to_the_count_needs_no_scaling_pass():
    assert boundary_scale(12.0, 12.0) == 1.0
    assert backward_weight(3, 12.0, 1.0) == 3 / 12  # exactly n_k / N, as one big batch weighs it


def test_an_empty_window_scales_to_zero():
    assert boundary_scale(12.0, 0.0) == 0.0


def test_a_tensor_count_stays_a_tensor_in_the_loss_precision():
    w = backward_weight(torch.tensor(3), 12.0, 2.0, torch.float64)
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float64 and w.item() == 0.5
    assert backward_weight(torch.tensor(3), 12.0, 2.0, torch.bfloat16).dtype == torch.float32


@pytest.mark.parametrize("norm, limit, expect", [(4.0, 1.0, 1.0 / (4.0 + 1e-6)), (0.5, 1.0, 1.0), (3.0, None, 1.0)])
def test_clip_coefficient_matches_clip_grad_norm(norm, limit, expect):
    assert clip_coefficient(norm, limit) == expect
    if limit is not None:  # torch's own clip gives the same factor
        g = torch.full((4,), norm / 2, dtype=torch.float64)
        torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(g.clone())], limit)
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], limit)
        assert torch.allclose(p.grad, g * expect, rtol=1e-15, atol=0)


@pytest.mark.parametrize("loss_sum, items, norm, nonfinite, scaler, expect", [
    (2.0, 4, None, "skip", False, Verdict.STEP),
    (2.0, 4, 1.5, "raise", False, Verdict.STEP),
    (0.0, 0, None, "raise", False, Verdict.SKIP_EMPTY),
    (math.nan, 4, None, "skip", False, Verdict.SKIP_NONFINITE),
    (math.inf, 4, None, "raise", False, Verdict.RAISE),
    (2.0, 4, math.inf, "raise", False, Verdict.RAISE),
    (2.0, 4, math.nan, "skip", False, Verdict.SKIP_NONFINITE),
    (2.0, 4, math.inf, "raise", True, Verdict.SKIP_NONFINITE),  # fp16 overflow: the scaler backs off
])
def test_verdict(loss_sum, items, norm, nonfinite, scaler, expect):
    assert verdict(loss_sum, items, norm, nonfinite=nonfinite, has_scaler=scaler) is expect
