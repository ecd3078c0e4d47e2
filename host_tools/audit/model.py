"""The exact linear structure of the intruder's view, learned from real runs.

Every array an intruder can read -- each ``array('i')`` attribute at each
moment, each ``state.bin`` version, each release -- is, on the device,

    V_i = wrap32( E_i(world) + sum_k C[i, k] * Z_k )

where Z_k (k = 0..K-1) are the noise arrays the device drew (one
``add_noise`` call = one array of n = d*w independent draws), C is an integer
matrix and E_i is the exact part (the events counted into V_i). Nothing in
this module assumes that form: :func:`learn` *measures* it.

1. It runs the real Recorder on a few seeded byte sources, in both worlds
   with the same bytes, and decodes every draw by replaying the recorded
   CSPRNG bytes through the device's own sampler (:func:`device.decode_draws`).
2. It solves for C by least squares over the seeds, requires an exact
   integer solution, and reads E from it; the event's effect
   E_i(1) - E_i(0) must be noise-free (the same bytes give the same draws in
   both worlds: noise never depends on the data).
3. :func:`verify` then runs fresh trials on the real code path with the
   system CSPRNG (``os.urandom``), decodes their draws and requires every
   array of the view to equal E + C·Z **bit for bit**, and every byte buffer
   (the Rng's) to hold the same constant as in the learning runs.

When both hold, the view is a fixed function of (world, Z), and Z is a
vector of independent draws, array k of distribution ``Model.specs[k]``
(recorded per sample while the device runs, device.py: under
``persist_noise = "shadow"`` the internal and the output noise differ) (the samplers
are exact, CKS 2020; ``tests/test_noise.py`` checks them against the pmf).
So sampling Z with numpy from the exact pmf and forming E + C·Z gives the
view's distribution exactly (up to float resolution of the inverse-CDF
table, < 1e-15 per draw, and a tail truncated below 1e-40) -- this is the
only part of the audit that is not the device code. Only the touched cells
are sampled: the other cells are identical in law in both worlds and
independent of the touched ones (each draw is per cell), so they carry no
information about the event. When the model cannot reproduce a view (e.g. a
byte buffer holds CSPRNG output), :attr:`Model.exact` is False and the
audit runs every trial on the real code path instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pansketch.agent.params import Params
from pansketch.agent.rng import DeterministicSource, SystemSource

from pansketch.host_tools.audit import device
from pansketch.host_tools.audit.scenarios import Scenario

Key = tuple  # ("ram", moment, attr) | ("flash", j) | ("release", j)


def wrap32(a: np.ndarray) -> np.ndarray:
    return ((a + 2**31) % 2**32) - 2**31


def view_arrays(r: device.Run) -> dict[Key, np.ndarray]:
    out: dict[Key, np.ndarray] = {}
    for i, m in enumerate(r.moments):
        for k, v in m.arrays.items():
            out[("ram", i, k)] = v
    for j, v in enumerate(r.flash):
        out[("flash", j)] = v
    for j, v in enumerate(r.releases):
        out[("release", j)] = v
    return out


def draws_of(p: Params, r: device.Run) -> tuple[np.ndarray, list[device.Decoded]]:
    """All draws of a run as a (K, n) array, and the per-instance decodings."""
    Z, decs, _ = decode(p, r)
    return Z, decs


def decode(p: Params, r: device.Run) -> tuple[np.ndarray, list[device.Decoded], list[Any]]:
    """All draws of a run as a (K, n) array, the per-instance decodings, and the
    distribution (pansketch.agent.noise.NoiseSpec) of each of the K noise arrays.

    With the distributions recorded by device.run (:attr:`device.Run.specs`)
    every draw is replayed with its own sampler, and every array of n
    consecutive draws must have one distribution. Without them (a Run built
    elsewhere) every draw is replayed with ``p.noise``.
    """
    n = p.cells
    if r.specs is None:
        decs = [device.decode_draws(p.noise, s) for s in r.streams]
    else:
        try:
            decs = [device.decode_draws(p.noise, s, sp) for s, sp in zip(r.streams, r.specs)]
        except device.NoEntropyError:
            raise ModelError("the recorded CSPRNG bytes do not cover the recorded noise draws")
    flat: list[int] = []
    per: list[Any] = []
    for dec in decs:
        # The device draws whole arrays of n; bytes left over at the end of a
        # boot (an Rng that keeps a tail) can replay into a few phantom draws
        # it never made (only without recorded distributions). verify()
        # catches any case this rule gets wrong.
        keep = len(dec.draws) - len(dec.draws) % n
        dec.draws = dec.draws[:keep]
        flat.extend(dec.draws)
        per.extend(dec.specs[:keep])
    if len(flat) % n:
        raise ModelError("%d draws is not a whole number of noise arrays of %d cells" % (len(flat), n))
    specs = []
    for k in range(len(flat) // n):
        keys = {device.spec_key(sp) for sp in per[k * n:(k + 1) * n]}
        if len(keys) != 1:
            raise ModelError("noise array %d mixes distributions %s" % (k, sorted(keys)))
        specs.append(per[k * n])
    return np.array(flat, dtype=np.int64).reshape(-1, n), decs, specs


class ModelError(Exception):
    """The view is not an exact linear function of the draws (the audit falls back to real runs)."""


@dataclass
class Model:
    p: Params
    scenario: Scenario
    keys: list[Key]
    C: np.ndarray  # (A, K) int64
    E0: np.ndarray  # (A, n) int64, world 0
    delta: np.ndarray  # (A, n) int64, E1 - E0
    cells: list[tuple[int, int]]
    moments: list[tuple[str, list[int], int]]  # (label, indices of its RAM arrays, flash versions visible)
    release_idx: list[int]
    flash_idx: list[int]
    buffers: dict[tuple[int, str], bytes]  # learned constant byte buffers per moment
    specs: list[Any] = field(default_factory=list)  # the distribution of each noise array Z_k (K of them)
    exact: bool = True
    notes: list[str] = field(default_factory=list)
    verified: int = 0  # real trials reproduced bit for bit

    @property
    def K(self) -> int:
        return int(self.C.shape[1])


def _seeded(tag: str) -> Callable[[int], Any]:
    return lambda i: DeterministicSource("%s-%d" % (tag, i))


def learn(p: Params, sc: Scenario, seeds: int = 4) -> Model:
    """Measure C, E and the event's effect from seeded real runs (see module doc)."""
    n = p.cells
    notes: list[str] = []
    runs0, runs1 = [], []
    for s in range(seeds):
        tag = "audit-learn-%s-%d" % (sc.name, s)
        runs0.append(device.run(p, sc, 0, _seeded(tag)))
        runs1.append(device.run(p, sc, 1, _seeded(tag)))
    v0 = [view_arrays(r) for r in runs0]
    v1 = [view_arrays(r) for r in runs1]
    keys = list(v0[0])
    for v in v0 + v1:
        if list(v) != keys:
            raise ModelError("the set of arrays in the view depends on the seed or the data")
    Z = []
    speckeys = []
    specs: list[Any] = []
    for r0, r1 in zip(runs0, runs1):
        z0, _, s0 = decode(p, r0)
        z1, _, s1 = decode(p, r1)
        if z0.shape != z1.shape or (z0 != z1).any():
            notes.append("the noise draws differ between the worlds for the same CSPRNG bytes")
        Z.append(z0)
        k0 = [device.spec_key(x) for x in s0]
        if k0 != [device.spec_key(x) for x in s1]:
            raise ModelError("the distributions of the noise arrays depend on the data")
        speckeys.append(k0)
        specs = s0
    K = Z[0].shape[0]
    if any(z.shape[0] != K for z in Z):
        raise ModelError("the number of noise draws depends on the seed")
    if any(k != speckeys[0] for k in speckeys):
        raise ModelError("the distributions of the noise arrays depend on the seed")
    for r0, r1 in zip(runs0, runs1):
        for m0, m1 in zip(r0.moments, r1.moments):
            for k in m0.meta:
                if m0.meta[k] != m1.meta.get(k):
                    notes.append("attribute %s differs between the worlds at %s" % (k, m0.label))
        if r0.release_meta != r1.release_meta or r0.flash_meta != r1.flash_meta:
            notes.append("release or state.bin metadata differ between the worlds")
    notes = list(dict.fromkeys(notes))
    A = len(keys)
    C = np.zeros((A, K), dtype=np.int64)
    E0 = np.zeros((A, n), dtype=np.int64)
    delta = np.zeros((A, n), dtype=np.int64)
    X = np.concatenate([(Z[s] - Z[0]).T for s in range(1, seeds)]).astype(np.float64)  # ((seeds-1) n, K)
    if X.shape[0] < K or np.linalg.matrix_rank(X) < K:
        raise ModelError("not enough learning runs to identify %d noise arrays" % K)
    for i, key in enumerate(keys):
        y = np.concatenate([wrap32(v0[s][key] - v0[0][key]) for s in range(1, seeds)]).astype(np.float64)
        c = np.rint(np.linalg.lstsq(X, y, rcond=None)[0]).astype(np.int64)
        e = [wrap32(v0[s][key] - c @ Z[s]) for s in range(seeds)]
        if any((x != e[0]).any() for x in e):
            raise ModelError("array %r is not an exact integer combination of the noise draws" % (key,))
        dl = [wrap32(v1[s][key] - v0[s][key]) for s in range(seeds)]
        if any((x != dl[0]).any() for x in dl):
            raise ModelError("the event's effect on %r depends on the noise" % (key,))
        C[i] = c
        E0[i] = e[0]
        delta[i] = dl[0]
    buffers: dict[tuple[int, str], bytes] = {}
    exact = True
    for mi, m in enumerate(runs0[0].moments):
        for k, b in m.buffers.items():
            vals = {r.moments[mi].buffers[k] for r in runs0 + runs1}
            if len(vals) > 1:
                exact = False
                notes.append("byte buffer %s holds seed-dependent bytes at %s (e.g. CSPRNG output)" % (k, m.label))
            buffers[(mi, k)] = b
    idx = {k: i for i, k in enumerate(keys)}
    moments = []
    for mi, m in enumerate(runs0[0].moments):
        moments.append((m.label, [idx[("ram", mi, k)] for k in m.arrays], m.n_flash))
    releases = [idx[k] for k in keys if k[0] == "release"]
    for j, ri in enumerate(releases):
        nz = runs0[0].release_meta[j].get("nz")
        if nz is not None and int(np.abs(C[ri]).sum()) != nz:
            notes.append("release %d says nz=%s but carries %d noise draws per cell" % (j, nz, int(np.abs(C[ri]).sum())))
    flash = [idx[k] for k in keys if k[0] == "flash"]
    return Model(p, sc, keys, C, E0, delta, runs0[0].cells, moments, releases, flash, buffers, list(specs), exact,
                 notes)


