"""Prefix CountSketch over strings (kind ``strhh``): heavy hitters with no candidate list.

The string analogue of agent/dcs.py (dp-linear-sketches.txt §4, Private
Dyadic CountSketch): instead of the dyadic prefixes of an integer, level l
(0 <= l < L) counts the (l + 1)-byte prefix of the item's encoding, so the
host finds the heavy strings by descending a 256-ary prefix tree
(host_tools/query/strheavy.py), as in the prefix-tree heavy-hitter line of
work (Bassily et al., TreeHist) but central/pan-private: each device keeps
one noisy d x w CountSketch per level, all in one flat int32 array.

Item encoding (L = ``b`` bytes, 3 <= L <= MAX_L), docs/FORMAT.md "Kind strhh":

* the item's bytes s (UTF-8 of a str; bytes as they are);
* len(s) <= L: s padded with NUL (0x00) to L bytes; the NUL is the end marker,
  so an item containing a NUL byte is ignored (like an unparseable dcs reading);
* len(s) > L: the first L - 2 bytes, then 0xFF (never in UTF-8: marks a long
  item), then one tail byte = SHA-256(b"pansketch/strhh-tail" + s)[0], which
  splits the long items sharing an (L-2)-byte prefix into 256 buckets.

Layout: level l, row r, column c at index ``(l*d + r)*w + c``. Levels whose
256^(l+1) nodes fit in w columns are exact-indexed (node = big-endian integer
of the prefix, column = node in every row, sign +1); the others hash the
prefix bytes (canonical ``b"b" + prefix``) with hash version 1 under the level
prefix ``prefix + b"/strhh" + byte(l)``, column and sign as agent.hashing.

One event touches the d rows of all L levels: the recorder calibrates the
noise with arrays = L (Delta1 = L*d*c, Delta2^2 = L*d*c^2; agent.params,
docs/PRIVACY.md "Kind strhh"). Every event does the same work (L hashes)
whatever the item, so the time per event does not depend on the data.
Counters wrap mod 2^32 exactly as in agent.sketch.
"""

import hashlib
import struct
import sys

from agent import hashing
from agent.noise import wrap32

INT32_MAX = 0x7FFFFFFF
INT32_MIN = -0x80000000
MIN_L = 3
MAX_L = 64
LONG = 0xFF
TAIL_TAG = b"pansketch/strhh-tail"

_WORDS = sys.implementation.name != "micropython"


def level_prefix(prefix, level):
    """Hash prefix of level ``level`` (hash version 1 with a level suffix)."""
    return prefix + b"/strhh" + bytes([level])


def exact_levels(L, w):
    """Number of low levels exact-indexed: those with 256^(l+1) <= w."""
    n = 0
    while n < L and (1 << (8 * (n + 1))) <= w:
        n += 1
    return n


def encode_item(item, L):
    """The L-byte encoding of an item (module doc); None if it is not counted."""
    if isinstance(item, str):
        s = item.encode("utf-8")
    elif isinstance(item, (bytes, bytearray)):
        s = bytes(item)
    else:
        return None
    if s.find(b"\x00") >= 0:
        return None
    n = len(s)
    if n <= L:
        return s + bytes(L - n)
    t = hashlib.sha256(TAIL_TAG)
    t.update(s)
    return s[:L - 2] + bytes([LONG, t.digest()[0]])


class PrefixSketch:
    """L levels of d x w CountSketch of byte prefixes in one flat int32 array."""

    def __init__(self, L, d, w, prefix, clip, counters):
        if not (MIN_L <= L <= MAX_L) or d < 1 or w < 2 or clip < 1:
            raise ValueError("strhh needs %d <= len <= %d, d >= 1, w >= 2, clip >= 1" % (MIN_L, MAX_L))
        self.kind = "strhh"
        self.L = L
        self.levels = L
        self.d = d
        self.w = w
        self.clip = clip
        if len(counters) != L * d * w:
            raise ValueError("counters have %d cells, need %d" % (len(counters), L * d * w))
        self.counters = counters
        self.exact = exact_levels(L, w)
        self.prefixes = [level_prefix(prefix, lv) for lv in range(L)]
        self._words = struct.Struct("<%dI" % d).unpack_from if _WORDS else None

    def update(self, item, weight=1):
        """Add one item (weight clipped to [-clip, clip]); items that do not encode are ignored."""
        c = self.clip
        if weight > c:
            weight = c
        elif weight < -c:
            weight = -c
        e = encode_item(item, self.L)
        if weight and e is not None:
            for lv in range(self.L):
                self._add_node(lv, e[:lv + 1], weight)

    def update_many(self, items, weights=None):
        """Batch update; equal to :meth:`update` per event (linearity and wrap mod 2^32).

        Aggregates by encoding, then by prefix per level, so each node's hash is
        paid once per batch."""
        agg = {}
        c = self.clip
        L = self.L
        if weights is None:
            for it in items:
                e = encode_item(it, L)
                if e is not None:
                    agg[e] = agg.get(e, 0) + 1
        else:
            for it, v in zip(items, weights):
                if v > c:
                    v = c
                elif v < -c:
                    v = -c
                e = encode_item(it, L)
                if e is not None and v:
                    agg[e] = agg.get(e, 0) + v
        for lv in range(L - 1, -1, -1):
            if lv < L - 1:
                nxt = {}
                for e in agg:
                    k = e[:lv + 1]
                    nxt[k] = nxt.get(k, 0) + agg[e]
                agg.clear()
                agg = nxt
            for e in agg:
                v = agg[e]
                if v:
                    self._add_node(lv, e, v)
        agg.clear()

    def _add_node(self, lv, node, weight):
        a = self.counters
        w = self.w
        base = lv * self.d
        if lv < self.exact:
            x = 0
            for ch in node:
                x = (x << 8) | ch
            for r in range(self.d):
                i = (base + r) * w + x
                nv = a[i] + weight
                if nv > INT32_MAX or nv < INT32_MIN:
                    nv = wrap32(nv)
                a[i] = nv
            return
        stream = hashing.digest(self.prefixes[lv], node, self.d)
        neg = -weight
        if self._words is not None:
            r = 0
            for u in self._words(stream):
                i = (base + r) * w + (u & 0x3FFFFFFF) % w
                nv = a[i] + (neg if u >> 31 else weight)
                if nv > INT32_MAX or nv < INT32_MIN:
                    nv = wrap32(nv)
                a[i] = nv
                r += 1
        else:
            for r in range(self.d):
                o = 4 * r
                b3 = stream[o + 3]
                i = (base + r) * w + (stream[o] | (stream[o + 1] << 8) | (stream[o + 2] << 16) | ((b3 & 0x3F) << 24)) % w
                nv = a[i] + (neg if b3 & 0x80 else weight)
                if nv > INT32_MAX or nv < INT32_MIN:
                    nv = wrap32(nv)
                a[i] = nv
