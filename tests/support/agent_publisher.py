"""Shared by tests/test_agent_publisher.py and the tests that build on it: FROZEN, T0, estimate, outbox."""

from __future__ import annotations

import array
import os
import cbor2
from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch
from tests.support.e2e import SALT


T0 = 1_700_000_000 - 1_700_000_000 % 3600  # in the past: the host quarantines windows from the future  # a window boundary


FROZEN = ("--clock-start", str(T0 + 10), "--clock-speed", "0")


def outbox(state: str) -> dict[int, bytes]:
    d = os.path.join(state, "outbox")
    out = {}
    for n in sorted(os.listdir(d)):
        if n.endswith(".cbor"):
            with open(os.path.join(d, n), "rb") as f:
                out[int(n[:10])] = f.read()
    return out


def estimate(payload: bytes, item: str) -> float:
    m = cbor2.loads(payload)
    ctr = array.array("i")
    ctr.frombytes(m["ctr"])
    return Sketch(m["kind"], m["d"], m["w"], hashing.salt_prefix(SALT), 1, ctr).estimate(item)
