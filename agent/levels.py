"""A levelled CountSketch: L levels of d x w int32 counters in one flat array.

The common core of kind ``dcs`` (agent/dcs.py: level l counts the dyadic
prefix ``x >> l`` of an integer) and kind ``strhh`` (agent/strhh.py: level l
counts the (l + 1)-byte prefix of a string), both the Private Dyadic
CountSketch of dp-linear-sketches.txt §4. A subclass says what an item's
key is (``key``) and which node of level l a key falls in (``node``); this
class does the rest identically for both:

* layout: level l, row r, column c at index ``(l*d + r)*w + c``;
* a level whose nodes fit in w columns is *exact-indexed*: node v goes to
  column ``column(v)`` of every row with sign +1 (no collisions); the other
  levels hash the node with hash version 1 under the level's own prefix,
  column and sign as in pansketch.agent.hashing (``prefixes[l]``; None: exact);
* one event touches the d rows of every level, each by the clipped weight,
  so the recorder calibrates the noise with arrays = L (pansketch.agent.params);
* counters wrap mod 2^32 exactly as in pansketch.agent.sketch.

Privacy comes from the recorder's noise, not from this class; nothing is
kept between calls except the counters (the batch totals are cleared before
a batch update returns: docs/PRIVACY.md "The intruder's view").
"""

import struct
import sys

from pansketch.agent import hashing
from pansketch.agent.noise import wrap32
from pansketch.agent.sketch import totals

INT32_MAX = 0x7FFFFFFF
INT32_MIN = -0x80000000

# CPython reads the d row words with one struct call; MicroPython reads bytes
# (a 32-bit word would be a heap-allocated big int there), as pansketch.agent.sketch.
_WORDS = sys.implementation.name != "micropython"


def clip(weight, c):
    """An event's weight clipped to [-c, c]: the bound on one event's effect on a
    cell that the noise is calibrated to (docs/ARCHITECTURE.md "Threat model and unit of privacy"); also the
    clip of pansketch.host_tools.lab.algorithms.distinct (here, not in pansketch.agent.noise: a cs/cms board never loads it)."""
    if weight > c:
        return c
    if weight < -c:
        return -c
    return weight


def add_exact(a, base, w, d, col, weight):
    """Add ``weight`` to column ``col`` of the d rows that start at row ``base``."""
    for r in range(d):
        i = (base + r) * w + col
        nv = a[i] + weight
        if nv > INT32_MAX or nv < INT32_MIN:
            nv = wrap32(nv)
        a[i] = nv


def add_hashed(a, base, w, d, stream, weight, words=None):
    """Add ``weight`` times each row's sign at each row's column of a hash
    stream (pansketch.agent.hashing, hash version 1) to the d rows from row ``base``.
    ``words`` is a struct unpack_from of d little-endian words (CPython) or
    None (the bytes are read one by one: MicroPython)."""
    neg = -weight
    if words is not None:
        r = 0
        for u in words(stream):
            i = (base + r) * w + (u & 0x3FFFFFFF) % w
            nv = a[i] + (neg if u >> 31 else weight)
            if nv > INT32_MAX or nv < INT32_MIN:
                nv = wrap32(nv)
            a[i] = nv
            r += 1
        return
    for r in range(d):
        o = 4 * r
        b3 = stream[o + 3]
        i = (base + r) * w + (stream[o] | (stream[o + 1] << 8) | (stream[o + 2] << 16) | ((b3 & 0x3F) << 24)) % w
        nv = a[i] + (neg if b3 & 0x80 else weight)
        if nv > INT32_MAX or nv < INT32_MIN:
            nv = wrap32(nv)
        a[i] = nv


class LevelSketch:
    """L levels of d x w CountSketch in one flat int32 array (``counters``).

    Subclasses set ``prefixes`` (one hash prefix per level, None for an
    exact-indexed level) and define ``key(item)`` (None: the item is not
    counted), ``node(key, level)`` and ``column(node)`` (exact levels).
    """

    def __init__(self, kind, levels, d, w, clip_, counters):
        self.kind = kind
        self.levels = levels
        self.d = d
        self.w = w
        self.clip = clip_
        if len(counters) != levels * d * w:
            raise ValueError("counters have %d cells, need %d" % (len(counters), levels * d * w))
        self.counters = counters
        self.prefixes = None
        self._words = struct.Struct("<%dI" % d).unpack_from if _WORDS else None

    def column(self, node):
        return node

    def update(self, item, weight=1):
        """Add one item (weight clipped to [-clip, clip]); items without a key are ignored."""
        weight = clip(weight, self.clip)
        k = self.key(item)
        if weight and k is not None:
            for lv in range(self.levels):
                self._add_node(lv, self.node(k, lv), weight)

    def update_many(self, items, weights=None):
        """Batch update; equal to :meth:`update` per event (linearity and wrap mod 2^32).

        Totals per item, then per key, then per node of each level, so each
        node's hash is paid once per batch; every total is cleared before
        the call returns.
        """
        per_item = totals(items, weights, self.clip)
        agg = {}
        for it in per_item:
            k = self.key(it)
            if k is not None:
                agg[k] = agg.get(k, 0) + per_item[it]
        per_item.clear()
        nodes = {}
        for lv in range(self.levels):
            for k in agg:
                n = self.node(k, lv)
                nodes[n] = nodes.get(n, 0) + agg[k]
            for n in nodes:
                v = nodes[n]
                if v:
                    self._add_node(lv, n, v)
            nodes.clear()
        agg.clear()

    def _add_node(self, lv, node, weight):
        p = self.prefixes[lv]
        if p is None:
            add_exact(self.counters, lv * self.d, self.w, self.d, self.column(node), weight)
        else:
            add_hashed(self.counters, lv * self.d, self.w, self.d, hashing.digest(p, node, self.d), weight,
                       self._words)
