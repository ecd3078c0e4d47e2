"""agent/pi/bulknoise.py: whole-array draws have the exact discrete Gaussian / Laplace distributions.

BulkRng (the Pi daemon's numpy sampler) runs CKS 2020 Algorithms 1-3 for every cell at once, so
its samples are not the scalar path's byte for byte: the check here is the distribution, with a
fixed seed (DeterministicSource) and a chi-square threshold at p = 1e-6 for the exact pmf; the
same samples must fail against a pmf whose variance is 10 % off (the calibration a wrong
sampler would have).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pansketch.agent.pi.bulknoise import BulkRng
from pansketch.agent.noise import NoiseSpec, add_noise, draw_into, wrap32
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.agent.sketch import new_counters

scipy_stats = pytest.importorskip("scipy.stats")


def pmf_gauss(var: float, lo: int, hi: int) -> np.ndarray:
    xs = np.arange(lo, hi + 1)
    p = np.exp(-xs.astype(float) ** 2 / (2 * var))
    return p / p.sum()


def pmf_lap(scale: float, lo: int, hi: int) -> np.ndarray:
    xs = np.arange(lo, hi + 1)
    p = np.exp(-np.abs(xs).astype(float) / scale)
    return p / p.sum()


def chi2(samples: np.ndarray, pmf: np.ndarray, lo: int) -> tuple[float, int]:
    """Chi-square statistic over cells with expected count >= 5 (tails pooled), and its df."""
    n = len(samples)
    counts = np.bincount(np.clip(samples - lo, 0, len(pmf) - 1), minlength=len(pmf)).astype(float)
    exp = pmf * n
    keep = exp >= 5
    obs_k = np.append(counts[keep], counts[~keep].sum())
    exp_k = np.append(exp[keep], exp[~keep].sum())
    m = exp_k > 0
    return float(((obs_k[m] - exp_k[m]) ** 2 / exp_k[m]).sum()), int(m.sum()) - 1


def draws(spec: NoiseSpec, seed: str, cells: int = 8192, reps: int = 5) -> np.ndarray:
    rng = BulkRng(DeterministicSource(seed))
    out = []
    for _ in range(reps):
        a = new_counters(cells)
        draw_into(a, spec, rng)
        assert bytes(rng._buf) == bytes(32)  # nothing of the draw is left in the Rng
        out.append(np.array(a, dtype=np.int64))
    return np.concatenate(out)


@pytest.mark.slow
@pytest.mark.parametrize("num,den", [(4, 1), (8, 1), (25, 3)])
def test_bulk_discrete_gaussian_has_the_exact_pmf(num, den):
    var = num / den
    s = draws(NoiseSpec("dgauss", num, den), "bulk-%d-%d" % (num, den))
    lo, hi = -int(12 * math.sqrt(var)) - 2, int(12 * math.sqrt(var)) + 2
    stat, df = chi2(s, pmf_gauss(var, lo, hi), lo)
    crit = scipy_stats.chi2.ppf(1 - 1e-6, df)
    assert stat < crit, (stat, crit)
    wrong, df2 = chi2(s, pmf_gauss(var * 1.1, lo, hi), lo)
    assert wrong > scipy_stats.chi2.ppf(1 - 1e-6, df2), "the test cannot tell a 10% variance error"
    # variance within 4 standard errors (Var of the sample variance ~ 2 var^2 / n for a near-Gaussian)
    assert abs(s.var() - var) < 4 * math.sqrt(2 / len(s)) * var


@pytest.mark.parametrize("num,den", [(3, 1), (3, 2)])
def test_bulk_discrete_laplace_has_the_exact_pmf(num, den):
    scale = num / den
    s = draws(NoiseSpec("dlap", num, den), "lap-%d-%d" % (num, den))
    lo, hi = -int(25 * scale) - 2, int(25 * scale) + 2
    stat, df = chi2(s, pmf_lap(scale, lo, hi), lo)
    assert stat < scipy_stats.chi2.ppf(1 - 1e-6, df), stat
    wrong, df2 = chi2(s, pmf_lap(scale * 1.1, lo, hi), lo)
    assert wrong > scipy_stats.chi2.ppf(1 - 1e-6, df2)


def test_bulk_adds_one_draw_per_cell_mod_2_32_in_the_slice_only():
    a = new_counters(3000)
    for i in range(3000):
        a[i] = 0x7FFFFFFF if i % 2 else -0x80000000
    before = list(a)
    add_noise(a, NoiseSpec("dgauss", 8), BulkRng(DeterministicSource("wrap")), 1000, 2000)
    assert list(a[:1000]) == before[:1000] and list(a[2000:]) == before[2000:]
    z = [wrap32(x - y) for x, y in zip(a[1000:2000], before[1000:2000])]
    assert all(abs(v) < 100 for v in z) and any(z)  # a small draw, wrapped around int32 where needed
    assert any((x < 0) != (y < 0) for x, y in zip(a[1000:2000], before[1000:2000]))


def test_scalar_rng_keeps_the_scalar_path():
    """A plain Rng (tests, --insecure-seed, MicroPython) draws cell by cell: bit-identical to
    NoiseSpec.sample, which tests/test_mp_core.py pins against the MicroPython VM."""
    spec = NoiseSpec("dgauss", 8)
    a = new_counters(500)
    draw_into(a, spec, Rng(DeterministicSource("s")))
    r = Rng(DeterministicSource("s"))
    assert list(a) == [spec.sample(r) for _ in range(500)]


def test_geometric_runs_go_on_across_the_pieces_of_the_stream(monkeypatch):
    """V (CKS Algorithm 2) is cut from one Bernoulli(exp(-1)) stream drawn in pieces: a run of
    successes still open at the end of a piece must go on in the next. Dropping its successes
    (the first version) shortened exactly the runs that cross a piece's end, a bias towards small
    noise that no chi-square test at these sizes sees: here a fixed stream whose 6th run (200
    successes) spans three pieces must come out as 200."""
    import pansketch.agent.pi.bulknoise as bn

    stream = [False] * 5 + [True] * 200 + [False] * 50
    pos = [0]

    def fixed_stream(_u, m):
        out = np.array(stream[pos[0]:pos[0] + m], dtype=bool)
        assert len(out) == m
        pos[0] += m
        return out

    monkeypatch.setattr(bn, "_bexp1", fixed_stream)
    v = bn._geometric(bn._Uniform(DeterministicSource("runs")), 8)
    assert list(v) == [0, 0, 0, 0, 0, 200, 0, 0]


class _FailingSource:
    """The system source's stand-in that runs dry after ``good`` reads (NoEntropyError mid-draw)."""

    def __init__(self, good: int) -> None:
        self.inner = DeterministicSource("dry")
        self.good = good

    def read(self, n: int) -> bytes:
        if self.good <= 0:
            return b""
        self.good -= 1
        return self.inner.read(n)


