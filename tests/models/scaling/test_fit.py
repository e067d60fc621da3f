"""Fits recover known laws exactly on synthetic numbers; bands, frontier and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from models.scaling.fit import fit_log_linear, fit_power_law, frontier

COMPUTE = np.geomspace(1e9, 1e12, 7)


def test_log_linear_recovers_an_exact_law():
    ne = 0.95 - 0.04 * np.log10(COMPUTE)
    fit = fit_log_linear(COMPUTE, ne)
    assert fit.a == pytest.approx(0.95, abs=1e-10)
    assert fit.b == pytest.approx(0.04, abs=1e-12)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.decades == pytest.approx(3.0)
    lo, hi = fit.band(COMPUTE)
    np.testing.assert_allclose(lo, ne, atol=1e-9)  # no residual -> no width
    np.testing.assert_allclose(hi, ne, atol=1e-9)


def test_log_linear_band_covers_the_truth_with_noise():
    rng = np.random.default_rng(0)
    truth = 0.9 - 0.03 * np.log10(COMPUTE)
    fit = fit_log_linear(COMPUTE, truth + rng.normal(0, 0.002, len(COMPUTE)))
    lo, hi = fit.band(COMPUTE)
    assert (hi > lo).all()
    assert ((lo <= truth) & (truth <= hi)).mean() >= 0.7
    slope_lo, slope_hi = fit.slope_ci()
    assert slope_lo < 0.03 < slope_hi
    assert 0.9 < fit.r2 < 1.0


def test_power_law_recovers_its_parameters():
    c0 = COMPUTE.min()
    ne = 0.6 + 0.3 * (COMPUTE / c0) ** -0.35
    fit = fit_power_law(COMPUTE, ne)
    assert (fit.e, fit.a, fit.alpha) == pytest.approx((0.6, 0.3, 0.35), rel=1e-5)
    assert fit.r2 == pytest.approx(1.0)
    np.testing.assert_allclose(fit.predict(COMPUTE), ne, rtol=1e-6)
    lo, hi = fit.band(COMPUTE)
    assert (lo <= ne + 1e-6).all() and (ne - 1e-6 <= hi).all()


def test_frontier_is_the_lower_envelope():
    compute = [1e9, 2e9, 4e9, 8e9, 1.6e10]
    ne = [0.90, 0.92, 0.85, 0.86, 0.80]
    assert frontier(compute, ne).tolist() == [0, 2, 4]


@pytest.mark.parametrize(
    ("compute", "ne", "message"),
    [
        ([1e9], [0.9], "at least 2"),
        ([1e9, 1e9], [0.9, 0.8], "same compute"),
        ([1e9, -1.0], [0.9, 0.8], "positive"),
        ([1e9, 2e9], [0.9], "equally long"),
    ],
)
def test_bad_input_is_named(compute, ne, message):
    with pytest.raises(ValueError, match=message):
        fit_log_linear(compute, ne)


def test_power_law_needs_four_points():
    with pytest.raises(ValueError, match="at least 4"):
        fit_power_law([1e9, 1e10, 1e11], [0.9, 0.8, 0.75])
