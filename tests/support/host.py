"""Helpers for the host tests: real releases from the real device core.

Releases come from :class:`pansketch.agent.recorder.Recorder` (internal + output
noise from pansketch.agent.noise, deterministic byte source so the tests are
repeatable) or, for format tests, from :func:`pansketch.agent.release.encode` with
hand-made counters. No tests of its own.
"""

from __future__ import annotations

import math
import array
import os
from typing import Any, Optional

import numpy as np

from pansketch.agent import cbor, release
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools import hostconfig
from tests.support.sketches import params_with

SALT = "host-tests-fleet-salt"
T0 = 1_700_000_000 // 3600 * 3600  # an hour boundary


PARAMS = {"device": "dev-a", "salt": SALT, "kind": "cs", "d": 4, "w": 64, "window_s": 3600}
params = params_with(PARAMS)  # params("dev-b", w=128): that device, those fields changed


def encoded(p: Params, seq: int = 0, elo: Optional[int] = None, part: int = 0, fill: int = 0,
            ehi: Optional[int] = None, nz: int = 2) -> bytes:
    """A valid release of ``p`` with constant counters ``fill`` claiming ``nz`` noise draws per cell."""
    if elo is None:
        elo = T0 // p.epoch_s
    ctr = array.array("i", [fill] * (p.d * p.w))
    return release.encode(p, seq, elo, elo + 1 if ehi is None else ehi, part, ctr, nz)


def release_map(p: Params, **kw: Any) -> dict[str, Any]:
    """The map of a valid release with fields overridden (to build invalid ones)."""
    m = release.release_map(p, 0, T0 // p.epoch_s, T0 // p.epoch_s + 1, 0, array.array("i", [0] * (p.d * p.w)))
    m["ctr"] = bytes(m["ctr"])
    m.update(kw)
    return m


def dumps(m: dict[str, Any]) -> bytes:
    return cbor.dumps(m)


def host_cfg(tmpdir: Any, **sections: dict[str, Any]) -> hostconfig.HostConfig:
    raw: dict[str, Any] = {"fleet": {"salt": SALT}, "aggregator": {"db": os.path.join(str(tmpdir), "host.db")}}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return hostconfig.from_dict(raw)


def zipf_stream(n: int, universe: int, s: float, seed: int, prefix: str = "item") -> list[str]:
    """n events over ``universe`` items with P(rank k) ~ 1/k^s (fixed seed)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, universe + 1) ** s
    p /= p.sum()
    ranks = rng.choice(universe, size=n, p=p)
    return ["%s-%d" % (prefix, int(k)) for k in ranks]


def record(p: Params, root: str, windows: list[list[Any]], seed: Any = None, t_start: int = T0,
           persists: int = 0) -> list[bytes]:
    """Run the real Recorder over consecutive windows of events; return the releases in order.

    ``persists`` > 0 splits each window's events into persists + 1 batches
    with ``Recorder.persist()`` between them (each adds a fresh internal
    noise draw to the live state, so the releases carry nz > 2).
    """
    rec = Recorder(p, root, t_start, rng=Rng(DeterministicSource(seed if seed is not None else p.device)),
                   log=lambda _m: None)
    t = t_start
    for events in windows:
        k = persists + 1
        for i in range(k):
            if i:
                assert rec.persist()
            rec.add_many(events[i * len(events) // k:(i + 1) * len(events) // k])
        t += p.window_s
        rec.tick(t)
    return [rec.outbox.read(s) for s in rec.outbox.pending()]


def topic(dev: str) -> str:
    return "pansketch/%s/release" % dev


def fleet_releases(prefix: str, devices: int, per_device: int, w: int, fill: Any = None) -> list[tuple[str, bytes]]:
    """(topic, release) of devices prefix0, prefix1, ...: release k of each is seq k, epoch T0 + k hours, its
    counters all ``fill(dv, k)`` (default k)."""
    out = []
    for dv in range(devices):
        p = params("%s%d" % (prefix, dv), w=w)
        out += [(topic(p.device), encoded(p, seq=k, elo=T0 // 3600 + k, fill=k if fill is None else fill(dv, k)))
                for k in range(per_device)]
    return out


def binom_upper(n: int, p: float, level: float) -> int:
    """Smallest m with P(X <= m) >= level (X ~ Binomial(n, p)): at most m misses at that level."""
    acc = 0.0
    for m in range(n + 1):
        acc += math.comb(n, m) * p ** m * (1 - p) ** (n - m)
        if acc >= level:
            return m
    return n


def binom_lower(n: int, p: float, level: float) -> int:
    """Largest m with P(X < m) <= 1 - level (X ~ Binomial(n, p))."""
    acc = 0.0
    for m in range(n + 1):
        acc += math.comb(n, m) * p ** m * (1 - p) ** (n - m)
        if acc > 1 - level:
            return m
    return n