def check_run(model: Model, r: device.Run, world: int) -> list[str]:
    """Differences between a real run and the model (empty: bit-for-bit equal)."""
    bad: list[str] = []
    try:
        Z, _, specs = decode(model.p, r)
    except ModelError as exc:
        return [str(exc)]
    if Z.shape[0] != model.K:
        return ["%d noise arrays drawn, the model has %d" % (Z.shape[0], model.K)]
    if [device.spec_key(x) for x in specs] != [device.spec_key(x) for x in model.specs]:
        return ["the noise arrays' distributions differ from the model's"]
    v = view_arrays(r)
    if list(v) != model.keys:
        return ["the view has other arrays than the model"]
    pred = wrap32(model.E0 + (model.delta if world else 0) + model.C @ Z)
    for i, key in enumerate(model.keys):
        if (pred[i] != v[key]).any():
            bad.append("array %r differs from the model" % (key,))
    for mi, m in enumerate(r.moments):
        for k, b in m.buffers.items():
            if model.buffers.get((mi, k)) != b:
                bad.append("buffer %s at %s differs from the model" % (k, m.label))
    return bad


def verify(model: Model, trials: int, source: Callable[[], Any] = SystemSource) -> None:
    """Run ``trials`` real trials per world with the system CSPRNG and require
    the model to reproduce each view bit for bit; otherwise mark it inexact."""
    for t in range(trials):
        for w in (0, 1):
            r = device.run(model.p, model.scenario, w, lambda i: source())
            bad = check_run(model, r, w)
            if bad:
                model.exact = False
                model.notes.append("real trial %d (world %d): %s" % (t, w, "; ".join(bad[:3])))
                return
    model.verified = 2 * trials


