"""Private Count-Min / CountSketch / Dyadic CountSketch (dp-linear-sketches)."""

import math
from fractions import Fraction

import numpy as np
import pytest

from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch
from pansketch.host_tools.lab.algorithms import linear
from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise, dgauss_lower_tail


def test_E_formulas_hand_values():
    # beta = 0.01, gamma = 2^-9, rho = 1: log(2/b) = ln 200 = 5.298317...
    lb = math.log(200)
    assert linear.paper_E(2**-9, 0.01, 1.0) == pytest.approx(math.sqrt(2 * lb) * math.sqrt(math.log(4 * 512 * lb / 0.01)))
    assert linear.paper_E(2**-9, 0.01, 1.0) == pytest.approx(12.1352, abs=1e-3)
    # the authors' code puts 1/beta outside the log: much larger
    assert linear.notebook_E(0.01, 2**-9, 1.0) == pytest.approx(237.209, abs=1e-2)
    assert linear.notebook_E(0.01, 0.01, 1.0) > 5 * linear.paper_E(0.01, 0.01, 1.0)
    assert linear.paper_rows(0.01) == 6 and linear.paper_cols(0.001) == 1000
    assert linear.paper_sigma2(0.01, 0.1) == pytest.approx(lb / 0.1)


def test_union_E_is_the_smallest_valid_offset():
    d, w, beta = 6, 512, 0.01
    var = float(linear.sigma2_for(d, 1.0))
    E = linear.union_E(d, w, var, beta)
    assert d * w * dgauss_lower_tail(var, E) <= beta / 2
    assert d * w * dgauss_lower_tail(var, E - 1) > beta / 2
    assert E <= linear.paper_E(1 / w, beta, 1.0)  # tighter than the paper's


def test_sigma2_calibration():
    assert linear.sigma2_for(6, 1) == Fraction(6)  # replace-one: 2d/(2 rho)
    assert linear.sigma2_for(6, 1, neighbours="addremove") == Fraction(3)
    assert linear.sigma2_for(6, "0.1") == Fraction(60)
    assert linear.sigma2_for(4, 1, arrays=16) == Fraction(64)
    with pytest.raises(ValueError):
        linear.sigma2_for(3, 0)


def test_private_sketch_equals_device_sketch_plus_noise():
    items = [int(x) for x in np.random.default_rng(0).integers(0, 300, 2000)]
    for kind in ("cms", "cs"):
        ps = linear.PrivateLinearSketch(kind, 4, 64, "salt", 1.0, noise=BulkNoise(3))
        noise0 = ps.counters.copy()
        ps.add(items)
        dev = Sketch(kind, 4, 64, hashing.salt_prefix("salt"))
        for x in items:
            dev.update(x)
        exact = np.frombuffer(dev.counters, dtype=np.int32).reshape(4, 64)
        assert np.array_equal(ps.counters - noise0, exact)
        back = ps.to_device()
        assert list(back.counters) == ps.counters.ravel().tolist()
        for x in items[:20]:
            est = ps.estimate([x])[0]
            assert est == pytest.approx(back.estimate(x) + ps.offset)


def test_private_cms_never_underestimates_with_offset():
    gen = np.random.default_rng(1)
    items = [int(x) for x in gen.zipf(1.3, 5000) if x < 10**6]
    keys, true = np.unique(items, return_counts=True)
    under = 0
    for seed in range(5):
        ps = linear.PrivateLinearSketch("cms", 6, 256, "s%d" % seed, 1.0, noise=BulkNoise(seed), offset="union",
                                        beta=0.01)
        ps.add(items)
        est = ps.estimate([int(k) for k in keys])
        under += int(np.sum(est < true))
    assert under == 0  # w.p. >= 1 - beta/2 per sketch


