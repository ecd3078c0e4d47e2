"""CPython's inlined ``Sketch.update`` (text items, d = 4 unrolled) equals the portable path.

The portable path is ``add_stream(hashing.digest(...))`` with the byte-wise row reading the
MicroPython core uses (``_words`` switched off), i.e. hash version 1 as written in
agent/hashing.py; tests/test_mp_core.py checks that path against the MicroPython VM.
"""

from __future__ import annotations

import random

import pytest

from agent import hashing
from agent.noise import wrap32
from agent.sketch import Sketch

PREFIX = hashing.salt_prefix("fleet-salt-fast")


def portable(kind: str, d: int, w: int, clip: int) -> Sketch:
    s = Sketch(kind, d, w, PREFIX, clip=clip)
    s._words = None  # the MicroPython row reading (bytes, not struct)
    s._hs = None
    return s


def events(n: int, seed: int) -> list:
    rnd = random.Random(seed)
    pool = ["dev-%05d" % i for i in range(500)] + ["ü-%d" % i for i in range(20)] + ["", b"raw", 7]
    return [(rnd.choice(pool), rnd.choice((1, 1, 1, -1, 3, -4, 0, 1 << 20))) for _ in range(n)]


@pytest.mark.parametrize("kind,d,w", [("cms", 4, 2048), ("cs", 4, 2048), ("cs", 4, 100), ("cms", 3, 64), ("cs", 9, 32)])
def test_update_equals_portable_path(kind, d, w):
    fast = Sketch(kind, d, w, PREFIX, clip=5)
    ref = portable(kind, d, w, 5)
    assert (fast._hs is not None) == (d <= 8) and fast._d4 == (d == 4)
    for x, v in events(6000, d * w):
        fast.update(x, v)
        c = ref.clip_weight(v)
        if c:
            ref.add_stream(hashing.digest(PREFIX, x, d), c)
    assert list(fast.counters) == list(ref.counters)
    assert any(fast.counters)


@pytest.mark.parametrize("kind", ["cms", "cs"])
def test_unrolled_update_wraps_from_the_row_that_overflowed(kind):
    """Cells near +-2**31: rows overflow in every position, also mid-event (earlier rows already
    added). Reference: plain ints reduced mod 2**32 per cell (what MicroPython's array store does)."""
    w = 16
    fast = Sketch(kind, 4, w, PREFIX, clip=1 << 30)
    ref = [0x7FFFFFFF - (i % 3) if i % 2 else -0x80000000 + (i % 3) for i in range(4 * w)]
    for i, v in enumerate(ref):
        fast.counters[i] = v
    rnd = random.Random(5)
    wrapped = 0
    for k in range(3000):
        x = "item-%d" % rnd.randrange(200)
        v = rnd.choice((1, -1, 1 << 30, -(1 << 30), 3))
        for r, (col, sign) in enumerate(hashing.columns(PREFIX, x, 4, w)):
            j = r * w + col
            exact = ref[j] + (v * sign if kind == "cs" else v)
            wrapped += exact != wrap32(exact)
            ref[j] = wrap32(exact)
        fast.update(x, v)
        assert list(fast.counters) == ref, k
    assert wrapped > 100  # the wrap path really ran
