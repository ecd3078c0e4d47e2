"""The Pi daemon's numpy batch path: one input chunk into the sketch at once.

CPython only (numpy): **not** part of the MicroPython device core. Equal,
counter for counter and mod 2**32, to ``Sketch.update_many`` and so to one
``Sketch.update`` per event (tests/test_batch.py): each distinct item of the
chunk is hashed once (hash version 1, the sketch's own text shortcut), then
numpy extracts every row's column and sign and scatter-adds the chunk's
per-item totals with ``np.bincount``.

Exposure window (docs/PRIVACY.md, "The intruder's view"): the chunk's raw
lines and its exact per-item totals exist only while this call runs; the
totals dict is cleared and every numpy array holding hashes, columns or
totals is zeroed before it is dropped (freed heap itself is not zeroed by
CPython, as for every other transient buffer). No aggregate outlives the
chunk.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from agent.sketch import Sketch, totals

SMALL = 64  # fewer distinct items than this: the plain path is as fast


def add_batch(sk: Sketch, items: Sequence[Any], weights: Optional[Sequence[int]] = None) -> None:
    """``sk.update_many(items, weights)``, vectorised."""
    agg: dict[Any, int] = totals(items, weights, sk.clip)
    n = len(agg)
    if n < SMALL:
        for x in agg:
            if agg[x]:
                sk.add_stream(sk.digest(x), agg[x])
        agg.clear()
        return
    d, w = sk.d, sk.w
    nbytes = len(sk.digest(""))  # 32 * ceil(d / 8)
    buf = bytearray(nbytes * n)
    vals = np.empty(n, dtype=np.int64)
    o = 0
    digest = sk.digest
    for i, x in enumerate(agg):
        buf[o:o + nbytes] = digest(x)
        vals[i] = agg[x]
        o += nbytes
    agg.clear()
    st = np.frombuffer(buf, dtype=np.uint8).reshape(n, nbytes)
    words = np.ascontiguousarray(st[:, :4 * d]).view("<u4").astype(np.int64)  # (n, d)
    idx = (words & 0x3FFFFFFF) % w + np.arange(d, dtype=np.int64) * w
    if sk.signed:
        wts = np.where(words >> 31, -vals[:, None], vals[:, None])
    else:
        wts = np.broadcast_to(vals[:, None], (n, d))
    # exact: bincount's float64 sums are exact below 2**53 (clip * events in a chunk)
    tot = np.bincount(idx.ravel(), weights=wts.ravel(), minlength=d * w)
    add = tot.astype(np.int64).astype(np.int32)
    for arr in (sk.arrays if sk.arrays is not None else (sk.counters,)):  # tree mode: every open level
        cells = np.frombuffer(arr, dtype=np.int32)  # a view: writes go to the array
        cells += add  # int32 arithmetic wraps mod 2**32 (wrap32)
    add.fill(0)
    for a in (words, idx, vals, tot):
        a.fill(0)
    if sk.signed:
        wts.fill(0)
    buf[:] = bytes(len(buf))
