"""Shared by tests/test_firmware_run.py and the tests that build on it: ZERO, expected_ctr, params."""

from __future__ import annotations

from array import array

from pansketch.agent.params import Params
from tests.support.sketches import exact


ZERO = {"budget": "100000"}  # noise is exactly 0 with overwhelming probability (and with the fixed seed)


def params(cfg: dict) -> Params:
    d = dict(cfg["sketch"])
    d.update(device=cfg["device"], salt=cfg["salt"])
    return Params(d)


def expected_ctr(cfg: dict, events: list) -> bytes:
    """Exact counters (no noise) for events [(item, weight)] or [item]."""
    return array("i", exact(params(cfg), events)).tobytes()
