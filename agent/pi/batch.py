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
totals is zeroed before it is dropped, with no hidden numpy temporaries; the
small objects (lines, digests, hash objects) are overwritten in the heap by
pansketch.agent.pi.memwipe.scrub before the daemon waits for more input. No aggregate
outlives the chunk (docs/PRIVACY.md "Memory residue").
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional, Sequence

import numpy as np

from pansketch.agent.pi import hashvec
from pansketch.agent.pi.memwipe import ON as WIPE
from pansketch.agent.sketch import Sketch, totals

SMALL = 64  # fewer distinct items than this: the plain path is as fast


def add_raw(sk: Sketch, data: bytes, warn: Callable[[str, str], None]) -> None:
    """Count one chunk of complete input lines (``RawLines.data``) into ``sk``.

    Equal to ``add_batch(sk, *parse_lines(data, warn))`` (tests/test_feed_chunks.py). When every
    line is plain text (valid UTF-8, no TAB weight, no CR) the lines are split and counted as
    bytes, which are then exactly the UTF-8 the hash reads (hash version 1, ``b"s" + utf8``): no
    str is made per line, and each distinct line is hashed once from the sketch's prefix state.
    Anything else takes :func:`pansketch.agent.pi.sources.parse_lines`.
    """
    hs = sk._hs
    if hs is None or b"\t" in data or b"\r" in data or not _utf8(data):
        from pansketch.agent.pi.sources import parse_lines

        items, weights = parse_lines(data, warn)  # type: ignore[arg-type]
        add_batch(sk, items, weights)
        del items, weights
        return
    agg = Counter(data.split(b"\n"))  # the chunk's exact per-line totals: cleared below
    agg.pop(b"", None)  # empty lines are ignored (parse_lines)
    n = len(agg)
    if not n:
        return
    d, w = sk.d, sk.w
    buf = bytearray(32 * n)  # one digest per distinct line, preallocated: growing it would free copies
    cp = hs.copy  # CPython's per-event closure made it with the faster SHA-256 (pansketch.agent.pi.fastupdate)
    o = 0
    for x in agg:
        h = cp()
        h.update(x)
        buf[o:o + 32] = h.digest()
        o += 32
    del h
    vals = np.fromiter(agg.values(), dtype=np.int64, count=n)
    agg.clear()
    _scatter(sk, buf, vals, n, d, w)
    # The line objects, the digests and the SHA-256 objects (each holds its last item) were
    # small objects, freed into pymalloc's pools: pansketch.agent.pi.memwipe.scrub overwrites those when the
    # daemon is about to wait (agent/daemon.py), not here between two chunks of a busy input.


def _utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode("utf-8")  # strict: valid UTF-8 decodes and re-encodes to the same bytes
    except UnicodeDecodeError:
        return False
    return True


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
    _scatter(sk, buf, vals, n, d, w)


def _scatter(sk: Sketch, buf: bytearray, vals: Any, n: int, d: int, w: int) -> None:
    """Add ``vals[i]`` at every row's cell of hash stream i (``buf``: n streams), then wipe.

    Every array made here holds hashes, columns or exact totals of the chunk, so each one is
    made explicitly, kept in ``held`` and zeroed before it is dropped: no expression leaves an
    unzeroed temporary (``tot.astype(np.int64)``, ``-vals``, ``np.where``'s result), and
    bincount gets its indices as intp and its weights as float64, the types it would otherwise
    convert them to in hidden copies."""
    held: list[Any] = [vals]
    st = np.frombuffer(buf, dtype=np.uint8).reshape(n, len(buf) // n)
    words = hashvec.row_words(st, d)  # (n, d) uint32, a view of buf
    cols = hashvec.columns(words, w)  # (n, d) columns, uint32: a new array
    held.append(cols)
    idx = cols.astype(np.intp)  # bincount's index type
    held.append(idx)
    idx += np.arange(0, d * w, w, dtype=np.intp)  # + r*w: cell index (d*w <= MAX_CELLS < 2**32)
    wts = np.empty((n, d), dtype=np.float64)
    held.append(wts)
    valsf = vals.astype(np.float64)
    held.append(valsf)
    if sk.signed:  # weight * (1 - 2*negative)
        neg = hashvec.negative(words)
        held.append(neg)
        np.multiply(neg, -2.0, out=wts)
        wts += 1.0
        wts *= valsf[:, None]
    else:
        wts[...] = valsf[:, None]
    # exact: bincount's float64 sums are exact below 2**53 (clip * events in a chunk)
    tot = np.bincount(idx.ravel(), weights=wts.ravel(), minlength=d * w)
    held.append(tot)
    tot64 = np.empty(d * w, dtype=np.int64)
    held.append(tot64)
    np.copyto(tot64, tot, casting="unsafe")
    add = tot64.astype(np.int32)  # mod 2**32
    held.append(add)
    for arr in (sk.arrays if sk.arrays is not None else (sk.counters,)):  # tree mode: every open level
        cells = np.frombuffer(arr, dtype=np.int32)  # a view: writes go to the array
        cells += add  # int32 arithmetic wraps mod 2**32 (wrap32)
    del st, words
    if WIPE:
        for a in held:
            a.fill(0)
        buf[:] = bytes(len(buf))


def add_cells(sk: Sketch, cells: bytearray, _weights: Any = None) -> None:
    """Add one counted chunk's d*w int32 cells (a count worker's answer, agent/pi/countworker.py)
    into every open array of ``sk``, mod 2**32 like every update; then zero ``cells``."""
    add = np.frombuffer(cells, dtype=np.int32)  # the worker's array('i'): native byte order
    for arr in (sk.arrays if sk.arrays is not None else (sk.counters,)):  # tree mode: every open level
        c = np.frombuffer(arr, dtype=np.int32)
        c += add  # int32 arithmetic wraps mod 2**32 (wrap32)
    del add
    if WIPE:
        cells[:] = bytes(len(cells))
