"""The Pi daemon's numpy batch path equals the per-event device path (agent/pi/batch.py)."""

from __future__ import annotations

import random

import pytest

from pansketch.agent import hashing
from pansketch.agent.pi.batch import add_batch
from pansketch.agent.sketch import Sketch

PREFIX = hashing.salt_prefix("fleet-salt-1")


def stream(n: int, seed: int) -> list:
    rnd = random.Random(seed)
    pool = ["dev-%05d" % i for i in range(3000)] + ["ü-%d" % i for i in range(50)] + [b"raw-bytes", 42, -7]
    return [pool[min(int(rnd.paretovariate(1.1)) - 1, len(pool) - 1)] for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,d,w", [("cms", 4, 2048), ("cs", 4, 256), ("cs", 9, 64), ("cms", 1, 7)])
def test_batch_equals_one_update_per_event(kind, d, w):
    items = stream(20000, d * w)
    rnd = random.Random(1)
    weights = [rnd.randint(-9, 9) for _ in items]
    for ws in (None, weights):
        ref = Sketch(kind, d, w, PREFIX, clip=5)
        fast = Sketch(kind, d, w, PREFIX, clip=5)
        for i, x in enumerate(items):
            ref.update(x, 1 if ws is None else ws[i])
        add_batch(fast, items, ws)
        assert list(fast.counters) == list(ref.counters)


def test_batch_wraps_like_the_device_near_int32():
    items = ["dev-%d" % (i % 300) for i in range(30000)]
    ref = Sketch("cs", 4, 64, PREFIX, clip=1 << 20)
    fast = Sketch("cs", 4, 64, PREFIX, clip=1 << 20)
    for s in (ref, fast):
        for i in range(len(s.counters)):
            s.counters[i] = 0x7FFFFFF0 if i % 2 else -0x7FFFFFF0
    ws = [1 << 20] * len(items)
    for x, v in zip(items, ws):
        ref.update(x, v)
    add_batch(fast, items, ws)
    assert list(fast.counters) == list(ref.counters)
    assert any(abs(v) < 0x7FFFFFF0 - (1 << 24) for v in ref.counters)  # some cells really wrapped
