"""Merge releases: sum their counters, add their noise variances.

Sketches are linear (dp-linear-sketches.txt, Algorithms 1-2): the sum of
the counters of releases built with the same hash functions is the sketch
of the union of their events plus the sum of their noises. Releases merge
only when (kind, d, w, hash version, salt id) are identical; anything else
is refused with a reason (:class:`MergeError`), never silently mixed.

Noise of one release: every cell carries ``nz - 1`` internal draws
(the state's initial Z_int plus a fresh one each time the device persisted
its state or restarted, pansketch.agent.recorder) and one output draw (Z_out), all
independent, with the parameters ``nint`` and ``nout`` (field ``nz`` of
the release, 2 <= nz; host_tools/ingest/decode.py). Per cell of a merge of R
releases the noise is a sum of sum_i nz_i independent zero-mean draws, so
its variance is

    V = sum over releases i of (nz_i - 1) Var(nint_i) + Var(nout_i)

with, for scale/variance parameter p = num/den,

* discrete Laplace, scale t (pmf ~ exp(-|x|/t)), q = exp(-1/t):
  Var = 2q / (1 - q)^2, computed exactly in floats (expm1 for large t);
* discrete Gaussian N_Z(0, sigma^2): we use sigma^2. The true variance is
  slightly *smaller* (Canonne, Kamath & Steinke 2020, Corollary 9), so
  sigma^2 over-states the noise (conservative); the relative gap is 2e-7
  at sigma^2 = 1 and below 1e-15 from sigma^2 = 2 (tests/test_host_estimators.py
  checks this against the pmf). Devices use sigma^2 = d*clip^2/(2 rho) >= 1
  for any rho <= d/2.

The counters are summed as int64 (no overflow for any realistic fleet:
2^31 per release x 2^32 releases).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from pansketch.host_tools.store.rows import StoredRelease


class MergeError(Exception):
    """Releases that cannot be merged (reason in the message)."""


@dataclass
class NoiseTerm:
    """``count`` independent draws per cell of one distribution."""

    mech: str  # 'dlap' (param = scale t) or 'dgauss' (param = sigma^2)
    num: int
    den: int
    count: int

    @property
    def param(self) -> float:
        return self.num / self.den

    def variance(self) -> float:
        return self.count * noise_variance(self.mech, self.num, self.den)


def noise_variance(mech: str, num: int, den: int) -> float:
    """Variance of one draw (see module docstring)."""
    if mech == "dgauss":
        return num / den
    if mech == "dlap":
        inv_t = den / num
        q = math.exp(-inv_t)
        return 2.0 * q / (math.expm1(-inv_t) ** 2)
    raise ValueError("unknown mechanism %r" % mech)


@dataclass
class Merged:
    """The sum of compatible releases."""

    kind: str
    d: int
    w: int
    hv: int
    salt: str
    counters: np.ndarray  # int64 (d, w)
    releases: int
    devices: list[str]
    noise: list[NoiseTerm]
    t0: int  # earliest epoch start covered (unix seconds)
    t1: int  # latest epoch end covered
    windows: list[tuple[int, int]] = field(default_factory=list)  # distinct (win_s, win)
    b: int = 0  # kind dcs: domain bits; counters are then ((b + 1) * d, w), level l in rows [l*d, (l+1)*d)
    map: Optional[tuple[int, int, int]] = None  # kind dcs: (scale_num, scale_den, offset)

    @property
    def noise_var(self) -> float:
        """Per-cell variance of the merged noise."""
        return float(sum(t.variance() for t in self.noise))

    @property
    def noise_sd(self) -> float:
        return math.sqrt(self.noise_var)

    @property
    def noise_draws(self) -> int:
        """Independent noise draws per cell in the merged counters."""
        return int(sum(t.count for t in self.noise))


def merge(rels: Sequence[StoredRelease], counters: Optional[Iterable[np.ndarray]] = None) -> Merged:
    """Sum releases. Raises MergeError with the reason.

    The counters come from ``rels`` (loaded with payload), or, streaming,
    from ``counters`` (one array per release of ``rels``, same order, e.g.
    :meth:`pansketch.host_tools.store.read.Reader.iter_counters`): memory stays
    O(d*w) plus the releases' metadata.
    """
    if not rels:
        raise MergeError("no releases to merge")
    groups = Counter(r.group for r in rels)
    if len(groups) > 1:
        desc = "; ".join("%d release(s) with kind=%s d=%d w=%d hv=%d salt=%s (devices %s)"
                         % (n, g[0], g[1], g[2], g[3], g[4],
                            ", ".join(sorted({r.device for r in rels if r.group == g})[:5]))
                         for g, n in groups.most_common())
        raise MergeError("releases with different sketch parameters cannot be merged: %s; "
                         "restrict the query with --device or a time range" % desc)
    kind, d, w, hv, salt = rels[0].group[:5]
    acc = np.zeros(rels[0].shape, dtype=np.int64)
    terms: Counter[tuple[str, int, int]] = Counter()
    n = 0
    for c in (counters if counters is not None else (r.counters() for r in rels)):
        acc += c
        n += 1
    if n != len(rels):
        raise MergeError("the store changed during the query (%d releases selected, %d read); run it again"
                         % (len(rels), n))
    for r in rels:
        terms[(r.mech, r.nint[0], r.nint[1])] += r.nz - 1
        terms[(r.mech, r.nout[0], r.nout[1])] += 1
    noise = [NoiseTerm(m, n, dd, c) for (m, n, dd), c in sorted(terms.items())]
    return Merged(kind=kind, d=d, w=w, hv=hv, salt=salt, counters=acc, releases=len(rels),
                  devices=sorted({r.device for r in rels}), noise=noise,
                  t0=min(r.t0 for r in rels), t1=max(r.t1 for r in rels),
                  windows=sorted({(r.win_s, r.win) for r in rels}), b=rels[0].b, map=rels[0].map)


def merge_arrays(counters: Iterable[np.ndarray], kind: str, d: int, w: int, noise: list[NoiseTerm],
                 salt: str = "", devices: Sequence[str] = ()) -> Merged:
    """A Merged from raw counter arrays (tests, benchmarks, reproductions)."""
    acc = np.zeros((d, w), dtype=np.int64)
    n = 0
    for c in counters:
        acc += np.asarray(c, dtype=np.int64).reshape(d, w)
        n += 1
    return Merged(kind=kind, d=d, w=w, hv=1, salt=salt, counters=acc, releases=n, devices=list(devices),
                  noise=noise, t0=0, t1=0)
