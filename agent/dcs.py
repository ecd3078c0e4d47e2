"""Dyadic CountSketch (kind ``dcs``) over an integer domain [0, 2^b).

dp-linear-sketches.txt §4 (Private Dyadic CountSketch, after Wang et al.
2013): level l (0 <= l <= b) is a d x w CountSketch of the dyadic prefix
``x >> l`` of every reading x; level b has the single node 0 (the total).
One event touches the d rows of every one of the L = b + 1 levels, so the
recorder calibrates the noise with the ``arrays`` factor: Delta1 = L*d*c,
Delta2^2 = L*d*c^2 (pansketch.agent.params, docs/PRIVACY.md).

Layout (one flat int32 array, like pansketch.agent.sketch): level l, row r, column c
at index ``(l*d + r)*w + c``. Levels whose domain 2^(b-l) fits in w columns
are *exact-indexed*: node v goes to column v of every row with sign +1 (no
collisions; the host averages the d rows). The other levels hash node v
with hash version 1 under the level prefix ``prefix + b"/dcs" + byte(l)``
(item = the integer v, canonical ``"i" + decimal(v)``), column and sign as
in pansketch.agent.hashing. docs/FORMAT.md §2 "Kind dcs".

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
mod 2^32 exactly as in pansketch.agent.sketch; nothing is kept between calls except
the counters (the batch aggregation dict is cleared before returning).
"""

from pansketch.agent.levels import LevelSketch

MAX_B = 62
MAX_EXP = 330  # |exponent| of a decimal reading: every double, and a bound on the integers involved


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


class DyadicSketch(LevelSketch):
    """(b + 1) levels of d x w CountSketch in one flat int32 array (pansketch.agent.levels).

    The key of a reading is its domain value x; the node of level l is
    ``x >> l``. Levels from ``exact`` up are exact-indexed (column = node).
    """

    def __init__(self, b, d, w, prefix, clip, mapping, counters):
        if not (1 <= b <= MAX_B) or d < 1 or w < 2 or clip < 1:
            raise ValueError("dcs needs 1 <= b <= %d, d >= 1, w >= 2, clip >= 1" % MAX_B)
        LevelSketch.__init__(self, "dcs", b + 1, d, w, clip, counters)
        self.b = b
        self.map = (mapping[0], mapping[1], mapping[2])
        self.exact = exact_from(b, w)
        self.prefixes = [level_prefix(prefix, lv) if lv < self.exact else None for lv in range(self.levels)]

    def value(self, item):
        return map_value(item, self.b, self.map)

    key = value

    def node(self, x, lv):
        return x >> lv
