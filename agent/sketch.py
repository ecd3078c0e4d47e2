"""Count-Min and CountSketch over one flat array of signed 32-bit counters.

Layout: row r, column c lives at index ``r * w + c`` of an ``array('i')``
of d*w cells (4 bytes each on CPython and on 32-bit MicroPython ports).
Update is dp-linear-sketches.txt Algorithm 1 (add g_r(x) * v to
C[r, h_r(x)]; g = +1 for Count-Min) and query is Algorithm 2 (median for
CountSketch, minimum for Count-Min). Privacy comes from the noise the
recorder puts into the array (pansketch.agent.recorder), not from this class.

Event weights are integers clipped to [-clip, clip] (docs/ARCHITECTURE.md: one event
moves each touched cell by at most ``clip``). Counters are residues mod
2**32 held as int32 (two's complement): a cell whose exact value leaves
[-2**31, 2**31) wraps, explicitly and identically on both VMs. Wrapping is
a group operation, so the sketch stays exactly linear and no event is ever
refused because of the counts (a refusal would make one event's presence
decide whether a later event counts: docs/PRIVACY.md, "Counters wrap").
"""

import array
import hashlib
import struct
import sys

from pansketch.agent import hashing, wipe
from pansketch.agent.noise import wrap32

# CPython reads the d row words with one struct call (2x faster); MicroPython
# reads bytes, because a 32-bit word would be a heap-allocated big int there.
_WORDS = sys.implementation.name != "micropython"
_WORDS4 = struct.Struct("<4I").unpack_from if _WORDS else None  # d = 4, CPython's unrolled update
# d = 4 and w a power of two up to 2**16 (the default shapes): w divides 2**30, so row r's column is
# its word's low 16 bits & (w - 1); "H" values are one-digit ints, the byte "B" after them is the
# word's top byte (sign: bit 7), a cached small int.
_LOW4 = struct.Struct("<HxxHxxHxxHxx16x").unpack if _WORDS else None  # a whole 32-byte digest
_LOWSIGN4 = struct.Struct("<HxBHxBHxBHxB16x").unpack if _WORDS else None

INT32_MAX = 0x7FFFFFFF
INT32_MIN = -0x80000000
KINDS = ("cms", "cs")


MAX_CELLS = 1 << 26  # 256 MiB of counters: far beyond any device


def new_counters(n):
    """A zeroed array('i') of n cells, checked to be 4 bytes per cell."""
    if n < 1:
        raise ValueError("a sketch needs at least one cell")
    if n > MAX_CELLS:  # bytes(4*n) would fail obscurely (TypeError on MicroPython)
        raise MemoryError("%d cells do not fit in memory (limit %d)" % (n, MAX_CELLS))
    a = array.array("i", bytes(4 * n))
    if len(a) != n:
        raise RuntimeError("array('i') is not 32-bit on this platform")
    return a


def totals(items, weights, clip):
    """{item: sum of its clipped weights} of one batch (weights None: all 1).

    The batch's exact per-item totals: callers clear the dict as soon as the
    batch is counted (docs/PRIVACY.md, "The intruder's view").
    """
    agg = {}
    if weights is None:
        get = agg.get
        for x in items:
            agg[x] = get(x, 0) + 1
    else:
        for x, v in zip(items, weights):
            if v > clip:
                v = clip
            elif v < -clip:
                v = -clip
            agg[x] = agg.get(x, 0) + v
    return agg


if _WORDS:
    def _rebinding(store):
        """A property kept in ``store`` whose setter re-points the per-event closure (Sketch._bind)."""
        def get(self):
            return self.__dict__[store]

        def put(self, a):
            self.__dict__[store] = a
            if "_cur" in self.__dict__:
                self._bind()

        return property(get, put)


