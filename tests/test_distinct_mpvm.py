"""host_tools/lab/algorithms/distinct.py (pan-private distinct count, integer form) on the MicroPython VM.

Same byte source => identical internal noise, identical state after the same
events, identical release (output noise) on CPython and MicroPython; big
integers (the projections have (b+F)*q bits) behave the same on both.
"""

from __future__ import annotations

import pytest

from pansketch.agent import hashing
from pansketch.host_tools.lab.algorithms.distinct import DistinctSketch
from pansketch.agent.rng import DeterministicSource, Rng
from tests.support import mpvm

LAB = mpvm.REPO / "host_tools" / "lab" / "algorithms"

pytestmark = pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")

ITEMS = ["mac-%03d" % (i * 37 % 150) for i in range(600)] + [b"\x01\x02", 7, -3]
ARGS = dict(q=8, vbits=14, frac_bits=4)


def _cpython():
    rng = Rng(DeterministicSource(b"distinct-seed"))
    s = DistinctSketch(12, hashing.salt_prefix("fleet"), rng, (1, 2), **ARGS)
    init = list(s.sk)
    for i, x in enumerate(ITEMS):
        s.update(x, 1 if i % 5 else 3)
    return init, list(s.sk), s.release()


def test_distinct_sketch_identical_on_micropython():
    steps = [
        """
import sys
sys.path.insert(0, "/lab")
from pansketch.agent import hashing
from distinct import DistinctSketch  # the lab module, alone: the rest of its package is numpy
from pansketch.agent.rng import Rng, DeterministicSource
rng = Rng(DeterministicSource(b"distinct-seed"))
s = DistinctSketch(12, hashing.salt_prefix("fleet"), rng, (1, 2), q=8, vbits=14, frac_bits=4)
print("@init", ",".join(str(v) for v in s.sk))
ITEMS = %r
""" % (ITEMS,),
        # events in a separate step (the port collects garbage between steps)
        """
for i, x in enumerate(ITEMS):
    s.update(x, 1 if i % 5 else 3)
print("@state", ",".join(str(v) for v in s.sk))
""",
        """
print("@release", ",".join(str(v) for v in s.release()))
""",
    ]
    r = mpvm.run(steps, heap=256 * 1024, mounts={"/lab": LAB}).check()
    got = r.values()
    init, state, rel = _cpython()
    assert got["init"] == ",".join(str(v) for v in init)
    assert got["state"] == ",".join(str(v) for v in state)
    assert got["release"] == ",".join(str(v) for v in rel)
    assert any(abs(v) >= 1 << 62 for v in state)  # really exercises big integers
