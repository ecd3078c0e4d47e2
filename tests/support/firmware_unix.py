"""Shared by tests/test_firmware_unix.py and the tests that build on it: ZERO, events, exact, summed."""

from __future__ import annotations

from array import array
import cbor2
from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch
from tests.support import unixvm as U


ZERO = "100000"  # sigma^2 = 4 / 200000: every noise draw is 0 with overwhelming probability


def exact(events: list[str], w: int = 64) -> list[int]:
    sk = Sketch("cs", 4, w, hashing.salt_prefix(U.SALT))
    for e in events:
        sk.update(e)
    return list(sk.counters)


def summed(payloads: list[bytes]) -> list[int]:
    tot: list[int] = []
    for p in payloads:
        ctr = array("i", cbor2.loads(p)["ctr"])
        tot = list(ctr) if not tot else [a + b for a, b in zip(tot, ctr)]
    return tot


def events(prefix: str, n: int, distinct: int = 9) -> list[str]:
    return ["%s-%d" % (prefix, i % distinct) for i in range(n)]