@pytest.mark.parametrize("good", [1, 3, 10_000])
def test_bulk_buffers_are_wiped_and_the_array_untouched_on_every_path(monkeypatch, good):
    """PRIVACY.md: the uniform words and samples of a bulk draw are zeroed before bulk_noise
    returns, also when the byte source fails mid-draw; and a failed draw adds nothing."""
    import pansketch.agent.pi.bulknoise as bn
    from pansketch.agent.rng import NoEntropyError

    seen: list[list[np.ndarray]] = []
    real = bn._Uniform.wipe

    def spy(self):  # type: ignore[no-untyped-def]
        held = list(self.held)
        real(self)
        seen.append(held)

    monkeypatch.setattr(bn._Uniform, "wipe", spy)
    a = new_counters(4096)
    for i in range(len(a)):
        a[i] = i
    before = list(a)
    rng = BulkRng(_FailingSource(good))
    if good < 100:
        with pytest.raises(NoEntropyError):
            add_noise(a, NoiseSpec("dgauss", 8), rng)
        assert list(a) == before
    else:
        add_noise(a, NoiseSpec("dgauss", 8), rng)
        assert list(a) != before
    assert len(seen) == 1 and seen[0], "the draw's buffers were not handed to wipe()"
    assert all(not x.any() for x in seen[0])
    assert bytes(rng._buf) == bytes(32)
