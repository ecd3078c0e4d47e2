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
prefix ``prefix + b"/strhh" + byte(l)``, column and sign as pansketch.agent.hashing.

One event touches the d rows of all L levels: the recorder calibrates the
noise with arrays = L (Delta1 = L*d*c, Delta2^2 = L*d*c^2; pansketch.agent.params,
docs/PRIVACY.md "Heavy-hitter strings"). Every event does the same work (L hashes)
whatever the item, so the time per event does not depend on the data.
Counters wrap mod 2^32 exactly as in pansketch.agent.sketch.
"""

import hashlib

from pansketch.agent.levels import LevelSketch

MIN_L = 3
MAX_L = 64
LONG = 0xFF
TAIL_TAG = b"pansketch/strhh-tail"


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


class PrefixSketch(LevelSketch):
    """L levels of d x w CountSketch of byte prefixes in one flat int32 array (pansketch.agent.levels).

    The key of an item is its L-byte encoding e; the node of level l is the
    prefix ``e[:l + 1]``. Levels below ``exact`` are exact-indexed (column =
    the prefix as a big-endian integer).
    """

    def __init__(self, L, d, w, prefix, clip, counters):
        if not (MIN_L <= L <= MAX_L) or d < 1 or w < 2 or clip < 1:
            raise ValueError("strhh needs %d <= len <= %d, d >= 1, w >= 2, clip >= 1" % (MIN_L, MAX_L))
        LevelSketch.__init__(self, "strhh", L, d, w, clip, counters)
        self.L = L
        self.exact = exact_levels(L, w)
        self.prefixes = [None if lv < self.exact else level_prefix(prefix, lv) for lv in range(L)]

    def key(self, item):
        return encode_item(item, self.L)

    def node(self, e, lv):
        return e[:lv + 1]

    def column(self, node):
        x = 0
        for ch in node:
            x = (x << 8) | ch
        return x
