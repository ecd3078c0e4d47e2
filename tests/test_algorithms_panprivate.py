"""pan-private-sketches: cropped sum (§4.1), HH count (§4.2), distinct-count sketch (Alg. 1)."""

import math
from fractions import Fraction

import numpy as np
import pytest

from pansketch.agent import hashing
from pansketch.host_tools.lab.algorithms.distinct import DistinctSketch
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools.lab.algorithms import panprivate as pp


def test_cropped_sum_on_known_vector_is_unbiased():
    a = np.array([0, 1, 2, 5, 9, 10, 40, 0, 3] * 50)
    tau = 5
    true = np.minimum(a, tau).sum()  # 1+2+5+5+5+5+3 = 26 per block
    assert true == 26 * 50
    gen = np.random.default_rng(0)
    ests = np.array([pp.simulate_cropped_sum(a, tau, 1.0, gen)[1] for _ in range(3000)])
    se = ests.std() / math.sqrt(ests.size)
    assert abs(ests.mean() - true) < 4 * se
    bound, fail = pp.lemma5_bound(2.0, tau, a.size, 1.0)
    assert np.mean(np.abs(ests - true) > bound) <= fail + 0.01


def test_per_event_cropped_sum_matches_simulation_in_mean():
    a = [0, 1, 3, 7, 2, 9, 0, 4] * 8
    tau, eps = 4, Fraction(1)
    rng = Rng(DeterministicSource(b"cs"))
    ones = []
    for _ in range(300):
        cs = pp.CroppedSum(len(a), tau, eps, rng)
        for j, v in enumerate(a):
            for _ in range(v):
                cs.update(j)
        ones.append(cs.ones())
    # E[o] = m/2 + eps T/(4 tau)
    T = sum(min(v, tau) for v in a)
    expect = len(a) / 2 + T / (4 * tau)
    assert abs(np.mean(ones) - expect) < 4 * np.std(ones) / math.sqrt(len(ones))
    cs = pp.CroppedSum(4, 3, eps, rng)
    with pytest.raises(ValueError):
        cs.update(0, -1)
    with pytest.raises(ValueError):
        cs.update(4)
    with pytest.raises(ValueError):
        pp.CroppedSum(4, 3, 3.0, rng)


def test_heavy_hitter_count_finds_heavy_buckets():
    gen = np.random.default_rng(1)
    n, k = 20000, 10
    counts = np.zeros(200, dtype=np.int64)
    counts[:3] = [5000, 4000, 3000]  # 3 heavy (>= n/k = 2000)
    counts[3:] = np.full(197, (n - 12000) // 197)
    ests = [pp.hh_count_simulated(counts, k, 2.0, n, 1.0, gen) for _ in range(400)]
    assert abs(np.mean(ests) - 3) < 4 * np.std(ests) / 20 + 0.5
    # per-event class runs and hashes with hash version 1
    hh = pp.HeavyHitterCount(64, 4, 2.0, 400, Fraction(1), "hh", Rng(DeterministicSource(b"h")))
    for x in [1] * 300 + list(range(100, 200)):
        hh.update(x)
    assert hh.bucket(1) == hashing.row_value(hashing.digest(hashing.salt_prefix("hh"), 1, 1), 0) % 64
    assert isinstance(hh.estimate(), float)
    lo, hi = pp.theorem12_bounds(3, 5, 160, 2.0, 1.0, 1.0, 0.25)
    assert lo < 3 < 5 < hi


def test_distinct_projection_is_bounded_and_matches_host_replay():
    prefix = hashing.salt_prefix("dc")
    sk = DistinctSketch(8, prefix, Rng(DeterministicSource(b"d")), (1, 1), q=4, vbits=10, frac_bits=2,
                        counters=[0] * 8)
    items = [int(x) for x in np.random.default_rng(2).integers(0, 500, 2000)]
    for x in items:
        sk.update(x)
    keys, cnt = np.unique(items, return_counts=True)
    host = pp.distinct_sketch_counts([int(k) for k in keys], cnt, 8, "dc", q=4, vbits=10, frac_bits=2)
    assert host == sk.sk
    X = pp.projections(__import__("pansketch.host_tools.fasthash", fromlist=["x"]).streams(list(range(3000)), "dc", 8), 8, 4, 10, 2)
    assert max(abs(v) for row in X for v in row) <= sk.bound == 1 << (12 * 4)
    # sensitivity: one event moves each entry by at most clip * M
    before = list(sk.sk)
    sk.update(12345, 7)  # clipped to 1
    assert all(abs(a - b) <= sk.bound for a, b in zip(sk.sk, before))


def test_distinct_noise_scale_and_release():
    prefix = hashing.salt_prefix("dc")
    rng = Rng(DeterministicSource(b"n"))
    s = DistinctSketch(4, prefix, rng, (1, 2), q=2, vbits=6, frac_bits=0)
    M = 1 << 12
    assert (s.scale_num, s.scale_den) == (4 * M * 2, 1)  # r * clip * M / eps, eps = 1/2
    u = DistinctSketch(4, prefix, rng, (1, 2), q=2, vbits=6, frac_bits=0, unit="user", z=3)
    assert u.scale_num == 4 * 2 * 3 * M * 2
    rel = s.release()
    assert rel != s.sk and len(rel) == 4  # fresh output noise, state unchanged
    with pytest.raises(ValueError):
        DistinctSketch(4, prefix, rng, (1, 1), vbits=31)


@pytest.mark.slow
def test_distinct_estimator_without_noise():
    keys = np.arange(3000)
    sf = pp.distinct_scale(16, 16, 8)
    sk = pp.distinct_sketch_counts([int(k) for k in keys], np.ones(3000, dtype=np.int64), 64, "e", 16, 16, 8)
    est = pp.distinct_estimate(sk, sf, 16, 8)
    assert 0.6 * 3000 < est < 1.6 * 3000
    xi = pp.lemma4_xi(1 << (24 * 16), 64, 1.0, 0.05, 16)
    assert xi > 2**24  # the Lemma 4 additive term is of order 2^(b+F): the noise floor