# -- the noise distribution ------------------------------------------------------

@dataclass
class Pmf:
    """A pmf on the integers lo, lo+1, ..., lo+len(p)-1."""

    lo: int
    p: np.ndarray

    def logpmf(self, x: np.ndarray) -> np.ndarray:
        i = np.asarray(x, dtype=np.int64) - self.lo
        ok = (i >= 0) & (i < len(self.p))
        out = np.full(i.shape, -745.0)
        with np.errstate(divide="ignore"):
            lp = np.log(self.p)
        lp[~np.isfinite(lp)] = -745.0
        out[ok] = lp[i[ok]]
        return out

    def scaled(self, a: int) -> "Pmf":
        """The pmf of a * X."""
        a = abs(a)
        if a == 1:
            return self
        q = np.zeros((len(self.p) - 1) * a + 1)
        q[::a] = self.p
        return Pmf(self.lo * a, q)

    def conv(self, other: "Pmf") -> "Pmf":
        q = np.convolve(self.p, other.p)
        keep = q > 1e-300
        first = int(np.argmax(keep))
        last = len(q) - int(np.argmax(keep[::-1]))
        return Pmf(self.lo + other.lo + first, q[first:last])


POINT = Pmf(0, np.array([1.0]))


def base_pmf(spec: Any) -> Pmf:
    """The exact pmf of one draw of ``spec`` (pansketch.agent.noise.NoiseSpec), truncated
    where the tail mass falls below 1e-40 (float64 on the host: a report, not the noise path)."""
    if spec.mech == "dlap":
        t = spec.num / spec.den  # P[x] ∝ exp(-|x|/t)
        q = math.exp(-1.0 / t)
        hi = int(math.ceil(t * 92.2)) + 1  # q^hi < 1e-40
        x = np.arange(-hi, hi + 1)
        p = (1 - q) / (1 + q) * np.exp(-np.abs(x) / t)
    else:
        s2 = spec.num / spec.den  # P[x] ∝ exp(-x^2 / (2 sigma^2))
        hi = int(math.ceil(math.sqrt(2 * s2 * 92.2))) + 1
        x = np.arange(-hi, hi + 1)
        p = np.exp(-(x.astype(np.float64) ** 2) / (2 * s2))
        p /= p.sum()
    return Pmf(-hi, p / p.sum())


