"""Vectorised exact samplers (pansketch.host_tools.lab.algorithms.vnoise) match the exact pmfs."""

from fractions import Fraction

import numpy as np
import pytest

from pansketch.host_tools.lab.algorithms import vnoise


def _chi2_ok(samples: np.ndarray, pmf, support: np.ndarray) -> None:
    n = samples.size
    counts = np.array([(samples == x).sum() for x in support])
    exp = pmf * n
    mask = exp >= 20
    chi2 = float((((counts - exp) ** 2) / exp)[mask].sum())
    k = int(mask.sum())
    # mean k, sd sqrt(2k): 6 sd above the mean fails with prob ~1e-9; a wrong scale fails by orders of magnitude
    assert chi2 < k + 6 * np.sqrt(2 * k), (chi2, k)
    rest = counts[~mask].sum()
    assert rest <= exp[~mask].sum() + 6 * np.sqrt(exp[~mask].sum() + 1) + 5


@pytest.mark.parametrize("var", [Fraction(1, 3), Fraction(6), Fraction(60), vnoise.ceil_fraction(19966.516725)])
def test_discrete_gaussian_pmf(var):
    g = np.random.Generator(np.random.PCG64(11))
    x = vnoise.discrete_gaussian(g, var, 60000)
    s = float(var) ** 0.5
    sup = np.arange(-int(6 * s) - 2, int(6 * s) + 3)
    _chi2_ok(x, vnoise.dgauss_pmf(float(var), sup), sup)


@pytest.mark.parametrize("scale", [Fraction(1, 2), Fraction(3), Fraction(100, 7)])
def test_discrete_laplace_pmf(scale):
    g = np.random.Generator(np.random.PCG64(12))
    x = vnoise.discrete_laplace(g, scale, 60000)
    sup = np.arange(-int(12 * float(scale)) - 2, int(12 * float(scale)) + 3)
    _chi2_ok(x, vnoise.dlap_pmf(float(scale), sup), sup)


def test_bernoulli_exp_rates():
    g = np.random.Generator(np.random.PCG64(13))
    n = 200000
    for num, den in ((0, 1), (1, 3), (1, 1), (7, 3)):
        b = vnoise.bernoulli_exp(g, np.full(n, num), np.full(n, den))
        p = np.exp(-num / den)
        assert abs(b.mean() - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-12


def test_engines_and_pool():
    z = vnoise.ZeroNoise()
    assert not z.dgauss(Fraction(3), 5).any()
    pool = vnoise.Pool(vnoise.BulkNoise(1), "dlap", Fraction(2), block=7)
    xs = pool.draws(20) + [pool.draw() for _ in range(10)]
    assert len(xs) == 30 and all(isinstance(v, int) for v in xs)
    from pansketch.agent.rng import DeterministicSource, Rng

    e = vnoise.ExactNoise(Rng(DeterministicSource(b"x")))
    assert e.dgauss(Fraction(5), 3).dtype == np.int64


def test_ceil_fraction_rounds_up():
    for x in (0.123456789, 6.0, 19966.516725, 1e-7, 3.3e7):
        f = vnoise.ceil_fraction(x)
        assert f >= x and float(f) - x <= max(1e-6 * x, 1e-12) * 1.01 + 1e-12
    with pytest.raises(ValueError):
        vnoise.ceil_fraction(0)


def test_overflow_is_refused():
    g = np.random.Generator(np.random.PCG64(1))
    with pytest.raises(OverflowError):
        vnoise.discrete_gaussian(g, Fraction(10**20, 3), 3)