def test_private_countsketch_close_to_nonprivate():
    gen = np.random.default_rng(2)
    items = [int(x) for x in gen.integers(0, 2000, 20000)]
    keys, true = np.unique(items, return_counts=True)
    a = linear.PrivateLinearSketch("cs", 5, 512, "s", None)
    b = linear.PrivateLinearSketch("cs", 5, 512, "s", 10.0, noise=BulkNoise(4))
    a.add(items)
    b.add(items)
    ea = np.abs(a.estimate([int(k) for k in keys]) - true).mean()
    eb = np.abs(b.estimate([int(k) for k in keys]) - true).mean()
    assert eb < 1.5 * ea + 1
    # Theorem 3.2 uniform bound |f_hat - f_tilde| <= E w.h.p.
    E = linear.paper_E(1 / 512, 0.01, 10.0)
    assert np.max(np.abs(b.estimate([int(k) for k in keys]) - a.estimate([int(k) for k in keys]))) <= E


def test_theorem_bounds():
    assert linear.theorem31_bound(1000, 0.01, 3.0) == (0.0, 16.0)
    assert linear.theorem32_bound(1000, 0.01, 3.0) == 13.0


def test_offset_only_for_cms_and_needs_params():
    with pytest.raises(ValueError):
        linear.PrivateLinearSketch("cs", 3, 16, "s", 1.0, offset="paper", gamma=0.1, beta=0.1)
    with pytest.raises(ValueError):
        linear.PrivateLinearSketch("cms", 3, 16, "s", 1.0, offset="paper")
    with pytest.raises(ValueError):
        linear.PrivateLinearSketch("xx", 3, 16, "s", 1.0)


def test_dcs_rank_quantile_range_on_uniform_stream():
    gen = np.random.default_rng(5)
    v = gen.integers(0, 1 << 12, 20000)
    d, w = linear.dcs_shape(12, 0.01)
    dcs = linear.DyadicCountSketch(12, d, w, "dcs", 1.0, BulkNoise(6))
    dcs.add(v)
    srt = np.sort(v)
    xs = np.array([0, 5, 100, 2047, 4000, 4095])
    true = np.searchsorted(srt, xs, side="right")
    assert np.max(np.abs(dcs.rank_le(xs) - true)) < 0.01 * v.size  # gamma N
    qs = np.array([0.1, 0.25, 0.5, 0.75, 0.9])
    xq = dcs.quantile(qs, v.size)
    ranks = np.searchsorted(srt, xq, side="right") / v.size
    assert np.max(np.abs(ranks - qs)) < 0.01
    rc = dcs.range_count([100], [3000])[0]
    assert abs(rc - np.sum((v >= 100) & (v <= 3000))) < 0.01 * v.size
    assert abs(dcs.total() - v.size) < 0.01 * v.size
    with pytest.raises(ValueError):
        dcs.rank_lt([-1])
    with pytest.raises(ValueError):
        linear.DyadicCountSketch.exact_counts(np.array([1 << 12]), 12, 2, 8, "s")


def test_dcs_noiseless_exact_on_tiny_universe():
    # with w large enough that no level collides, ranks are exact
    v = np.array([0, 1, 1, 3, 7, 7, 7, 5])
    dcs = linear.DyadicCountSketch(3, 3, 4096, "t", None)
    dcs.add(v)
    for x in range(9):
        assert dcs.rank_lt([x])[0] == np.sum(v < x)
    assert dcs.quantile([0.5], 8)[0] == 3


def test_dcs_heavy_hitters_by_descent():
    gen = np.random.default_rng(7)
    v = np.concatenate([gen.integers(0, 1 << 16, 20000), np.full(900, 12345), np.full(600, 777), np.full(400, 65535)])
    d, w = linear.dcs_shape(16, 0.01)
    dcs = linear.DyadicCountSketch(16, d, w, "hh", 1.0, BulkNoise(8))
    dcs.add(v)
    hh = dcs.heavy_hitters(250)
    assert [x for x, _ in hh] == [12345, 777, 65535]
    assert abs(hh[0][1] - 900) < 60
    with pytest.raises(ValueError):
        dcs.heavy_hitters(-1e9, max_nodes=100)