def pmf_of(base: Pmf, coefs: tuple[int, ...]) -> Pmf:
    """The pmf of sum_k coefs[k] * X_k for independent X_k ~ base."""
    out = POINT
    for a in coefs:
        if a:
            out = out.conv(base.scaled(a))
    return out


def pmf_mixed(terms: tuple[tuple[Pmf, int], ...]) -> Pmf:
    """The pmf of sum_k a_k * X_k for independent X_k ~ base_k, ``terms`` = ((base_k, a_k), ...)."""
    out = POINT
    for base, a in terms:
        if a:
            out = out.conv(base.scaled(a))
    return out


def sample(base: Pmf, size: tuple[int, ...], gen: np.random.Generator) -> np.ndarray:
    """Independent draws from ``base`` by inverse CDF (numpy; equivalence: module doc)."""
    cdf = np.cumsum(base.p)
    cdf /= cdf[-1]
    u = gen.random(size)
    return np.searchsorted(cdf, u, side="right").astype(np.int64) + base.lo


def sample_arrays(bases: list[Pmf], T: int, d: int, gen: np.random.Generator) -> np.ndarray:
    """(T, K, d) independent draws, Z[:, k, :] from ``bases[k]`` (inverse CDF, one uniform per draw).

    With one distribution for all k this consumes the generator exactly as
    ``sample(base, (T, K, d), gen)`` and returns the same array."""
    K = len(bases)
    if K and all(b is bases[0] for b in bases):
        return sample(bases[0], (T, K, d), gen)
    u = gen.random((T, K, d))
    out = np.empty((T, K, d), dtype=np.int64)
    for k, base in enumerate(bases):
        cdf = np.cumsum(base.p)
        cdf /= cdf[-1]
        out[:, k, :] = np.searchsorted(cdf, u[:, k, :], side="right").astype(np.int64) + base.lo
    return out
