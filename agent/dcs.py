"""Dyadic CountSketch (kind ``dcs``) over an integer domain [0, 2^b).

dp-linear-sketches.txt §4 (Private Dyadic CountSketch, after Wang et al.
2013): level l (0 <= l <= b) is a d x w CountSketch of the dyadic prefix
``x >> l`` of every reading x; level b has the single node 0 (the total).
One event touches the d rows of every one of the L = b + 1 levels, so the
recorder calibrates the noise with the ``arrays`` factor: Delta1 = L*d*c,
Delta2^2 = L*d*c^2 (agent.params, docs/PRIVACY.md).

Layout (one flat int32 array, like agent.sketch): level l, row r, column c
at index ``(l*d + r)*w + c``. Levels whose domain 2^(b-l) fits in w columns
are *exact-indexed*: node v goes to column v of every row with sign +1 (no
collisions; the host averages the d rows). The other levels hash node v
with hash version 1 under the level prefix ``prefix + b"/dcs" + byte(l)``
(item = the integer v, canonical ``"i" + decimal(v)``), column and sign as
in agent.hashing. docs/FORMAT.md §2 "Kind dcs".

Readings -> domain (the ``map`` = [scale_num, scale_den, offset] of the
config, all integers, scale > 0):

    x = clamp(floor((reading - offset) * scale_num / scale_den), 0, 2^b - 1)

computed exactly with integers from the reading's text (decimal with an
optional fraction and exponent, ``0x`` hex, dotted IPv4 ``a.b.c.d`` or a
colon/dash MAC ``aa:bb:cc:dd:ee:ff``, read as the integer they spell);
no floats, so both VMs map every reading identically. A reading that does
not parse is ignored (like a line without an item). Clipping to the domain
is the documented meaning of out-of-range readings: they count at 0 or
2^b - 1.

Privacy comes from the recorder's noise, not from this class. Counters wrap
mod 2^32 exactly as in agent.sketch; nothing is kept between calls except
the counters (the batch aggregation dict is cleared before returning).
"""

import struct
import sys

from agent import hashing
from agent.noise import wrap32

INT32_MAX = 0x7FFFFFFF
INT32_MIN = -0x80000000
MAX_B = 62
MAX_EXP = 330  # |exponent| of a decimal reading: every double, and a bound on the integers involved

_WORDS = sys.implementation.name != "micropython"


def level_prefix(prefix, level):
    """Hash prefix of dyadic level ``level`` (hash version 1 with a level suffix)."""
    return prefix + b"/dcs" + bytes([level])


def exact_from(b, w):
    """Lowest level whose 2^(b - l) nodes fit in w columns (exact-indexed from there up)."""
    lv = 0
    while (1 << (b - lv)) > w:
        lv += 1
    return lv


def _digits(s, base):
    if not s:
        return None
    v = 0
    for ch in s:
        o = ord(ch)
        if 48 <= o <= 57:
            k = o - 48
        elif base == 16 and 97 <= (o | 32) <= 102:
            k = (o | 32) - 87
        else:
            return None
        if k >= base:
            return None
        v = v * base + k
    return v


