"""A fleet of cs devices made by the device core as the Pi daemon runs it (whole-array noise from a
deterministic byte source), Zipf events over ``ITEMS``, and a stolen device's forged release: shared by
the influence-flag tests and the stored-flag tests."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pansketch.agent.params import Params
from pansketch.agent.pi.batch import add_batch
from pansketch.agent.pi.bulknoise import BulkRng
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource
from tests.support.host import SALT, T0

ITEMS = np.array(["host-%05d.example" % k for k in range(1, 10001)])


def _zipf(n: int, s: float, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(ITEMS) + 1) ** s
    return list(ITEMS[rng.choice(len(ITEMS), size=n, p=p / p.sum())])


def _device(dev: str, root: str, windows: list[list[str]], d: int = 4, w: int = 2048) -> list[bytes]:
    p = Params({"device": dev, "salt": SALT, "kind": "cs", "d": d, "w": w, "mode": "window", "window_s": 3600,
                "mechanism": "dgauss", "budget": "1/2"})
    # the daemon's rng: whole-array noise draws (agent/pi/bulknoise.py), from a deterministic byte source
    rec = Recorder(p, os.path.join(root, dev), T0, rng=BulkRng(DeterministicSource("infl-" + dev)), log=lambda _m: None)
    t = T0
    for ev in windows:
        rec.add_many(ev, None, adder=add_batch)
        t += 3600
        rec.tick(t)
    return [rec.outbox.read(s) for s in rec.outbox.pending()]


def _forged(raw: bytes, change: Any) -> bytes:
    """``raw`` (a real release) with its counters changed by ``change(counters)``: a stolen device's."""
    import array

    from pansketch.agent import release
    from pansketch.host_tools.ingest.decode import decode

    rel = decode(raw)
    c = rel.counters().astype(np.int64).copy()
    c = change(c)
    p = Params({"device": rel.dev, "salt": SALT, "kind": "cs", "d": rel.d, "w": rel.w, "mode": "window",
                "window_s": 3600, "mechanism": "dgauss", "budget": "1/2"})
    return release.encode(p, rel.seq, rel.elo, rel.ehi, rel.part, array.array("i", [int(x) for x in c.ravel()]),
                          rel.nz)
