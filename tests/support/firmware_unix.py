"""Shared by tests/test_firmware_unix.py and the tests that build on it: ZERO, events, exact, summed."""

from __future__ import annotations

from array import array
import cbor2
from pansketch.agent.params import Params
from pansketch.host_tools.store import payloadcodec
from tests.support import sketches
from tests.support import unixvm as U


ZERO = "100000"  # sigma^2 = 4 / 200000: every noise draw is 0 with overwhelming probability


def exact(events: list[str], w: int = 64) -> list[int]:
    """The Unix-port board's counters (cs, d = 4) after ``events``, without noise."""
    return sketches.exact(Params({"device": U.DEVICE, "salt": U.SALT, "kind": "cs", "d": 4, "w": w}), events)


def summed(payloads: list[bytes]) -> list[int]:
    """The counters of ``payloads`` added up: releases as sent, or as the store keeps them (possibly
    compressed: payloadcodec.decode gives back the sent bytes)."""
    tot: list[int] = []
    for p in payloads:
        ctr = array("i", cbor2.loads(payloadcodec.decode(bytes(p)))["ctr"])
        tot = list(ctr) if not tot else [a + b for a, b in zip(tot, ctr)]
    return tot


def events(prefix: str, n: int, distinct: int = 9) -> list[str]:
    return ["%s-%d" % (prefix, i % distinct) for i in range(n)]
