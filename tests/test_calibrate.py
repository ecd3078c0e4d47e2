"""Calibration formulas against hand-computed values and exact divergences."""

import math

import pytest

from pansketch.agent import calibrate
from pansketch.agent.noise import NoiseSpec


@pytest.mark.parametrize(
    "value,expected",
    [("0.5", (1, 2)), ("1/3", (1, 3)), (2, (2, 1)), ("1e-2", (1, 100)), ("2.50", (5, 2)), (" 3 ", (3, 1))],
)
def test_parse_ratio(value, expected):
    assert calibrate.parse_ratio(value) == expected


@pytest.mark.parametrize("bad", ["abc", "1/0", "", 0.5, True])
def test_parse_ratio_rejects(bad):
    with pytest.raises((ValueError, ZeroDivisionError)):
        calibrate.parse_ratio(bad)


@pytest.mark.parametrize(
    "mech,budget,d,clip,arrays,expected",
    [
        # discrete Laplace: t = L*d*c / eps
        ("dlap", "1/2", 4, 1, 1, NoiseSpec("dlap", 8, 1)),
        ("dlap", "1", 4, 1, 3, NoiseSpec("dlap", 12, 1)),
        ("dlap", "0.3", 5, 2, 1, NoiseSpec("dlap", 100, 3)),
        # discrete Gaussian: sigma^2 = L*d*c^2 / (2 rho)
        ("dgauss", "1/2", 4, 1, 1, NoiseSpec("dgauss", 4, 1)),
        ("dgauss", "0.1", 5, 2, 1, NoiseSpec("dgauss", 100, 1)),
        ("dgauss", "2", 3, 1, 4, NoiseSpec("dgauss", 3, 1)),
    ],
)
def test_noise_for_hand_values(mech, budget, d, clip, arrays, expected):
    spec = calibrate.noise_for(mech, budget, d, clip, arrays)
    assert spec == expected
    name, got = calibrate.guarantee(spec, d, clip, arrays)
    assert name == ("eps" if mech == "dlap" else "rho")
    assert got == calibrate.parse_ratio(budget)


def test_zcdp_conversion_hand_value():
    # rho = 1/2, delta = 1e-6: 0.5 + 2*sqrt(0.5*ln(1e6)) = 5.7566...
    assert calibrate.zcdp_to_approx_dp((1, 2), 1e-6) == pytest.approx(5.75652, abs=1e-4)


def test_dlap_privacy_loss_is_exactly_eps():
    """max_x log P(x)/P(x+c) for one cell, summed over d rows, equals eps."""
    d, clip, eps = 4, 2, (3, 4)
    spec = calibrate.noise_for("dlap", eps, d, clip)
    t = spec.num / spec.den
    p = math.exp(-1 / t)
    def pmf(x):
        return p ** abs(x)  # normalisation cancels

    per_cell = max(math.log(pmf(x) / pmf(x + clip)) for x in range(-50, 50))
    assert d * per_cell == pytest.approx(eps[0] / eps[1], rel=1e-9)


@pytest.mark.parametrize("alpha", [1.5, 2, 4, 10])
def test_dgauss_renyi_divergence_within_rho(alpha):
    """D_alpha(N_Z(0,s2) || N_Z(c,s2)) summed over d cells <= alpha * rho (CKS 2020 Thm 14)."""
    d, clip, rho = 4, 1, (1, 2)
    spec = calibrate.noise_for("dgauss", rho, d, clip)
    s2 = spec.num / spec.den
    ks = range(-200, 201)
    logz = math.log(sum(math.exp(-k * k / (2 * s2)) for k in ks))
    def logp(k):
        return -k * k / (2 * s2) - logz

    terms = [alpha * logp(k) + (1 - alpha) * logp(k - clip) for k in ks]
    m = max(terms)
    div = (m + math.log(sum(math.exp(t - m) for t in terms))) / (alpha - 1)
    total = d * div
    assert total <= alpha * rho[0] / rho[1] + 1e-9
    # and the bound is tight for the discrete Gaussian at integer shifts (not loose by 2x)
    assert total >= 0.99 * alpha * rho[0] / rho[1]
