"""CPython's per-event ``Sketch.update`` for the default shapes (not on boards).

For d = 4, w a power of two <= 2**16 and no tree levels, ``Sketch.update``
is replaced per instance by a closure over four memoryview rows of the
counters: no attribute lookups, no row offsets, and a memoryview store costs
less than an ``array('i')`` store. Same cells and bytes as the method
(dp-linear-sketches.txt Algorithm 1 with hash version 1, agent/hashing.py);
tests/test_sketch_fastpath.py holds them equal, wraps included.

The rows are cells of the closure that :func:`bind` re-points, so an
``update`` a caller took earlier (feed, the benchmarks) follows the sketch
to its next array; no rows (tree mode) send every event to the method.
"""

import hashlib
import time
import weakref

from pansketch.agent import hashing

_SHA = []  # type: list  # the SHA-256 constructor the closures copy from, chosen once (fastest_sha256)


def fastest_sha256():
    """Of CPython's builtin SHA-256 (pansketch.agent.hashing.sha256) and OpenSSL's (hashlib), the one whose
    copy-update-digest of a short item costs less on this machine. Both give the same bytes; which is
    faster depends on the CPU: OpenSSL uses the SHA instructions where the CPU has them (0.21 against
    0.27 us per item on an AMD EPYC with SHA-NI), the builtin is cheaper per object where it has not.
    Timed here, best of 3 x 200 items each (under a millisecond, once)."""
    if not _SHA:
        best, pick = None, hashing.sha256
        for c in (hashing.sha256, hashlib.sha256):
            h = c(b"pansketch/h1\x10calibration-salt-s")
            copy = h.copy
            t_min = None
            for _r in range(3):
                t = time.perf_counter()
                for _i in range(200):
                    x = copy()
                    x.update(b"0123456789abcdef")
                    x.digest()
                t = time.perf_counter() - t
                t_min = t if t_min is None or t < t_min else t_min
            if best is None or t_min < best:
                best, pick = t_min, c
        _SHA.append(pick)
    return _SHA[0]


_CLOSURES = weakref.WeakKeyDictionary()  # type: weakref.WeakKeyDictionary  # sketch -> [update, rebind], made once per sketch


def bind(sk, low4, lowsign4, words4):
    """Point ``sk``'s closure at the array it holds now (install it if needed),
    or take it away (tree mode, ``arrays`` set): the method counts then. ``sk._cur``
    lists the rows the closure counts into ([] without), for whoever reads the sketch
    (the intruder-view tests, the auditor); the closure itself never reads it."""
    cur = sk.__dict__["_cur"]
    a = sk.__dict__.get("_counters")
    pair = _CLOSURES.get(sk)
    if a is None or sk.__dict__.get("_arrays") is not None:
        del cur[:]
        if pair is not None:
            pair[1](None)  # an update taken earlier sends its events to the method now
        sk.__dict__.pop("update", None)
        return
    w = sk.w
    mv = memoryview(a)
    cur[:] = [mv[0:w], mv[w:2 * w], mv[2 * w:3 * w], mv[3 * w:4 * w]]
    if pair is None:
        # the prefix state every path of this sketch copies (the closure, Sketch.digest, feed's batch
        # path), made with the faster SHA-256 here: public (the salt prefix), the same bytes either way
        sk._hs = fastest_sha256()(sk._ps)
        pair = _CLOSURES[sk] = _closure(weakref.ref(sk), type(sk).update, sk._hs.copy, sk._mask, sk.signed,
                                         low4, lowsign4, words4)
    pair[1](cur)
    sk.update = pair[0]


def _closure(ref, method, copy, m, signed, low4, lowsign4, words4):
    """[update, rebind]: update(item, weight=1) for a text item of weight 1 (anything else, and
    everything while no rows are bound, goes to ``method``); rebind(rows) points it at four
    memoryview rows, or None. The rows are the closure's own cells, shared by every reference
    to this update: reading a cell costs less per event than unpacking a list. A memoryview
    refuses a value outside int32 with ValueError before it stores it: ``r`` rows are done and
    _wrap_rows goes on from there (counters wrap mod 2**32, docs/PRIVACY.md "Counters wrap").
    Two bodies, one per kind, on purpose: choosing the sign rule per event would cost every event."""
    r0 = r1 = r2 = r3 = None

    def rebind(rows):
        nonlocal r0, r1, r2, r3
        r0, r1, r2, r3 = rows if rows is not None else (None, None, None, None)

    if signed:
        def update(item, weight=1):
            if weight != 1 or type(item) is not str or r0 is None:
                return method(ref(), item, weight)
            h = copy()
            h.update(item.encode())
            c0, s0, c1, s1, c2, s2, c3, s3 = lowsign4(h.digest())
            r = 0
            try:
                r0[c0 & m] += -1 if s0 > 127 else 1
                r = 1
                r1[c1 & m] += -1 if s1 > 127 else 1
                r = 2
                r2[c2 & m] += -1 if s2 > 127 else 1
                r = 3
                r3[c3 & m] += -1 if s3 > 127 else 1
            except ValueError:
                ref()._wrap_rows(words4(h.digest()), r, 1)
    else:
        def update(item, weight=1):
            if weight != 1 or type(item) is not str or r0 is None:
                return method(ref(), item, weight)
            h = copy()
            h.update(item.encode())
            c0, c1, c2, c3 = low4(h.digest())
            r = 0
            try:
                r0[c0 & m] += 1
                r = 1
                r1[c1 & m] += 1
                r = 2
                r2[c2 & m] += 1
                r = 3
                r3[c3 & m] += 1
            except ValueError:
                ref()._wrap_rows(words4(h.digest()), r, 1)
    return [update, rebind]
