"""Vectorised host path for hash version 1 (see agent/hashing.py).

The device hashes one event at a time; a host replaying millions of events
or ranking 100,000 candidates hashes each *distinct* item once (SHA-256 in a
Python loop: the only per-item cost left) and does the rest with numpy:
column/sign extraction (pansketch.agent.pi.hashvec, the same rule the Pi daemon's batch
path reads), and a scatter-add of the counters with
``np.bincount``. ``tests/test_fasthash.py`` proves every function here equal
to the device path (pansketch.agent.hashing, pansketch.agent.sketch.Sketch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.pi import hashvec


def streams(items: Sequence[Any], salt: str | bytes, d: int) -> np.ndarray:
    """Hash streams of ``items``: uint8 array of shape (n, 32 * ceil(d / 8))."""
    return streams_prefix(items, hashing.salt_prefix(salt), d)


def streams_prefix(items: Sequence[Any], prefix: bytes, d: int) -> np.ndarray:
    """Hash streams under a ready hash prefix (e.g. a dcs level's, pansketch.agent.dcs.level_prefix)."""
    nb = hashing.n_blocks(d)
    out = np.empty((len(items), 32 * nb), dtype=np.uint8)
    base = hashlib.sha256(prefix)
    canonical = hashing.canonical
    if nb == 1:
        buf = bytearray()
        sbase = base.copy()
        sbase.update(b"s")
        cp = sbase.copy
        try:  # the common case, text items: canonical(x) = b"s" + UTF-8 (str subclasses and others: below)
            for x in items:
                if type(x) is not str:
                    raise TypeError
                h = cp()
                h.update(x.encode())
                buf += h.digest()
        except TypeError:
            buf = bytearray()
            for x in items:
                h = base.copy()
                h.update(canonical(x))
                buf += h.digest()
        if items:
            out[:] = np.frombuffer(bytes(buf), dtype=np.uint8).reshape(len(items), 32)
        return out
    for i, x in enumerate(items):
        out[i] = np.frombuffer(hashing.digest(prefix, x, d), dtype=np.uint8)
    return out


def cols_signs(st: np.ndarray, d: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns (int64, shape (n, d)) and signs (int8, +1/-1) from hash streams."""
    words = hashvec.row_words(st, d)
    cols = hashvec.columns(words, w).astype(np.int64)
    signs = np.where(hashvec.negative(words), -1, 1).astype(np.int8)
    return cols, signs


def aggregate(items: Iterable[Any], weights: Iterable[int] | None = None, clip: int = 1) -> tuple[list[Any], np.ndarray]:
    """Distinct items and their summed clipped weights (order of first sight)."""
    agg: dict[Any, int] = {}
    if weights is None:
        get = agg.get
        for x in items:
            agg[x] = get(x, 0) + 1
    else:
        for x, v in zip(items, weights):
            v = clip if v > clip else (-clip if v < -clip else int(v))
            agg[x] = agg.get(x, 0) + v
    return list(agg.keys()), np.fromiter(agg.values(), dtype=np.int64, count=len(agg))


def sketch_counts(items: Iterable[Any], weights: Iterable[int] | None, kind: str, d: int, w: int,
                  salt: str | bytes, clip: int = 1) -> np.ndarray:
    """Exact (noise-free) counters, int64 shape (d, w), equal to pansketch.agent.sketch.Sketch."""
    keys, vals = aggregate(items, weights, clip)
    return counts_from_distinct(keys, vals, kind, d, w, salt)


def counts_from_distinct(keys: Sequence[Any], vals: np.ndarray, kind: str, d: int, w: int,
                         salt: str | bytes) -> np.ndarray:
    """Counters for distinct items with aggregated weights ``vals``."""
    if kind not in ("cms", "cs"):
        raise ValueError("kind must be 'cms' or 'cs'")
    out = np.zeros((d, w), dtype=np.int64)
    if not len(keys):
        return out
    cols, signs = cols_signs(streams(keys, salt, d), d, w)
    for r in range(d):
        wts = vals * signs[:, r] if kind == "cs" else vals
        out[r] = np.bincount(cols[:, r], weights=wts, minlength=w).astype(np.int64)
    return out


def row_values(counters: np.ndarray, cols: np.ndarray, signs: np.ndarray, kind: str) -> np.ndarray:
    """Per-row readings (n, d) of counters (d, w) for items with cols/signs."""
    d = counters.shape[0]
    vals = counters[np.arange(d)[None, :], cols]
    if kind == "cs":
        vals = vals * signs
    return vals


def estimates(counters: np.ndarray, items: Sequence[Any], kind: str, salt: str | bytes) -> np.ndarray:
    """Raw Algorithm 2 estimates (min for CMS, median for CS) for many items."""
    d, w = counters.shape
    cols, signs = cols_signs(streams(items, salt, d), d, w)
    vals = row_values(counters, cols, signs, kind)
    if kind == "cms":
        return vals.min(axis=1).astype(np.float64)
    return np.median(vals, axis=1)