def parse_reading(item):
    """The exact value of a reading as (num, den), den > 0; None if it does not parse."""
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return (item, 1)
    if isinstance(item, (bytes, bytearray)):
        try:
            item = bytes(item).decode()
        except Exception:
            return None
    if not isinstance(item, str):
        return None
    s = item.strip()
    if not s or len(s) > 400:  # a double printed in full has at most 309 integer digits
        return None
    if ":" in s or (s.count("-") == 5 and len(s) == 17):  # MAC aa:bb:cc:dd:ee:ff (or dashes)
        parts = s.split(":") if ":" in s else s.split("-")
        v = 0
        for p in parts:
            if not (1 <= len(p) <= 2):
                return None
            k = _digits(p, 16)
            if k is None:
                return None
            v = (v << 8) | k
        return (v, 1)
    if s.count(".") == 3:  # dotted IPv4
        v = 0
        for p in s.split("."):
            k = _digits(p, 10)
            if k is None or k > 255 or len(p) > 3:
                return None
            v = (v << 8) | k
        return (v, 1)
    neg = False
    if s[0] in "+-":
        neg = s[0] == "-"
        s = s[1:]
    if s[:2] in ("0x", "0X"):
        v = _digits(s[2:], 16)
        if v is None:
            return None
        return (-v if neg else v, 1)
    exp = 0
    for e in "eE":
        if e in s:
            s, es = s.split(e, 1)
            eneg = False
            if es[:1] in ("+", "-"):
                eneg = es[0] == "-"
                es = es[1:]
            ev = _digits(es, 10)
            if ev is None or ev > MAX_EXP:
                return None
            exp = -ev if eneg else ev
            break
    if "." in s:
        ip, fp = s.split(".", 1)
    else:
        ip, fp = s, ""
    if not ip and not fp:
        return None
    iv = _digits(ip, 10) if ip else 0
    fv = _digits(fp, 10) if fp else 0
    if iv is None or fv is None:
        return None
    num = iv * 10 ** len(fp) + fv
    den = 10 ** len(fp)
    if exp > 0:
        num *= 10 ** exp
    elif exp < 0:
        den *= 10 ** (-exp)
    return (-num if neg else num, den)


def map_value(item, b, mapping):
    """Domain value x in [0, 2^b) of a reading (None if it does not parse)."""
    r = parse_reading(item)
    if r is None:
        return None
    sn, sd, off = mapping
    x = ((r[0] - off * r[1]) * sn) // (r[1] * sd)
    top = (1 << b) - 1
    if x < 0:
        return 0
    if x > top:
        return top
    return x


class DyadicSketch:
    """(b + 1) levels of d x w CountSketch in one flat int32 array."""

    def __init__(self, b, d, w, prefix, clip, mapping, counters):
        if not (1 <= b <= MAX_B) or d < 1 or w < 2 or clip < 1:
            raise ValueError("dcs needs 1 <= b <= %d, d >= 1, w >= 2, clip >= 1" % MAX_B)
        self.kind = "dcs"
        self.b = b
        self.d = d
        self.w = w
        self.clip = clip
        self.levels = b + 1
        if len(counters) != self.levels * d * w:
            raise ValueError("counters have %d cells, need %d" % (len(counters), self.levels * d * w))
        self.counters = counters
        self.map = (mapping[0], mapping[1], mapping[2])
        self.exact = exact_from(b, w)
        self.prefixes = [level_prefix(prefix, lv) for lv in range(self.exact)]
        self._words = struct.Struct("<%dI" % d).unpack_from if _WORDS else None

    def value(self, item):
        return map_value(item, self.b, self.map)

    def update(self, item, weight=1):
        """Add one reading (weight clipped to [-clip, clip]); unparseable readings are ignored."""
        c = self.clip
        if weight > c:
            weight = c
        elif weight < -c:
            weight = -c
        x = self.value(item)
        if weight and x is not None:
            for lv in range(self.levels):
                self._add_node(lv, x >> lv, weight)

    def update_many(self, items, weights=None):
        """Batch update; equal to calling :meth:`update` per event (linearity).

        Aggregates by domain value, then by node per level, so each node's
        hash is paid once per batch.
        """
        agg = {}
        c = self.clip
        if weights is None:
            for it in items:
                x = self.value(it)
                if x is not None:
                    agg[x] = agg.get(x, 0) + 1
        else:
            for it, v in zip(items, weights):
                if v > c:
                    v = c
                elif v < -c:
                    v = -c
                x = self.value(it)
                if x is not None and v:
                    agg[x] = agg.get(x, 0) + v
        for lv in range(self.levels):
            if lv:
                nxt = {}
                for x in agg:
                    k = x >> 1
                    nxt[k] = nxt.get(k, 0) + agg[x]
                agg.clear()
                agg = nxt
            for x in agg:
                v = agg[x]
                if v:
                    self._add_node(lv, x, v)
        agg.clear()

    def _add_node(self, lv, node, weight):
        a = self.counters
        w = self.w
        base = lv * self.d
        if lv >= self.exact:
            for r in range(self.d):
                i = (base + r) * w + node
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
