"""intermittent-queries Algorithms 1-4, Proposition 1, Theorem 5."""

from fractions import Fraction

import pytest
import numpy as np

from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools import fasthash
from pansketch.host_tools.lab.algorithms import intermittent as iq
from pansketch.host_tools.lab.algorithms.vnoise import BulkNoise, ExactNoise, ZeroNoise


def test_m_hat_q_upper_bounds_m_q():
    gen = np.random.default_rng(0)
    for _ in range(40):
        d, w, n = int(gen.integers(1, 4)), int(gen.integers(2, 6)), int(gen.integers(1, 7))
        cols = gen.integers(0, w, size=(n, d))
        assert iq.m_q_exact(cols) <= iq.m_hat_q(cols, w)
        if n <= d:  # Proposition 1, second part (distinct columns per row guaranteed by construction below)
            pass
    # n_Q <= d with the i-th query alone in its cell of row i: m_Q = n_Q
    cols = np.array([[0, 1, 1], [1, 0, 1], [1, 1, 0]])
    assert iq.m_q_exact(cols) == 3
    assert iq.m_hat_q(np.zeros((5, 3), dtype=int), 4) == 15


def test_dynamic_sketch_is_count_sketch():
    s = iq.DynamicCountSketch(5, 1024, "x")
    for x in [1] * 50 + [2] * 7:
        s.update(x)
    assert s.query([1, 2, 3]) == [50.0, 7.0, 0.0]


@pytest.mark.slow
def test_use_and_keep_accumulates_noise_and_simulation_matches():
    gen = np.random.default_rng(1)
    stream = [int(x) for x in gen.integers(0, 40, 600)]
    d, w = 3, 16
    times = [100, 250, 400, 600]
    qsets = [[1, 2, 3], [2, 5], [1, 7, 8, 9], [3]]
    alg = iq.UseAndKeep(d, w, "k", Fraction(1), noise=ZeroNoise())
    answers = []
    t0 = 0
    for t, Q in zip(times, qsets):
        for x in stream[t0:t]:
            alg.update(x)
        t0 = t
        answers += alg.query(Q)
    keys = sorted(set(stream) | {x for Q in qsets for x in Q})
    st = fasthash.streams(keys, "k", d)
    cols, signs = fasthash.cols_signs(st, d, w)
    inv = np.searchsorted(keys, stream)
    q_items = np.searchsorted(keys, [x for Q in qsets for x in Q])
    q_k = np.repeat(np.arange(len(qsets)), [len(Q) for Q in qsets])
    sim = iq.simulate_use_and_keep(cols, signs, inv, w, d, np.array(times), q_items, q_k, Fraction(1), ZeroNoise())
    assert np.allclose(sim, answers)
    # with noise: the noise is kept in the cell, so the 50th answer carries 50 draws (variance x50)
    eng = BulkNoise(3)
    first, last = [], []
    for _ in range(100):
        alg = iq.UseAndKeep(1, 4, "k", Fraction(1, 2), noise=eng)
        vals = [alg.query([0])[0] for _ in range(50)]
        first.append(vals[0])
        last.append(vals[-1])
    assert np.var(last) > 15 * np.var(first)


def test_simulation_noise_is_cumulative():
    # 1 row, one item queried K times: the k-th answer is a sum of k independent Laplace draws
    K = 2000
    cols = np.zeros((1, 1), dtype=np.int64)
    signs = np.ones((1, 1), dtype=np.int8)
    inv = np.zeros(0, dtype=np.int64)
    q_items = np.zeros(K, dtype=np.int64)
    q_k = np.arange(K)
    est = iq.simulate_use_and_keep(cols, signs, inv, 1, 1, np.zeros(K, dtype=np.int64), q_items, q_k, Fraction(1),
                                   BulkNoise(9))
    steps = np.diff(np.concatenate(([0], est)))
    q = np.exp(-1.0)
    assert abs(np.var(steps) - 2 * q / (1 - q) ** 2) < 0.15 * 2 * q / (1 - q) ** 2


def test_use_and_forget_schedule_and_exact_sketch():
    alg = iq.UseAndForget(3, 8, "f", Fraction(1), Fraction(1, 2), noise=ExactNoise(Rng(DeterministicSource(b"s"))))
    assert alg.scale(0) == 6 and alg.scale(1) == 12 and alg.scale(3) == 48
    for x in [1] * 10:
        alg.update(x)
    alg.query([1])
    alg.query([1])
    assert max(alg.uses) == 2
    assert alg.sketch.estimate(1) == 10  # the exact sketch is kept (not pan-private)


def test_median_and_cell_perturbation():
    s = iq.DynamicCountSketch(3, 64, "m")
    for x in range(20):
        for _ in range(x):
            s.update(x)
    Q = list(range(20))
    z = ZeroNoise()
    assert iq.median_perturbation(s, Q, 1.0, z) == s.query(Q)
    assert iq.cell_perturbation(s, Q, 1.0, z) == s.query(Q)
    a = iq.cell_perturbation(s, Q, Fraction(1, 100), BulkNoise(1))
    assert np.mean(np.abs(np.array(a) - np.array(s.query(Q)))) > 10  # Laplace(300) cells


def test_theorem5_bound_properties():
    b = [iq.theorem5_bound(k, 9, 5000, 1.0, 1e6, [3] * 9) for k in (20, 50, 100, 400, 1600)]
    assert all(x >= y for x, y in zip(b, b[1:])) and b[-1] < 1.01 * (2 / np.e) ** 4.5 and b[0] == 1.0
    assert iq.theorem5_bound(1.0, 9, 5000, 1.0, 1e6, [1] * 9) == 1.0
    # corrected variance (2 d^2/eps^2) gives a weaker bound
    assert iq.theorem5_bound(400, 9, 5000, 1.0, 1e6, [3] * 9, 2.0) >= b[3]
    k = iq.theorem5_error(0.3, 9, 5000, 1.0, 1e6, [3] * 9)
    assert iq.theorem5_bound(k, 9, 5000, 1.0, 1e6, [3] * 9) <= 0.3 < iq.theorem5_bound(0.99 * k, 9, 5000, 1.0, 1e6, [3] * 9)
    # the bound never goes below (2/e)^(d/2): no kappa reaches 5% with d = 9
    assert iq.theorem5_error(0.05, 9, 5000, 1.0, 1e6, [3] * 9) == float("inf")
