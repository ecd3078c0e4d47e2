"""A fleet of dbits devices made by the device core (demo parameters, deterministic byte source) and a stolen device's crafted release: shared by the dbits flag tests and the stored-flag tests."""

from __future__ import annotations

import array
import os
from typing import Any

import numpy as np
from pansketch.agent import release
from pansketch.agent.params import Params
from pansketch.agent.recorders import make
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools.ingest.decode import decode

from tests.support.host import SALT, T0


def _params(dev: str) -> Params:
    return Params({"device": dev, "salt": SALT, "kind": "dbits", "d": 12, "w": 256, "mode": "window",
                   "window_s": 3600, "mechanism": "dlap", "budget": "1"})


def _device(dev: str, root: str, distinct: list[int]) -> list[bytes]:
    rec = make(_params(dev), os.path.join(root, dev), T0, rng=Rng(DeterministicSource("dbflag-" + dev)),
               log=lambda _m: None)
    t = T0
    for k, n in enumerate(distinct):
        rec.add_many(["%s-badge-%d-%d" % (dev, k, x) for x in range(n)])
        t += 3600
        rec.tick(t)
    return [rec.outbox.read(s) for s in rec.outbox.pending()]


def _crafted(raw: bytes, change: Any) -> bytes:
    rel = decode(raw)
    c = change(rel.counters().astype(np.int64).reshape(-1).copy())
    return release.encode(_params(rel.dev), rel.seq, rel.elo, rel.ehi, rel.part,
                          array.array("i", [int(x) for x in c]), rel.nz)