class Sketch:
    """A d x w linear sketch of int32 counters.

    ``prefix`` is :func:`pansketch.agent.hashing.salt_prefix` of the fleet salt.
    ``counters`` may be passed to reuse a preallocated array.
    """

    def __init__(self, kind, d, w, prefix, clip=1, counters=None):
        if kind not in KINDS:
            raise ValueError("sketch kind must be 'cms' or 'cs', not %r" % (kind,))
        if d < 1 or w < 2:
            raise ValueError("sketch needs d >= 1 and w >= 2")
        if clip < 1:
            raise ValueError("clip must be a positive integer")
        self.kind = kind
        self.signed = kind == "cs"
        self.d = d
        self.w = w
        self.clip = clip
        self.prefix = prefix
        if counters is None:
            counters = new_counters(d * w)
        elif len(counters) != d * w:
            raise ValueError("counters have %d cells, need %d" % (len(counters), d * w))
        self.counters = counters
        # tree mode (agent/tree.py): every event goes into each of these
        # arrays (the open node of every level); None = ``counters`` only
        self.arrays = None
        self._words = struct.Struct("<%dI" % d).unpack_from if _WORDS else None
        # Text items with d <= 8 (one SHA-256 block) take a shortcut with the
        # same bytes as hashing.digest (hash version 1): the hash state of
        # prefix + b"s" is kept (public: the salt is public), CPython copies
        # it (hashing.sha256: CPython's builtin SHA-256 where it has one;
        # pansketch.agent.pi.fastupdate swaps in OpenSSL's where that is faster), MicroPython (no copy())
        # hashes the str directly (no encode).
        self._ps = prefix + b"s" if d <= hashing.ROWS_PER_BLOCK else None
        self._pb = prefix + b"b" if d <= hashing.ROWS_PER_BLOCK else None  # update_view of bytes items
        # heap bytes of one SHA-256 object, for wiping its context after each event (MicroPython)
        self._shsz = 0 if _WORDS else wipe.size_of(hashlib.sha256)
        self._hs = hashing.sha256(self._ps) if (_WORDS and self._ps is not None) else None
        self._d4 = d == 4  # CPython's update unrolls the default depth
        # d = 4 and w a power of two <= 2**16: w - 1 (the unrolled update masks 16-bit row values), else 0
        self._mask = w - 1 if (d == 4 and w & (w - 1) == 0 and w <= 0x10000) else 0
        if self._hs is not None and self._mask:  # CPython only (_hs): the per-event closure
            self._cur = []
            self._bind()

    if _WORDS:
        # CPython: ``update`` is a closure (agent/pi/fastupdate.py) over memoryview rows
        # of ``counters``; these properties refill its rows whenever the sketch
        # is pointed at another array (the recorder swaps arrays at each
        # release; tree mode sets ``arrays``). MicroPython (boards) keeps plain
        # attributes and the method: none of this exists there.
        counters = _rebinding("_counters")
        arrays = _rebinding("_arrays")

        def _bind(self):
            from pansketch.agent.pi import fastupdate

            fastupdate.bind(self, _LOW4, _LOWSIGN4, _WORDS4)

    # -- updates -------------------------------------------------------
    def clip_weight(self, weight):
        c = self.clip
        if weight > c:
            return c
        if weight < -c:
            return -c
        return weight

    def digest(self, item):
        """``hashing.digest(prefix, item, d)``, with the text shortcut when it applies."""
        if self._ps is not None and type(item) is str:
            if self._hs is not None:
                h = self._hs.copy()
                h.update(item.encode())
            else:
                h = hashlib.sha256(self._ps)
                h.update(item)
            return h.digest()
        return hashing.digest(self.prefix, item, self.d)

    def update(self, item, weight=1):
        """Add one event (weight clipped to [-clip, clip])."""
        if weight != 1:
            weight = self.clip_weight(weight)
            if not weight:
                return
        hs = self._hs
        if hs is not None and type(item) is str and self.arrays is None:
            # CPython, text item: digest and add_stream inlined (the hot path)
            h = hs.copy()
            h.update(item.encode())
            a = self.counters
            w = self.w
            m = self._mask
            # d = 4 unrolled (the default shape). ``r`` counts the rows already added: a cell
            # leaving int32 raises OverflowError before it is stored, and _wrap_rows goes on from it.
            if m:  # w a power of two <= 2**16: 16-bit row values (see _LOW4)
                dg = h.digest()
                r = 0
                try:
                    if self.signed:
                        c0, s0, c1, s1, c2, s2, c3, s3 = _LOWSIGN4(dg)
                        a[c0 & m] += -weight if s0 > 127 else weight
                        r = 1
                        a[w + (c1 & m)] += -weight if s1 > 127 else weight
                        r = 2
                        a[w + w + (c2 & m)] += -weight if s2 > 127 else weight
                        r = 3
                        a[3 * w + (c3 & m)] += -weight if s3 > 127 else weight
                    else:
                        c0, c1, c2, c3 = _LOW4(dg)
                        a[c0 & m] += weight
                        r = 1
                        a[w + (c1 & m)] += weight
                        r = 2
                        a[w + w + (c2 & m)] += weight
                        r = 3
                        a[3 * w + (c3 & m)] += weight
                except OverflowError:
                    self._wrap_rows(_WORDS4(dg), r, weight)
                return
            if self._d4:  # any other w: the 30-bit row words
                u0, u1, u2, u3 = _WORDS4(h.digest())
                r = 0
                try:
                    if self.signed:
                        a[(u0 & 0x3FFFFFFF) % w] += -weight if u0 >> 31 else weight
                        r = 1
                        a[w + (u1 & 0x3FFFFFFF) % w] += -weight if u1 >> 31 else weight
                        r = 2
                        a[w + w + (u2 & 0x3FFFFFFF) % w] += -weight if u2 >> 31 else weight
                        r = 3
                        a[3 * w + (u3 & 0x3FFFFFFF) % w] += -weight if u3 >> 31 else weight
                    else:
                        a[(u0 & 0x3FFFFFFF) % w] += weight
                        r = 1
                        a[w + (u1 & 0x3FFFFFFF) % w] += weight
                        r = 2
                        a[w + w + (u2 & 0x3FFFFFFF) % w] += weight
                        r = 3
                        a[3 * w + (u3 & 0x3FFFFFFF) % w] += weight
                except OverflowError:
                    self._wrap_rows((u0, u1, u2, u3), r, weight)
                return
            i = 0
            if self.signed:
                for u in self._words(h.digest()):
                    v = -weight if u >> 31 else weight
                    try:
                        a[i + (u & 0x3FFFFFFF) % w] += v
                    except OverflowError:
                        j = i + (u & 0x3FFFFFFF) % w
                        a[j] = wrap32(a[j] + v)
                    i += w
            else:
                for u in self._words(h.digest()):
                    try:
                        a[i + (u & 0x3FFFFFFF) % w] += weight
                    except OverflowError:
                        j = i + (u & 0x3FFFFFFF) % w
                        a[j] = wrap32(a[j] + weight)
                    i += w
            return
        self.add_stream(self.digest(item), weight)

    def update_view(self, text, view, weight=1):
        """Add one event whose item is the bytes in ``view`` (a memoryview of the caller's
        preallocated buffer): a text item (``text``: the UTF-8 bytes of a str the caller has
        checked) or a bytes item. The same columns as ``update(str(view))`` / ``update(bytes(view))``.

        On MicroPython no object holding the item is made: the view is hashed where it lies,
        and the SHA-256 object (its context holds the last input block) and the digest are
        zeroed in place once counted (agent/wipe.py), so once the caller wipes its buffer the
        event has left RAM but for the counters. With d > 8 the stream's blocks are joined
        (garbage the firmware's heap scrub clears). CPython builds the item and calls update.
        """
        if _WORDS:
            raw = bytes(view)
            self.update(raw.decode("utf-8") if text else raw, weight)
            return
        if weight != 1:
            weight = self.clip_weight(weight)
            if not weight:
                return
        pre = self._ps if text else self._pb
        if pre is not None:
            h = hashlib.sha256(pre)
            h.update(view)
            dg = h.digest()
            wipe.obj(h, self._shsz)
        else:
            dg = hashing.digest_view(self.prefix, b"s" if text else b"b", view, self.d)
        self.add_stream(dg, weight)
        wipe.buf(dg)

    def _wrap_rows(self, words, r, weight):
        """The unrolled update from row ``r`` on, wrapping mod 2**32 (a cell left int32: rare)."""
        a = self.counters
        w = self.w
        for k in range(r, len(words)):
            u = words[k]
            j = k * w + (u & 0x3FFFFFFF) % w
            a[j] = wrap32(a[j] + (-weight if (self.signed and u >> 31) else weight))

    def add_stream(self, stream, weight):
        """Add ``weight`` (already clipped or pre-aggregated) for a hash stream.

        Allocation-free on MicroPython for small weights: every value stays
        a small int. One pass, nothing kept: the sketch holds no record of
        which cells the last event touched (an intruder reads every byte).
        """
        if self.arrays is not None:
            self._add_stream_all(stream, weight)
            return
        a = self.counters
        w = self.w
        neg = -weight
        i = 0
        if self._words is not None:
            # CPython: array('i') refuses a value outside int32 with
            # OverflowError (zero-cost try): wrap that row and go on.
            if self.signed:
                for u in self._words(stream):
                    try:
                        a[i + (u & 0x3FFFFFFF) % w] += neg if u >> 31 else weight
                    except OverflowError:
                        j = i + (u & 0x3FFFFFFF) % w
                        a[j] = wrap32(a[j] + (neg if u >> 31 else weight))
                    i += w
            else:
                for u in self._words(stream):
                    try:
                        a[i + (u & 0x3FFFFFFF) % w] += weight
                    except OverflowError:
                        j = i + (u & 0x3FFFFFFF) % w
                        a[j] = wrap32(a[j] + weight)
                    i += w
        else:
            # MicroPython: storing into array('i') keeps the low 32 bits,
            # which is wrap32 (tests/test_mp_core.py checks it), so no
            # comparison is needed; values stay small ints, nothing allocates.
            signed = self.signed
            o = 0
            for _ in range(self.d):
                b3 = stream[o + 3]
                j = i + (stream[o] | (stream[o + 1] << 8) | (stream[o + 2] << 16) | ((b3 & 0x3F) << 24)) % w
                a[j] = a[j] + (neg if (signed and b3 & 0x80) else weight)
                o += 4
                i += w

    def _add_stream_all(self, stream, weight):
        """add_stream into every array of ``self.arrays``: the cell index and
        sign of each row are computed once and applied to all L arrays."""
        arrays = self.arrays
        w = self.w
        signed = self.signed
        for r in range(self.d):
            o = 4 * r
            b3 = stream[o + 3]
            i = r * w + (stream[o] | (stream[o + 1] << 8) | (stream[o + 2] << 16) | ((b3 & 0x3F) << 24)) % w
            v = -weight if (signed and b3 & 0x80) else weight
            for a in arrays:
                nv = a[i] + v
                if nv > INT32_MAX or nv < INT32_MIN:
                    nv = wrap32(nv)
                a[i] = nv

    def update_many(self, items, weights=None):
        """Batch update: clip each event, then hash each distinct item once.

        Equal to ``for x, v in zip(items, weights): update(x, v)`` (the
        sketch is linear), and much faster on skewed streams because the
        SHA-256 is paid once per distinct item, not once per event.
        """
        agg = totals(items, weights, self.clip)
        for x in agg:
            v = agg[x]
            if v:
                self.add_stream(self.digest(x), v)
        agg.clear()  # the batch's exact per-item totals must not outlive the call

    def merge(self, other):
        """Add another sketch with identical parameters (linearity, mod 2**32)."""
        if (other.kind, other.d, other.w, other.prefix) != (self.kind, self.d, self.w, self.prefix):
            raise ValueError("cannot merge sketches with different kind, shape or salt")
        a = self.counters
        b = other.counters
        for i in range(len(a)):
            a[i] = wrap32(a[i] + b[i])

    # -- queries (Algorithm 2) -----------------------------------------
    def row_estimates(self, item):
        s = hashing.digest(self.prefix, item, self.d)
        out = []
        for r in range(self.d):
            col = hashing.row_value(s, r) % self.w
            v = self.counters[r * self.w + col]
            if self.signed:
                v *= hashing.row_sign(s, r)
            out.append(v)
        return out

    def estimate(self, item):
        """Raw (un-offset) estimate: min for Count-Min, median for CountSketch."""
        rows = self.row_estimates(item)
        if not self.signed:
            return min(rows)
        rows.sort()
        n = len(rows)
        if n & 1:
            return rows[n // 2]
        return (rows[n // 2 - 1] + rows[n // 2]) / 2
