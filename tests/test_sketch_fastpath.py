"""CPython's inlined ``Sketch.update`` (text items, d = 4 unrolled) equals the portable path.

The portable path is ``add_stream(hashing.digest(...))`` with the byte-wise row reading the
MicroPython core uses (``_words`` switched off), i.e. hash version 1 as written in
agent/hashing.py; tests/test_mp_core.py checks that path against the MicroPython VM.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pansketch.agent import hashing
from pansketch.agent.noise import wrap32
from pansketch.agent.sketch import Sketch

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


@pytest.mark.parametrize("kind,d,w", [("cms", 4, 2048), ("cs", 4, 2048), ("cs", 4, 100), ("cms", 3, 64), ("cs", 9, 32),
                                      ("cs", 4, 1 << 16), ("cms", 4, 1 << 16), ("cs", 4, 1 << 17), ("cms", 4, 2)])
def test_update_equals_portable_path(kind, d, w):
    """d = 4 with w a power of two <= 2**16 takes the 16-bit row values (``_mask``), other shapes the 30-bit words."""
    fast = Sketch(kind, d, w, PREFIX, clip=5)
    ref = portable(kind, d, w, 5)
    assert (fast._hs is not None) == (d <= 8) and fast._d4 == (d == 4)
    assert fast._mask == (w - 1 if d == 4 and w in (2, 2048, 1 << 16) else 0)
    for x, v in events(6000, d * w):
        fast.update(x, v)
        c = ref.clip_weight(v)
        if c:
            ref.add_stream(hashing.digest(PREFIX, x, d), c)
    assert list(fast.counters) == list(ref.counters)
    assert any(fast.counters)


@pytest.mark.parametrize("kind", ["cms", "cs"])
@pytest.mark.parametrize("w", [16, 12])  # the 16-bit (power of two) and the 30-bit unrolled path
def test_unrolled_update_wraps_from_the_row_that_overflowed(kind, w):
    """Cells near +-2**31: rows overflow in every position, also mid-event (earlier rows already
    added). Reference: plain ints reduced mod 2**32 per cell (what MicroPython's array store does)."""
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


def test_builtin_sha256_gives_hashlibs_bytes_and_falls_back_without_it():
    """hashing.sha256 is CPython's builtin SHA-256 (_sha2 / _sha256) where it exists: same digests as
    hashlib's (copied states included); without the builtin module it is hashlib.sha256."""
    import hashlib
    import subprocess
    import sys

    for data in (b"", b"abc", PREFIX + b"s" + "ü-x".encode(), bytes(range(256)) * 3):
        h = hashing.sha256(data[:7])
        c = h.copy()
        c.update(data[7:])
        assert c.digest() == hashlib.sha256(data).digest() == hashing.sha256(data).digest()
        assert h.digest() == hashlib.sha256(data[:7]).digest()  # the copy left the original alone
    code = ("import sys, hashlib; sys.modules['_sha2'] = None; sys.modules['_sha256'] = None\n"
            "from pansketch.agent import hashing; assert hashing.sha256 is hashlib.sha256, hashing.sha256\n"
            "from pansketch.agent.sketch import Sketch\n"
            "s = Sketch('cs', 4, 64, hashing.salt_prefix('x')); s.update('a'); print(sum(map(abs, s.counters)))")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "4"


@pytest.mark.parametrize("kind", ["cms", "cs"])
def test_per_event_closure_counts_alike_with_either_sha256(kind, monkeypatch):
    """The closure copies its prefix state from whichever SHA-256 is faster on the machine
    (fastupdate.fastest_sha256: CPython's builtin or OpenSSL's): the same cells either way."""
    import hashlib

    from pansketch.agent.pi import fastupdate

    picked = fastupdate.fastest_sha256()
    assert picked in (hashing.sha256, hashlib.sha256) and fastupdate.fastest_sha256() is picked  # chosen once
    rnd = random.Random(5)
    evs = [("e-%d" % rnd.randrange(400), 1) for _ in range(3000)] + [("ü-%d" % k, 1) for k in range(50)]
    ref = _reference(kind, 64, [0] * (4 * 64), evs)
    from pansketch.agent.pi import batch

    data = "".join(x + "\n" for x, _v in evs).encode()
    for c in (hashing.sha256, hashlib.sha256):
        monkeypatch.setattr(fastupdate, "_SHA", [c])
        fast = Sketch(kind, 4, 64, PREFIX)
        assert "update" in fast.__dict__ and type(fast._hs) is type(c(b""))  # every path copies this state
        for x, v in evs:
            fast.update(x, v)
        assert list(fast.counters) == ref, c
        bulk = Sketch(kind, 4, 64, PREFIX)  # feed's batch path (agent/pi/batch.py) from the same state
        batch.add_raw(bulk, data, lambda *_a: None)
        assert list(bulk.counters) == ref, c


def _reference(kind: str, w: int, start: list[int], evs: list) -> list[int]:
    """Plain ints mod 2**32 per cell, cells from hashing.columns (hash version 1)."""
    ref = list(start)
    for x, v in evs:
        for r, (col, sign) in enumerate(hashing.columns(PREFIX, x, 4, w)):
            j = r * w + col
            ref[j] = wrap32(ref[j] + (v * sign if kind == "cs" else v))
    return ref


@pytest.mark.parametrize("kind", ["cms", "cs"])
def test_per_event_closure_wraps_weight_one_events_from_the_row_that_overflowed(kind):
    """The closure (weight 1, text) stores through memoryview rows, which refuse a value outside
    int32 with ValueError: every cell sits at the edge, so nearly every event wraps some row."""
    w = 16
    fast = Sketch(kind, 4, w, PREFIX)
    assert "update" in fast.__dict__  # the closure is what callers get
    start = [0x7FFFFFFF if i % 2 else -0x80000000 for i in range(4 * w)]
    for i, v in enumerate(start):
        fast.counters[i] = v
    rnd = random.Random(11)
    evs = [("e-%d" % rnd.randrange(300), 1) for _ in range(2000)]
    for x, v in evs:
        fast.update(x, v)
    ref = _reference(kind, w, start, evs)
    assert list(fast.counters) == ref
    assert sum(1 for a, b in zip(start, ref) if (a > 0) != (b > 0)) > 4 * w // 4  # many cells really wrapped


def test_per_event_closure_follows_the_array_the_sketch_holds():
    """A caller that took ``update`` once (as feed and the benchmarks do) keeps counting into the array
    the sketch holds now: after the recorder's swap of ``counters``, and into every array in tree mode."""
    from pansketch.agent.sketch import new_counters

    s = Sketch("cs", 4, 64, PREFIX, clip=5)
    u = s.update
    first = s.counters
    u("before")
    second = new_counters(4 * 64)
    s.counters = second  # the recorder's swap at a release
    u("after")
    u("weighted", 3)  # the method's path
    assert list(first) == _reference("cs", 64, [0] * 256, [("before", 1)])
    assert list(second) == _reference("cs", 64, [0] * 256, [("after", 1), ("weighted", 3)])
    third = new_counters(4 * 64)
    s.arrays = [second, third]  # tree mode: each event into every open level
    assert "update" not in s.__dict__
    u("tree")
    s.update("tree2")
    assert list(third) == _reference("cs", 64, [0] * 256, [("tree", 1), ("tree2", 1)])
    s.arrays = None
    assert "update" in s.__dict__
    u("back")
    assert list(first) == _reference("cs", 64, [0] * 256, [("before", 1)])  # never touched again
    assert list(second) == _reference("cs", 64, [0] * 256,
                                      [("after", 1), ("weighted", 3), ("tree", 1), ("tree2", 1), ("back", 1)])
