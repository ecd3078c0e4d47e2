"""The numpy host path equals the device path bit for bit."""

import random

import numpy as np
import pytest

from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch
from pansketch.host_tools import fasthash

SALT = "fleet-salt-for-tests"


def mixed_items(n, seed=1):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = i % 3
        if k == 0:
            out.append("item-%d-é" % rnd.randrange(50))
        elif k == 1:
            out.append(bytes([rnd.randrange(256) for _ in range(rnd.randrange(1, 9))]))
        else:
            out.append(rnd.randrange(-10**12, 10**12))
    return out


@pytest.mark.parametrize("d", [1, 4, 8, 9, 15])
def test_streams_and_columns_match_device(d):
    items = mixed_items(300)
    w = 1000
    st = fasthash.streams(items, SALT, d)
    cols, signs = fasthash.cols_signs(st, d, w)
    prefix = hashing.salt_prefix(SALT)
    for i, x in enumerate(items):
        assert bytes(st[i]) == hashing.digest(prefix, x, d)
        assert [(int(c), int(s)) for c, s in zip(cols[i], signs[i])] == hashing.columns(prefix, x, d, w)


@pytest.mark.parametrize("kind", ["cms", "cs"])
def test_sketch_counts_equal_device_sketch(kind):
    rnd = random.Random(7)
    items = ["k%d" % int(rnd.paretovariate(1.0)) for _ in range(5000)]
    weights = [rnd.randint(-3, 3) for _ in items]
    d, w, clip = 5, 257, 2
    dev = Sketch(kind, d, w, hashing.salt_prefix(SALT), clip)
    for x, v in zip(items, weights):
        dev.update(x, v)
    host = fasthash.sketch_counts(items, weights, kind, d, w, SALT, clip=clip)
    assert np.array_equal(host.ravel(), np.array(dev.counters, dtype=np.int64))
    # and the device batch path agrees too
    dev2 = Sketch(kind, d, w, hashing.salt_prefix(SALT), clip)
    dev2.update_many(items, weights)
    assert list(dev2.counters) == list(dev.counters)


def test_estimates_match_device_estimate():
    items = ["a", "b", "c", "a", "a", "d"] * 10
    for kind in ("cms", "cs"):
        dev = Sketch(kind, 5, 64, hashing.salt_prefix(SALT))
        dev.update_many(items)
        est = fasthash.estimates(np.array(dev.counters).reshape(5, 64), ["a", "b", "zz"], kind, SALT)
        assert list(est) == [dev.estimate(x) for x in ["a", "b", "zz"]]
