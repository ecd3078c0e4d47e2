"""Whole-array noise draws with numpy: the Pi daemon's fast path for pansketch.agent.noise (CPython only).

**Not** part of the MicroPython device core. The samplers are those of pansketch.agent.noise -- Canonne,
Kamath & Steinke, "The Discrete Gaussian for Differential Privacy" (2020), Algorithm 1
(Bernoulli(exp(-gamma))), Algorithm 2 (discrete Laplace) and Algorithm 3 (discrete Gaussian) --
run for every cell of an array at once: each cell follows the algorithm's own loop, with fresh
uniform integers at every step, drawn by exact rejection (the top bits of uniform 64-bit words
from the byte source; no floating point, no modulo bias). Each cell's output therefore has the
algorithm's exact distribution, and the cells are independent, as with one scalar draw per cell.
What differs from pansketch.agent.noise is only *which* source bytes feed which step, so the samples are
not the scalar path's for a deterministic source: :class:`BulkRng` is used only with the system
CSPRNG (pansketch.agent.pi.daemon), and deterministic runs (tests, ``--insecure-seed``) keep the scalar path,
which the cross-VM equality tests pin. tests/test_bulknoise.py checks the distributions against
the exact pmf (and that a mis-calibrated one fails).

Pan-privacy (docs/PRIVACY.md, "The intruder's view" and "Memory residue"): the uniform words, the
per-cell samples and **every intermediate array** (masks, index arrays, signed proposals, ...) are
held by :class:`_Uniform` and zeroed before :meth:`BulkRng.bulk_noise` returns, on every path, so
numpy frees no array that held part of a draw unzeroed; expressions are written one operation at
a time (no hidden temporaries such as ``np.where(neg, -y, y)``'s ``-y``). The byte source's own
``bytes`` objects are zeroed in place once copied (pansketch.agent.pi.memwipe.wipe_bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pansketch.agent.pi.memwipe import ON as WIPE
from pansketch.agent.pi.memwipe import wipe_bytes
from pansketch.agent.rng import Rng

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
            from pansketch.agent.rng import NoEntropyError

            raise NoEntropyError("byte source returned %d bytes" % len(raw))
        w = np.frombuffer(raw, dtype=dtype).copy()
        wipe_bytes(raw)  # the CSPRNG's own bytes object: it fixes the draw as much as w does
        del raw
        self.held.append(w)
        return w

    def h(self, a: Any) -> Any:
        """Hold ``a`` (an array computed from draws) until :meth:`wipe` zeroes it. Every
        intermediate result goes through here, also masks and index arrays: freed unzeroed, any
        of them would tell the intruder part of a draw that was just added."""
        if isinstance(a, np.ndarray):
            self.held.append(a)
        return a

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
        h = self.h
        mm = h(m.astype(dt))
        lim = h(top // mm)
        lim *= mm
        r = self.words(len(m), dt)
        ok = h(r < lim)
        out = h(h(r % mm).astype(np.int64))
        bad = h(np.flatnonzero(h(~ok)))
        while len(bad):  # rare: redraw the rejected ones
            r2 = self.words(len(bad), dt)
            ok2 = h(r2 < h(lim[bad]))
            sel = h(bad[ok2])
            out[sel] = h(h(h(r2[ok2]) % h(mm[sel])).astype(np.int64))
            bad = h(bad[h(~ok2)])
        return out

    def wipe(self) -> None:
        if WIPE:
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
    h = u.h
    ks = np.arange(1, TRIES + 1, dtype=np.int64)
    m = h(den[:, None] * ks[None, :])
    a = h(u.below(m.ravel()).reshape(n, TRIES) < num[:, None])
    lead = h(a[:, 0].copy())  # the first j trials all succeeded
    k = h(lead.astype(np.int64))
    k += 1  # the first failing trial (1-based) is 1 + the leading successes
    for j in range(1, TRIES):
        lead &= a[:, j]
        k += lead
    todo = h(np.flatnonzero(lead))  # all TRIES succeeded: go on from k = TRIES + 1
    k[todo] = TRIES + 1
    while len(todo) >= FEW:
        kt = h(k[todo])
        bound = h(h(den[todo]) * kt)
        ok = h(u.below(bound) < h(num[todo]))
        todo = h(todo[ok])
        kt = h(k[todo])  # (k[todo] += 1 would make this copy unheld)
        kt += 1
        k[todo] = kt
    r = u.r
    for i in todo:
        ki, ni, di = int(k[i]), int(num[i]), int(den[i])
        while r.randbelow(di * ki) < ni:
            ki += 1
        k[i] = ki
    odd = h(k & 1)
    return h(odd == 1)


def _bexp1(u: _Uniform, n: int) -> np.ndarray:
    """n draws of Bernoulli(exp(-1))."""
    one = u.h(np.ones(n, dtype=np.int64))
    return _bern_exp_le1(u, one, one)


def _bern_exp(u: _Uniform, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(-num/den)) per entry (CKS Algorithm 1; num >= 0, den > 0):
    exp(-1)^floor(gamma) * exp(-(gamma - floor(gamma))): floor(gamma) Bernoulli(exp(-1)) draws
    that must all succeed (a round per draw, stopping at the first failure), then the rest."""
    from pansketch.agent.noise import _bexp1 as bexp1

    h = u.h
    whole = h(num // den)
    rem = h(whole * den)
    np.subtract(num, rem, out=rem)
    res = h(np.ones(len(num), dtype=bool))
    j = 0
    while True:
        idx = h(np.flatnonzero(h(res & h(whole > j))))
        if len(idx) < FEW:
            for i in idx:  # the rest of this loop one cell at a time
                for _ in range(int(whole[i]) - j):
                    if not bexp1(u.r):
                        res[i] = False
                        break
            break
        res[idx] = _bexp1(u, len(idx))
        j += 1
    idx = h(np.flatnonzero(res))
    if len(idx):
        res[idx] = _bern_exp_le1(u, h(rem[idx]), h(den[idx]))
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
        fails = u.h(np.flatnonzero(u.h(~b)))
        runs = u.h(np.empty(len(fails), dtype=np.int64))  # successes before each failure
        if len(fails):  # (np.diff(fails, prepend=-1) - 1, without its unheld temporaries)
            runs[0] = fails[0]
            np.subtract(fails[1:], fails[:-1], out=runs[1:])
            runs[1:] -= 1
        if len(runs):
            runs[0] += carry
            carry = m - 1 - int(fails[-1])
        else:
            carry += m
        parts.append(runs)
        have += len(runs)
    v = u.h(np.concatenate(parts))[:n]
    return v


def _dlap_pool(u: _Uniform, n: int, t: int, s: int) -> np.ndarray:
    """n independent draws of the discrete Laplace with scale t/s (CKS Algorithm 2): proposals
    are made in bulk and each is accepted or rejected on its own draws; the accepted values, in
    order, are i.i.d. with the target law (whatever is accepted beyond n is dropped)."""
    parts: list[np.ndarray] = []
    have = 0
    while have < n:
        m = (n - have) * 16 // 10 + 64
        h = u.h
        tt = h(np.full(m, t, dtype=np.int64))
        uu = u.below(tt)
        d = _bern_exp_le1(u, uu, tt)  # U < t: gamma = U/t < 1
        uu = h(uu[d])
        v = _geometric(u, len(uu))
        # y = (U + t*V) // s, the sign, and the rejection of -0, all in arrays held for the wipe
        # (np.where(neg, -y, y) would leave -y and the result as unzeroed temporaries)
        y = h(v * t)
        y += uu
        y //= s
        neg = h(u.below(h(np.full(len(uu), 2, dtype=np.int64))) < 1)
        zero = h(y == 0)
        zero &= neg
        ok = h(~zero)
        sgn = h(neg.astype(np.int64))
        sgn *= -2
        sgn += 1  # -1 where negative, else +1
        y *= sgn
        out = h(y[ok])
        parts.append(out)
        have += len(out)
    z = h(np.concatenate(parts))[:n]
    return z


def _dlap(u: _Uniform, n: int, t: int, s: int) -> np.ndarray:
    return _dlap_pool(u, n, t, s)


def _dgauss(u: _Uniform, n: int, vn: int, vd: int) -> np.ndarray:
    """n independent draws of the discrete Gaussian with sigma^2 = vn/vd (CKS Algorithm 3):
    discrete Laplace proposals in bulk, each accepted on its own Bernoulli; the first n accepted."""
    from pansketch.agent.noise import bernoulli_exp, isqrt

    t = isqrt(vn // vd) + 1
    den = 2 * vn * vd * t * t
    parts: list[np.ndarray] = []
    have = 0
    while have < n:
        m = (n - have) * 15 // 10 + 64
        h = u.h
        y = _dlap_pool(u, m, t, 1)
        a = h(np.abs(y))
        a *= vd * t
        a -= vn
        far = h(h(np.abs(a)) >= 1 << 26)  # a*a would leave the exact range (never seen at these scales)
        num = h(a * a)
        num[far] = 0
        acc = _bern_exp(u, num, h(np.full(m, den, dtype=np.int64)))
        for i in h(np.flatnonzero(far)):  # the scalar test with Python ints, same distribution
            acc[i] = bernoulli_exp(u.r, int(a[i]) * int(a[i]), den)
        out = h(y[acc])
        parts.append(out)
        have += len(out)
    z = h(np.concatenate(parts))[:n]
    return z


def fits(spec: Any) -> bool:
    """True if every bound of this spec's sampler stays well inside int64 (else: scalar path)."""
    if spec.mech == "dlap":
        return spec.num * 64 < LIMIT and spec.den < LIMIT
    from pansketch.agent.noise import isqrt

    t = isqrt(spec.num // spec.den) + 1
    return 2 * spec.num * spec.den * t * t * 64 < LIMIT and spec.num < 1 << 20 and spec.den < 1 << 20


class BulkRng(Rng):
    """An :class:`pansketch.agent.rng.Rng` whose :meth:`bulk_noise` draws a whole array slice at once.

    pansketch.agent.noise.add_noise (and so draw_into: every internal, persist and output draw of the
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
            z32 = u.h(z.astype(np.int32))  # the sample mod 2**32 (|z| is far below 2**31)
            cells = np.frombuffer(arr, dtype=np.int32)[start:stop]  # a view: writes go to arr
            cells += z32  # int32 arithmetic wraps mod 2**32: wrap32(arr[i] + z)
            del cells
        finally:
            u.wipe()
        return True
