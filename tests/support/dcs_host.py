"""Shared by tests/test_dcs_host.py and the tests that build on it: SALT, T0, params, payload, topic."""

from __future__ import annotations

import array
import numpy as np
from pansketch.agent import release
from pansketch.host_tools.query.dyadic import exact_counters
from tests.support.sketches import params_with


SALT = "fleet-salt-1"


T0 = 200_000 * 3600


params = params_with({"device": "pi-1", "salt": SALT, "kind": "dcs", "b": 8, "map": [1, 1, 0], "d": 3, "w": 16})


def payload(p, values, seq=0, epoch=T0 // 3600, part=0, noise=None):
    ex = exact_counters(values, p.b, p.d, p.w, SALT)
    if noise is not None:
        ex = ex + noise
    ctr = array.array("i", ex.astype(np.int32).ravel().tobytes())
    return release.encode(p, seq, epoch, epoch + 1, part, ctr)


def topic(dev):
    return "pansketch/%s/release" % dev
