"""Exact discrete samplers: goodness of fit, moments, and no floats.

Fixed seeds; every threshold comes from the sampling distribution of the
statistic (chi-square quantile, normal standard errors), not from tuning.
"""

import ast
import math
from pathlib import Path

import pytest
from scipy import stats

from pansketch.agent.noise import bernoulli_exp, discrete_gaussian, discrete_laplace, isqrt
from pansketch.agent.rng import DeterministicSource, Rng, bit_length

N = 20000
ALPHA = 1e-3  # per-test false-alarm rate of the chi-square tests


def dlap_pmf(t):
    p = math.exp(-1 / t)
    return lambda x: (1 - p) / (1 + p) * p ** abs(x)


def dgauss_pmf(var):
    z = sum(math.exp(-k * k / (2 * var)) for k in range(-2000, 2001))
    return lambda x: math.exp(-x * x / (2 * var)) / z


def chi_square_pvalue(samples, pmf):
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    lo, hi = min(samples), max(samples)
    # central bins with expected >= 5, tails pooled
    bins = []
    for x in range(lo - 1, hi + 2):
        bins.append((x, n * pmf(x), counts.get(x, 0)))
    central = [b for b in bins if b[1] >= 5]
    exp_in = sum(b[1] for b in central)
    obs_in = sum(b[2] for b in central)
    stat = sum((o - e) ** 2 / e for _, e, o in central)
    tail_e = n - exp_in
    tail_o = n - obs_in
    k = len(central)
    if tail_e >= 5:
        stat += (tail_o - tail_e) ** 2 / tail_e
        k += 1
    return stats.chi2.sf(stat, k - 1)


@pytest.mark.slow
@pytest.mark.parametrize("num,den", [(1, 2), (1, 1), (3, 1), (25, 2)])
def test_discrete_laplace_fits_exact_pmf(num, den):
    t = num / den
    rng = Rng(DeterministicSource("dlap-%d-%d" % (num, den)))
    xs = [discrete_laplace(rng, num, den) for _ in range(N)]
    assert chi_square_pvalue(xs, dlap_pmf(t)) > ALPHA
    p = math.exp(-1 / t)
    var = 2 * p / (1 - p) ** 2
    mean = sum(xs) / N
    assert abs(mean) < 4.5 * math.sqrt(var / N)
    m2 = sum(x * x for x in xs) / N
    m4 = sum(dlap_pmf(t)(k) * k**4 for k in range(-2000, 2001))
    assert abs(m2 - var) < 4.5 * math.sqrt((m4 - var * var) / N)


@pytest.mark.slow
@pytest.mark.parametrize("num,den", [(1, 4), (1, 1), (4, 1), (50, 1), (1000, 7)])
def test_discrete_gaussian_fits_exact_pmf(num, den):
    var_param = num / den
    pmf = dgauss_pmf(var_param)
    rng = Rng(DeterministicSource("dg-%d-%d" % (num, den)))
    xs = [discrete_gaussian(rng, num, den) for _ in range(N)]
    assert chi_square_pvalue(xs, pmf) > ALPHA
    true_var = sum(pmf(k) * k * k for k in range(-2000, 2001))
    assert true_var <= var_param + 1e-9  # CKS 2020 Cor. 9: Var <= sigma^2
    m4 = sum(pmf(k) * k**4 for k in range(-2000, 2001))
    mean = sum(xs) / N
    m2 = sum(x * x for x in xs) / N
    assert abs(mean) < 4.5 * math.sqrt(true_var / N)
    assert abs(m2 - true_var) < 4.5 * math.sqrt((m4 - true_var**2) / N)


def test_discrete_laplace_rejects_a_wrong_scale():
    """The fit test has power: samples at scale 3 are rejected against scale 3.3."""
    rng = Rng(DeterministicSource("power"))
    xs = [discrete_laplace(rng, 3, 1) for _ in range(N)]
    assert chi_square_pvalue(xs, dlap_pmf(3.3)) < ALPHA


@pytest.mark.parametrize("num,den", [(0, 1), (1, 3), (1, 1), (5, 2), (7, 1)])
def test_bernoulli_exp_probability(num, den):
    rng = Rng(DeterministicSource("bexp-%d-%d" % (num, den)))
    n = 20000
    k = sum(bernoulli_exp(rng, num, den) for _ in range(n))
    p = math.exp(-num / den)
    assert abs(k - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)) + 1e-9


def test_uniform_integers_are_uniform():
    rng = Rng(DeterministicSource("unif"))
    m = 37
    n = 37 * 500
    counts = [0] * m
    for _ in range(n):
        counts[rng.randbelow(m)] += 1
    stat = sum((c - 500) ** 2 / 500 for c in counts)
    assert stats.chi2.sf(stat, m - 1) > ALPHA


def test_integer_helpers():
    for n in [0, 1, 2, 3, 4, 15, 16, 17, 10**12, 10**30 + 7]:
        r = isqrt(n)
        assert r * r <= n < (r + 1) * (r + 1)
        assert bit_length(n) == n.bit_length()


def test_same_seed_same_noise_different_seed_different_noise():
    a = [discrete_gaussian(Rng(DeterministicSource("s")), 9, 1) for _ in range(1)]
    r1, r2, r3 = (Rng(DeterministicSource(s)) for s in ("s", "s", "t"))
    s1 = [discrete_gaussian(r1, 9, 1) for _ in range(200)]
    s2 = [discrete_gaussian(r2, 9, 1) for _ in range(200)]
    s3 = [discrete_gaussian(r3, 9, 1) for _ in range(200)]
    assert s1 == s2 and s1 != s3 and a[0] == s1[0]


NOISE_PATH = ["agent/noise.py", "agent/rng.py", "agent/pi/bulknoise.py"]  # bulknoise: the Pi daemon's numpy path


@pytest.mark.parametrize("path", NOISE_PATH)
def test_no_floating_point_on_the_noise_path(path):
    """No float literals, true division, float(), math or random module."""
    src = (Path(__file__).resolve().parent.parent / path).read_text()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, float):
            pytest.fail("float literal %r in %s" % (node.value, path))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            pytest.fail("true division in %s line %d" % (path, node.lineno))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "float":
            pytest.fail("float() in %s" % path)
        if isinstance(node, ast.Attribute) and "float" in node.attr:
            pytest.fail("%s in %s line %d" % (node.attr, path, node.lineno))  # np.float64, astype(np.float32)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            allowed = {"numpy"} if path == "agent/pi/bulknoise.py" else set()  # integer dtypes only (checked above)
            assert not ({"math", "random", "numpy"} - allowed) & set(names), "forbidden import in %s" % path
