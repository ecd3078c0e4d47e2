"""Whole-array noise draws with numpy: the Pi daemon's fast path for agent.noise (CPython only).

**Not** part of the MicroPython device core. The samplers are those of agent.noise -- Canonne,
Kamath & Steinke, "The Discrete Gaussian for Differential Privacy" (2020), Algorithm 1
(Bernoulli(exp(-gamma))), Algorithm 2 (discrete Laplace) and Algorithm 3 (discrete Gaussian) --
run for every cell of an array at once: each cell follows the algorithm's own loop, with fresh
uniform integers at every step, drawn by exact rejection (the top bits of uniform 64-bit words
from the byte source; no floating point, no modulo bias). Each cell's output therefore has the
algorithm's exact distribution, and the cells are independent, as with one scalar draw per cell.
What differs from agent.noise is only *which* source bytes feed which step, so the samples are
not the scalar path's for a deterministic source: :class:`BulkRng` is used only with the system
CSPRNG (agent.pi.daemon), and deterministic runs (tests, ``--insecure-seed``) keep the scalar path,
which the cross-VM equality tests pin. tests/test_bulknoise.py checks the distributions against
the exact pmf (and that a mis-calibrated one fails).

Pan-privacy (docs/PRIVACY.md, "The intruder's view"): the uniform words and the per-cell samples
live in numpy arrays only while :meth:`BulkRng.bulk_noise` runs and are zeroed before it returns,
on every path; the byte source's own ``bytes`` objects are freed unwiped, as in agent.rng.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.rng import Rng

LIMIT = 1 << 52  # every bound and numerator stays below this: exact in int64
FEW = 32  # a loop whose cells still running are fewer than this finishes them one by one (scalar)
TRIES = 3  # Bernoulli(gamma/k) trials drawn at once per cell (all succeed with chance <= 1/3!)
_MAX64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_MAX32 = np.uint32(0xFFFFFFFF)
_MAX16 = np.uint16(0xFFFF)
_MAX8 = np.uint8(0xFF)


class _Uniform:
    """Exact uniform integers for many cells at once from a byte source, and a scalar Rng on the
    same source for the last few cells of a loop."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.held: list[np.ndarray] = []  # every array that held draws: zeroed by wipe()
        self.r = Rng(source)

    def words(self, n: int, dtype: Any) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        raw = self.source.read(size * n)
        if len(raw) != size * n:
            from agent.rng import NoEntropyError

            raise NoEntropyError("byte source returned %d bytes" % len(raw))
        w = np.frombuffer(raw, dtype=dtype).copy()
        self.held.append(w)
        return w

    def below(self, m: np.ndarray) -> np.ndarray:
        """One uniform integer in [0, m[i]) per entry (1 <= m < LIMIT), as int64: a word r
        (8 bits when every m <= 16, 16 when < 2**10, 32 when < 2**20, else 64) is kept if r < q*m with
        q = floor(max / m), so the kept range is a multiple of m (rejected: at most 1/16 of the draws)."""
        mx = int(m.max())
        dt: Any
        top: Any
        if mx <= 16:
            dt, top = np.uint8, _MAX8
        elif mx < 1 << 10:
            dt, top = np.uint16, _MAX16
        elif mx < 1 << 20:
            dt, top = np.uint32, _MAX32
        else:
            dt, top = np.uint64, _MAX64
        mm = m.astype(dt)
        lim = (top // mm) * mm
        r = self.words(len(m), dt)
        ok = r < lim
        out = (r % mm).astype(np.int64)
        self.held.append(out)
        bad = np.flatnonzero(~ok)
        while len(bad):  # rare: redraw the rejected ones
            r2 = self.words(len(bad), dt)
            ok2 = r2 < lim[bad]
            out[bad[ok2]] = (r2[ok2] % mm[bad[ok2]]).astype(np.int64)
            bad = bad[~ok2]
        return out

    def wipe(self) -> None:
        for a in self.held:
            a.fill(0)
        self.held = []
        self.r.wipe()


def _bern_exp_le1(u: _Uniform, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """gamma = num/den <= 1 (CKS Algorithm 1): A_k ~ Bernoulli(gamma/k) = [uniform(den*k) < num]
    until one fails; True iff the number of draws K is odd. The first TRIES trials of every cell
    are drawn at once (trials after the first failure are independent and unused), then one trial
    per round for the cells still going, and the last few cells one by one."""
    n = len(num)
    if not n:
        return np.zeros(0, dtype=bool)
    ks = np.arange(1, TRIES + 1, dtype=np.int64)
    a = (u.below((den[:, None] * ks[None, :]).ravel()).reshape(n, TRIES) < num[:, None])
    lead = a[:, 0].copy()  # the first j trials all succeeded
    k = 1 + lead.astype(np.int64)  # the first failing trial (1-based) is 1 + the leading successes
    for j in range(1, TRIES):
        lead &= a[:, j]
        k += lead
    todo = np.flatnonzero(lead)  # all TRIES succeeded: go on from k = TRIES + 1
    a.fill(False)
    k[todo] = TRIES + 1
    while len(todo) >= FEW:
        ok = u.below(den[todo] * k[todo]) < num[todo]
        todo = todo[ok]
        k[todo] += 1
    r = u.r
    for i in todo:
        ki, ni, di = int(k[i]), int(num[i]), int(den[i])
        while r.randbelow(di * ki) < ni:
            ki += 1
        k[i] = ki
    return (k & 1) == 1


def _bexp1(u: _Uniform, n: int) -> np.ndarray:
    """n draws of Bernoulli(exp(-1))."""
    one = np.ones(n, dtype=np.int64)
    return _bern_exp_le1(u, one, one)


def _bern_exp(u: _Uniform, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-num/den)) per entry (CKS Algorithm 1; num >= 0, den > 0):
    exp(-1)^floor(gamma) * exp(-(gamma - floor(gamma))): floor(gamma) Bernoulli(exp(-1)) draws
    that must all succeed (a round per draw, stopping at the first failure), then the rest."""
    from agent.noise import _bexp1 as bexp1

    whole = num // den
    rem = num - whole * den
    res = np.ones(len(num), dtype=bool)
    j = 0
    while True:
        idx = np.flatnonzero(res & (whole > j))
        if len(idx) < FEW:
            for i in idx:  # the rest of this loop one cell at a time
                for _ in range(int(whole[i]) - j):
                    if not bexp1(u.r):
                        res[i] = False
                        break
            break
        res[idx] = _bexp1(u, len(idx))
        j += 1
    idx = np.flatnonzero(res)
    if len(idx):
        res[idx] = _bern_exp_le1(u, rem[idx], den[idx])
    return res


def _geometric(u: _Uniform, n: int) -> np.ndarray:
    """n independent counts V of Bernoulli(exp(-1)) successes before the first failure (the V
    of CKS Algorithm 2): one stream of Bernoulli(exp(-1)) draws cut at its failures. The runs
    between failures of an i.i.d. stream are i.i.d. with exactly that law. The stream is drawn in
    pieces, and a run still open at the end of a piece goes on in the next (its successes are
    carried over): dropping them would shorten exactly the runs that cross a piece's end, the
    longer ones more often (a bias, however rare the extra piece)."""
    parts: list[np.ndarray] = []
    have = 0
    carry = 0  # successes of the run still open at the end of the stream drawn so far
    while have < n:
        m = (n - have) * 17 // 10 + 64  # E[V] + 1 = 1 / (1 - 1/e) = 1.58 draws per count
        b = _bexp1(u, m)
        fails = np.flatnonzero(~b)
        runs = np.diff(fails, prepend=-1) - 1  # successes before each failure
        if len(runs):
            runs[0] += carry
            carry = m - 1 - int(fails[-1])
        else:
            carry += m
        parts.append(runs)
        have += len(runs)
        b.fill(False)
        fails.fill(0)
    v = np.concatenate(parts)[:n]
    u.held += parts + [v]
    return v


def _dlap_pool(u: _Uniform, n: int, t: int, s: int) -> np.ndarray:
    """n independent draws of the discrete Laplace with scale t/s (CKS Algorithm 2): proposals
    are made in bulk and each is accepted or rejected on its own draws; the accepted values, in
    order, are i.i.d. with the target law (whatever is accepted beyond n is dropped)."""
    parts: list[np.ndarray] = []
    have = 0
    while have < n:
        m = (n - have) * 16 // 10 + 64
        tt = np.full(m, t, dtype=np.int64)
        uu = u.below(tt)
        d = _bern_exp_le1(u, uu, tt)  # U < t: gamma = U/t < 1
        uu = uu[d]
        v = _geometric(u, len(uu))
        y = (uu + t * v) // s
        neg = u.below(np.full(len(uu), 2, dtype=np.int64)) < 1
        ok = ~(neg & (y == 0))
        out = np.where(neg, -y, y)[ok]
        parts.append(out)
        have += len(out)
        u.held += [uu, v, y]
    z = np.concatenate(parts)[:n]
    u.held += parts + [z]
    return z


def _dlap(u: _Uniform, n: int, t: int, s: int) -> np.ndarray:
    return _dlap_pool(u, n, t, s)


def _dgauss(u: _Uniform, n: int, vn: int, vd: int) -> np.ndarray:
    """n independent draws of the discrete Gaussian with sigma^2 = vn/vd (CKS Algorithm 3):
    discrete Laplace proposals in bulk, each accepted on its own Bernoulli; the first n accepted."""
    from agent.noise import bernoulli_exp, isqrt

    t = isqrt(vn // vd) + 1
    den = 2 * vn * vd * t * t
    parts: list[np.ndarray] = []
    have = 0
    while have < n:
        m = (n - have) * 15 // 10 + 64
        y = _dlap_pool(u, m, t, 1)
        a = np.abs(y) * (vd * t) - vn
        far = np.abs(a) >= 1 << 26  # a*a would leave the exact range (never seen at these scales)
        num = np.where(far, 0, a * a)
        acc = _bern_exp(u, num, np.full(m, den, dtype=np.int64))
        for i in np.flatnonzero(far):  # the scalar test with Python ints, same distribution
            acc[i] = bernoulli_exp(u.r, int(a[i]) * int(a[i]), den)
        out = y[acc]
        parts.append(out)
        have += len(out)
        u.held += [y, a, num]
    z = np.concatenate(parts)[:n]
    u.held += parts + [z]
    return z


def fits(spec: Any) -> bool:
    """True if every bound of this spec's sampler stays well inside int64 (else: scalar path)."""
    if spec.mech == "dlap":
        return spec.num * 64 < LIMIT and spec.den < LIMIT
    from agent.noise import isqrt

    t = isqrt(spec.num // spec.den) + 1
    return 2 * spec.num * spec.den * t * t * 64 < LIMIT and spec.num < 1 << 20 and spec.den < 1 << 20


class BulkRng(Rng):
    """An :class:`agent.rng.Rng` whose :meth:`bulk_noise` draws a whole array slice at once.

    agent.noise.add_noise (and so draw_into: every internal, persist and output draw of the
    recorders) uses it when present; single samples still go through the scalar samplers.
    """

    def bulk_noise(self, arr: Any, spec: Any, start: int, stop: int) -> bool:
        """arr[start:stop] += one independent draw of ``spec`` per cell, mod 2**32. False: not
        handled (parameters too large for int64), the caller draws cell by cell."""
        n = stop - start
        if n < 2 * FEW or not fits(spec) or getattr(arr, "typecode", None) != "i" or arr.itemsize != 4:
            return False  # a few cells (dbits' K counts), huge parameters, not an int32 array: per cell
        u = _Uniform(self.source)
        try:
            if spec.mech == "dlap":
                z = _dlap(u, n, spec.num, spec.den)
            else:
                z = _dgauss(u, n, spec.num, spec.den)
            z32 = z.astype(np.int32)  # the sample mod 2**32 (|z| is far below 2**31)
            u.held.append(z32)
            cells = np.frombuffer(arr, dtype=np.int32)[start:stop]  # a view: writes go to arr
            cells += z32  # int32 arithmetic wraps mod 2**32: wrap32(arr[i] + z)
            del cells
        finally:
            u.wipe()
        return True
