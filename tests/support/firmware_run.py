"""Shared by tests/test_firmware_run.py and the tests that build on it: ZERO, expected_ctr, params."""

from __future__ import annotations

from pansketch.agent import hashing
from pansketch.agent.params import Params
from pansketch.agent.sketch import Sketch


ZERO = {"budget": "100000"}  # noise is exactly 0 with overwhelming probability (and with the fixed seed)


def params(cfg: dict) -> Params:
    d = dict(cfg["sketch"])
    d.update(device=cfg["device"], salt=cfg["salt"])
    return Params(d)


def expected_ctr(cfg: dict, events: list) -> bytes:
    """Exact counters (no noise) for events [(item, weight)] or [item]."""
    p = params(cfg)
    sk = Sketch(p.kind, p.d, p.w, hashing.salt_prefix(p.salt), p.clip)
    for e in events:
        item, w = e if isinstance(e, tuple) else (e, 1)
        sk.update(item, w)
    return sk.counters.tobytes()
