"""A bounded CBOR reader for untrusted release bytes: checks well-formedness at the byte level first.

docs/FORMAT.md: a release is definite-length CBOR with no tags and no
floats, a map of at most a few dozen keys whose values are integers (at
most 64 bits), text, one byte string and short integer lists. This module
reads exactly that subset in one pass over the bytes, and refuses anything
else *before* building an object from it:

* indefinite lengths, reserved additional information (28-30, in every
  major type), the break byte, a two-byte simple value below 32 (RFC 8949
  3.3: not well-formed), a length larger than the bytes left, truncation,
  trailing bytes, nesting deeper than ``max_depth`` (the top-level item is
  at depth 1), more than ``max_items`` data items (a tag's head counts as
  one), arrays longer than ``max_array`` or maps with more than ``max_map``
  pairs, invalid UTF-8, duplicate or non-text map keys (a tagged or float
  key is not text): code ``cbor``;
* tags (major type 6, among them 28/29 value sharing, 30 rational
  numbers, 2/3 bignums) and floats and simple values other than
  false/true/null (major type 7): code ``type``, but only once the whole
  message has passed the checks above (docs/FORMAT.md section 2.4 checks
  ``cbor`` before ``type``): the reader notes the first such item, reads
  on through it (a tag's content too) and reports it at the end.

Every check is against the remaining length before anything is read or
allocated, and the number of data items is capped, so the work is at most
``O(max_items)`` steps plus one copy of each string: a hostile message of
any shape costs microseconds (tests/test_hostile.py measures it). No CBOR
object decoder ever sees the bytes (pansketch.host_tools.ingest.decode builds the release
map from this module alone), so neither value sharing (the "billion
laughs" of tags 28/29) nor huge rationals (tag 30, quadratic gcd) can
reach one.

:func:`peek` reads the top-level ``dev`` and ``seq`` of a message that is
refused, as far as its bytes are well formed, with the same bounds (the
aggregator acknowledges a refused release by its seq; docs/FORMAT.md
section 7).
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable, NamedTuple, Optional, Sequence

MAX_DEPTH = 4  # the top-level item is at depth 1: a release is map -> list -> int, depth 3
MAX_ITEMS = 256  # a release has about 60 data items (25 keys, 25 values, a few short lists)
MAX_ARRAY = 16  # the longest list in a release is dcs's 'map' (3 items)
MAX_MAP = 64  # a release map has 25 keys (v2, kind dcs)


class ScanError(Exception):
    """Not the CBOR subset a release uses: ``code`` is ``cbor`` or ``type``, ``reason`` one line."""

    def __init__(self, code: str, reason: str) -> None:
        Exception.__init__(self, "%s: %s" % (code, reason))
        self.code = code
        self.reason = reason


_SIMPLE = {20: False, 21: True, 22: None}
_BREAK = object()
_TYPED = object()  # what a tag, float or other simple value reads as: the scan ends in code 'type' anyway


class _Reader:
    __slots__ = ("buf", "pos", "items", "max_items", "max_depth", "max_array", "max_map", "top", "partial",
                 "canonical", "offsets", "view", "typed")

    def __init__(self, buf: bytes, max_depth: int, max_items: int, max_array: int, max_map: int,
                 view: Optional[memoryview] = None) -> None:
        self.buf = buf
        self.view = view  # byte strings as slices of this (no copy), when set
        self.canonical = True  # every head in shortest form and map keys in encoded-byte order (so far)
        self.offsets: dict[str, int] = {}  # top-level key -> offset of the content of its byte-string value
        self.pos = 0
        self.items = 0
        self.max_items = max_items
        self.max_depth = max_depth
        self.max_array = max_array
        self.max_map = max_map
        self.top: Optional[dict[str, Any]] = None  # the top-level map as read so far (for peek)
        self.partial = False
        self.typed: Optional[str] = None  # the first tag/float/simple value (code 'type', reported after the scan)

    def item(self, depth: int) -> Any:
        # one function, locals only: this runs ~60 times per release (the hot path of validation).
        # ``depth``: the item's nesting level, 1 for the top-level item
        if depth > self.max_depth:
            raise ScanError("cbor", "nested deeper than %d levels" % self.max_depth)
        self.items += 1
        if self.items > self.max_items:
            raise ScanError("cbor", "more than %d data items (a release has fewer than 100)" % self.max_items)
        buf = self.buf
        pos = self.pos
        size = len(buf)
        if pos >= size:
            raise ScanError("cbor", "truncated at byte %d" % pos)
        ib = buf[pos]
        major, ai = ib >> 5, ib & 31
        if major == 7:
            if ai in _SIMPLE:
                self.pos = pos + 1
                return _SIMPLE[ai]
            return self._major7(pos, ai)
        pos += 1
        if ai < 24:
            n = ai
        elif ai < 28:
            hk = 1 << (ai - 24)
            if pos + hk > size:
                raise ScanError("cbor", "truncated: head at byte %d needs %d more bytes" % (pos - 1, hk))
            n = int.from_bytes(buf[pos:pos + hk], "big")
            pos += hk
            if n < _SHORTEST[ai]:
                self.canonical = False  # a longer head than pansketch.agent.cbor writes
        elif ai == 31:
            raise ScanError("cbor", "indefinite length or break at byte %d (releases use definite lengths only)"
                            % (pos - 1))
        else:
            raise ScanError("cbor", "reserved additional information %d at byte %d" % (ai, pos - 1))
        if major == 6:
            # a tag: its content is read (well-formed and within the limits, else 'cbor'), at the tag's
            # depth; the head counted as one data item above
            if self.typed is None:
                self.typed = "CBOR tag %d at byte %d (releases carry no tags)" % (n, self.pos)
            self.pos = pos
            self.item(depth)
            return _TYPED
        if major == 0:
            self.pos = pos
            return n
        if major == 1:
            self.pos = pos
            return -1 - n
        left = size - pos
        if major == 2 or major == 3:
            if n > left:
                raise ScanError("cbor", "string of %d bytes at byte %d but only %d bytes left" % (n, pos, left))
            self.pos = pos + n
            if major == 2:
                sv = self.view
                return sv[pos:pos + n] if sv is not None else buf[pos:pos + n]
            try:
                return str(buf[pos:pos + n], "utf-8")
            except UnicodeDecodeError:
                raise ScanError("cbor", "text string at byte %d is not valid UTF-8" % pos)
        self.pos = pos
        if major == 4:
            if n > self.max_array or n > left:
                raise ScanError("cbor", "array of %d items at byte %d (at most %d in a release, %d bytes left)"
                                % (n, pos, self.max_array, left))
            return [self.item(depth + 1) for _ in range(n)]
        # major 5: map
        if n > self.max_map or 2 * n > left:
            raise ScanError("cbor", "map of %d pairs at byte %d (at most %d in a release, %d bytes left)"
                            % (n, pos, self.max_map, left))
        m: dict[str, Any] = {}
        if depth == 1:
            self.top = m
        item = self.item
        pl, pk = 0, ""  # the previous key's encoded length and text
        inline = depth + 1 <= self.max_depth
        # the read position and the item count live in locals in this loop (written back around each
        # call of item() and at the end): attribute writes per pair were a large part of a release's cost
        max_items = self.max_items
        pos, items = self.pos, self.items
        for _ in range(n):
            at = pos
            ib = buf[at] if inline and at < size else -1
            if 0x60 <= ib < 0x78:
                # a short text key (all a release has), read here rather than by a call per key:
                # the same checks and messages as item()
                items += 1
                if items > max_items:
                    raise ScanError("cbor", "more than %d data items (a release has fewer than 100)" % max_items)
                kn = ib - 0x60
                if kn > size - at - 1:
                    raise ScanError("cbor", "string of %d bytes at byte %d but only %d bytes left"
                                    % (kn, at + 1, size - at - 1))
                try:
                    k = str(buf[at + 1:at + 1 + kn], "utf-8")
                except UnicodeDecodeError:
                    raise ScanError("cbor", "text string at byte %d is not valid UTF-8" % (at + 1))
                pos = at + 1 + kn
            else:
                self.pos, self.items = pos, items
                k = item(depth + 1)
                pos, items = self.pos, self.items
            if type(k) is not str:
                raise ScanError("cbor", "map key at byte %d is not a text string" % at)
            if k in m:
                raise ScanError("cbor", "duplicate map key %r at byte %d" % (k[:40], at))
            # pansketch.agent.cbor sorts keys by their encoded bytes; with shortest heads (else not canonical anyway)
            # that is by encoded length, then by text (UTF-8 byte order is code point order)
            kl = pos - at
            if kl < pl or (kl == pl and k <= pk):
                self.canonical = False
            pl, pk = kl, k
            at = pos
            ib = buf[at] if inline and at < size else -1
            if 0 <= ib < 0x1C or 0x60 <= ib < 0x78:
                # an unsigned integer or a short text string (most values of a release): read here, with
                # the same checks and messages as item()
                items += 1
                if items > max_items:
                    raise ScanError("cbor", "more than %d data items (a release has fewer than 100)" % max_items)
                if ib < 24:
                    pos = at + 1
                    m[k] = ib
                elif ib < 0x1C:
                    hk = 1 << (ib - 24)
                    if at + 1 + hk > size:
                        raise ScanError("cbor", "truncated: head at byte %d needs %d more bytes" % (at, hk))
                    val = int.from_bytes(buf[at + 1:at + 1 + hk], "big")
                    if val < _SHORTEST[ib]:
                        self.canonical = False
                    pos = at + 1 + hk
                    m[k] = val
                else:
                    kn = ib - 0x60
                    if kn > size - at - 1:
                        raise ScanError("cbor", "string of %d bytes at byte %d but only %d bytes left"
                                        % (kn, at + 1, size - at - 1))
                    try:
                        m[k] = str(buf[at + 1:at + 1 + kn], "utf-8")
                    except UnicodeDecodeError:
                        raise ScanError("cbor", "text string at byte %d is not valid UTF-8" % (at + 1))
                    pos = at + 1 + kn
                continue
            if 0x40 <= ib < 0x5C:
                # a byte string (the counters): read here, with the same checks and messages as item()
                items += 1
                if items > max_items:
                    raise ScanError("cbor", "more than %d data items (a release has fewer than 100)" % max_items)
                p = at + 1
                if ib < 0x58:
                    kn = ib - 0x40
                else:
                    hk = 1 << (ib - 0x58)
                    if p + hk > size:
                        raise ScanError("cbor", "truncated: head at byte %d needs %d more bytes" % (at, hk))
                    kn = int.from_bytes(buf[p:p + hk], "big")
                    p += hk
                    if kn < _SHORTEST[ib - 0x40]:
                        self.canonical = False
                if kn > size - p:
                    raise ScanError("cbor", "string of %d bytes at byte %d but only %d bytes left"
                                    % (kn, p, size - p))
                pos = p + kn
                sv = self.view
                m[k] = sv[p:p + kn] if sv is not None else buf[p:p + kn]
                if depth == 1:
                    self.offsets[k] = p  # where the value's content starts
                continue
            if 0x80 <= ib < 0x98 and depth + 2 <= self.max_depth:
                # a short array (budget, nint, nout, map): its unsigned integers read here, anything
                # else by item(); the same checks and messages as item()
                items += 1
                if items > max_items:
                    raise ScanError("cbor", "more than %d data items (a release has fewer than 100)" % max_items)
                kn = ib - 0x80
                p = at + 1
                if kn > self.max_array or kn > size - p:
                    raise ScanError("cbor", "array of %d items at byte %d (at most %d in a release, %d bytes left)"
                                    % (kn, p, self.max_array, size - p))
                lst: list[Any] = []
                for _ in range(kn):
                    eb = buf[p] if p < size else -1
                    if 0 <= eb < 0x1C:
                        items += 1
                        if items > max_items:
                            raise ScanError("cbor", "more than %d data items (a release has fewer than 100)"
                                            % max_items)
                        if eb < 24:
                            lst.append(eb)
                            p += 1
                        else:
                            hk = 1 << (eb - 24)
                            if p + 1 + hk > size:
                                raise ScanError("cbor", "truncated: head at byte %d needs %d more bytes" % (p, hk))
                            val = int.from_bytes(buf[p + 1:p + 1 + hk], "big")
                            if val < _SHORTEST[eb]:
                                self.canonical = False
                            lst.append(val)
                            p += 1 + hk
                    else:
                        self.pos, self.items = p, items
                        lst.append(item(depth + 2))
                        p, items = self.pos, self.items
                pos = p
                m[k] = lst
                continue
            self.pos, self.items = pos, items
            v = m[k] = item(depth + 1)
            pos, items = self.pos, self.items
            if depth == 1 and (type(v) is bytes or type(v) is memoryview):
                self.offsets[k] = pos - len(v)  # where the value's content starts
        self.pos, self.items = pos, items
        return m

    def _major7(self, pos: int, ai: int) -> Any:
        """A major-type-7 item other than false/true/null at ``pos``: a float or simple value is noted for
        code ``type`` and skipped; an ill-formed head (RFC 8949 3.3: additional information 28-30, a
        two-byte simple value below 32, the break byte outside an indefinite item) is ``cbor`` at once."""
        if ai == 31:
            raise ScanError("cbor", "break byte at %d without an indefinite-length item" % pos)
        if ai >= 28:
            raise ScanError("cbor", "reserved additional information %d at byte %d" % (ai, pos))
        size = len(self.buf)
        if ai < 24:
            what, end = "simple value %d" % ai, pos + 1
        else:
            hk = 1 << (ai - 24)
            end = pos + 1 + hk
            if end > size:
                raise ScanError("cbor", "truncated: head at byte %d needs %d more bytes" % (pos, hk))
            if ai == 24:
                sv = self.buf[pos + 1]
                if sv < 32:
                    raise ScanError("cbor", "two-byte simple value %d at byte %d (not well-formed: below 32)"
                                    % (sv, pos))
                what = "simple value %d" % sv
            else:
                what = "floating-point value"
        if self.typed is None:
            self.typed = "%s at byte %d (releases carry integers, text, bytes, arrays and maps only)" % (what, pos)
        self.pos = end
        return _TYPED


_SHORTEST = {24: 24, 25: 1 << 8, 26: 1 << 16, 27: 1 << 32}  # smallest n that needs a head of this size


def loads(buf: bytes, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS, max_array: int = MAX_ARRAY,
          max_map: int = MAX_MAP) -> Any:
    """The value ``buf`` encodes, if it is one well-formed item of the release subset (else :class:`ScanError`)."""
    return scan(buf, max_depth, max_items, max_array, max_map).obj


class Scan(NamedTuple):
    """What :func:`scan` read."""

    obj: Any
    canonical: bool  # the bytes are pansketch.agent.cbor's encoding of obj
    offsets: dict[str, int]  # top-level map key -> offset of the content of its byte-string value
    # read by a Template with ``same`` fields: (the template, the encoded bytes of those fields' values).
    # Two maps with equal ``same`` have those fields equal in value and type; None from other readers
    same: Any = None


def key_table(keys: Any) -> dict[bytes, tuple[int, str]]:
    """For :func:`scan`'s ``known``: each key's encoded bytes -> (its rank in pansketch.agent.cbor's key order, the key).
    Keys are short text (at most 23 UTF-8 bytes), as a release's are."""
    enc = sorted((bytes([0x60 + len(k.encode())]) + k.encode(), k) for k in set(keys))
    if any(len(kb) > 24 for kb, _k in enc):
        raise ValueError("key_table: keys of at most 23 bytes")
    return {kb: (i, k) for i, (kb, k) in enumerate(enc)}


def _scan_known(buf: bytes, view: Optional[memoryview], known: dict[bytes, tuple[int, str]]) -> Optional[Scan]:
    """The common case in one tight pass: a canonical map of ``known`` keys whose values are unsigned
    integers, short text, byte strings or short arrays of unsigned integers (every release a device writes).

    Returns what :func:`scan` returns with the default limits, or None for anything else (then the
    general reader reads it, with its checks and messages): an unknown, repeated or out-of-order key,
    another kind of value, a head longer than needed, invalid UTF-8, bytes missing or left over. Within
    what it accepts the other limits cannot be reached (at most MAX_MAP keys, arrays of at most MAX_ARRAY
    integers: depth 3; the items are counted). tests/test_host_decode.py checks both readers agree.
    """
    size = len(buf)
    mv = type(buf) is not bytes  # a view into a receive buffer: keys looked up as bytes (views do not hash)
    ib = buf[0]
    if 0xA0 <= ib < 0xB8:
        n, pos = ib - 0xA0, 1
    elif ib == 0xB8 and size > 1:
        n, pos = buf[1], 2
        if n < 24:
            return None  # not the shortest head
    else:
        return None
    if n > MAX_MAP or 2 * n > size - pos:
        return None
    m: dict[str, Any] = {}
    offsets: dict[str, int] = {}
    last = -1
    items = 1 + 2 * n  # the map, its keys and values (array elements added below)
    for _ in range(n):
        if pos >= size:
            return None
        kh = buf[pos]
        if not 0x61 <= kh < 0x78:
            return None
        e = pos + kh - 0x5F
        r = known.get(bytes(buf[pos:e]) if mv else buf[pos:e])
        if r is None or r[0] <= last or e >= size:
            return None
        last = r[0]
        k = r[1]
        ib = buf[e]
        if ib < 24:
            m[k] = ib
            pos = e + 1
        elif ib < 0x1C:
            hk = 1 << (ib - 24)
            if e + 1 + hk > size:
                return None
            v = int.from_bytes(buf[e + 1:e + 1 + hk], "big")
            if v < _SHORTEST[ib]:
                return None
            m[k] = v
            pos = e + 1 + hk
        elif 0x60 <= ib < 0x78:
            pos = e + 1 + ib - 0x60
            if pos > size:
                return None
            try:
                m[k] = str(buf[e + 1:pos], "utf-8")
            except UnicodeDecodeError:
                return None
        elif 0x40 <= ib < 0x5C:
            p = e + 1
            if ib < 0x58:
                bn = ib - 0x40
            else:
                hk = 1 << (ib - 0x58)
                if p + hk > size:
                    return None
                bn = int.from_bytes(buf[p:p + hk], "big")
                p += hk
                if bn < _SHORTEST[ib - 0x40]:
                    return None
            pos = p + bn
            if pos > size:
                return None
            m[k] = view[p:pos] if view is not None else buf[p:pos]
            offsets[k] = p
        elif 0x80 <= ib < 0x80 + min(24, MAX_ARRAY + 1):
            p = e + 1
            lst = []
            for _ in range(ib - 0x80):
                eb = buf[p] if p < size else 0xFF
                if eb < 24:
                    lst.append(eb)
                    p += 1
                elif eb < 0x1C:
                    hk = 1 << (eb - 24)
                    if p + 1 + hk > size:
                        return None
                    v = int.from_bytes(buf[p + 1:p + 1 + hk], "big")
                    if v < _SHORTEST[eb]:
                        return None
                    lst.append(v)
                    p += 1 + hk
                else:
                    return None
            m[k] = lst
            items += len(lst)
            pos = p
        else:
            return None
    if pos != size or items > MAX_ITEMS:
        return None
    return Scan(m, True, offsets)


# the value patterns of a Template: canonical heads only (a longer head than needed does not match)
_RX_UINT = (rb"([\x00-\x17]|\x18[\x18-\xff]|\x19[\x01-\xff][\x00-\xff]"
            rb"|\x1a(?:[\x01-\xff][\x00-\xff]{3}|\x00[\x01-\xff][\x00-\xff]{2})"
            rb"|\x1b(?:[\x01-\xff][\x00-\xff]{7}|\x00[\x01-\xff][\x00-\xff]{6}|\x00\x00[\x01-\xff][\x00-\xff]{5}"
            rb"|\x00\x00\x00[\x01-\xff][\x00-\xff]{4}))")
_RX_TEXT = b"(" + b"|".join(re.escape(bytes([0x60 + i])) + (b"[\\x00-\\xff]{%d}" % i if i else b"")
                            for i in range(24)) + b")"  # short text, head and bytes
_RX_BYTES_HEAD = (rb"([\x40-\x57]|\x58[\x18-\xff]|\x59[\x01-\xff][\x00-\xff]"
                  rb"|\x5a(?:[\x01-\xff][\x00-\xff]{3}|\x00[\x01-\xff][\x00-\xff]{2}))")  # up to 4 GB
_RX_VALUE = {"u": _RX_UINT, "t": _RX_TEXT, "u2": b"\x82" + _RX_UINT * 2, "u3": b"\x83" + _RX_UINT * 3}
_HEAD_BASE = (0, 0, 0x18 << 8, 0x19 << 16, 0, 0x1A << 32, 0, 0, 0, 0x1B << 64)  # by head length: value = int - base


class Template:
    """The release subset's commonest shape as one regular expression: a map of exactly ``fields`` (key,
    type) with every head canonical, matched by the ``re`` engine in one pass instead of a Python step
    per byte (a release's 24 keys cost :func:`_scan_known` about 1 us each).

    Types: ``u`` unsigned integer (at most 64 bits), ``t`` text of at most 23 UTF-8 bytes, ``u2``/``u3``
    an array of 2/3 unsigned integers, ``b`` a byte string (at most one field: the pattern before it
    ends at its head, its length is read, and the pattern after it is matched past its bytes, to the
    end of the message). :meth:`read` returns what :func:`scan` returns for such bytes, or None for
    anything else (another key set or order, another type, a longer head than needed, invalid UTF-8,
    bytes missing or left over): then the other readers read it, with their checks and messages. The
    patterns have no nested repetition, so a match costs time linear in the bytes it looks at.
    tests/test_host_decode.py checks it agrees with the general reader.
    """

    def __init__(self, fields: Sequence[tuple[str, str]], same: Sequence[str] = ()) -> None:
        """``same``: fields (not the byte string) whose encoded values :meth:`read` returns as
        :attr:`Scan.same`, for a caller that remembers what it concluded from them."""
        keys = {k: bytes([0x60 + len(k.encode())]) + k.encode() for k, _t in fields}
        if len(keys) != len(fields) or any(len(kb) > 24 for kb in keys.values()) or len(fields) > MAX_MAP:
            raise ValueError("Template: distinct keys of at most 23 bytes, at most %d of them" % MAX_MAP)
        types = dict(fields)
        if sum(t == "b" for t in types.values()) > 1 or not set(types.values()) <= set(_RX_VALUE) | {"b"}:
            raise ValueError("Template: types u, t, u2, u3 and at most one b")
        order = sorted(types, key=lambda k: keys[k])  # pansketch.agent.cbor's key order: by encoded bytes
        n = len(order)
        parts: list[list[bytes]] = [[re.escape(bytes([0xA0 + n]) if n < 24 else bytes([0xB8, n]))], []]
        conv: list[list[str]] = [[], []]
        groups = [0, 0]
        side = 0
        self.bytes_key: Optional[str] = None
        where: dict[str, tuple[int, int, int]] = {}  # field -> (side, first group, groups)
        for k in order:
            t = types[k]
            parts[side].append(re.escape(keys[k]))
            if t == "b":
                parts[side].append(_RX_BYTES_HEAD)
                self.bytes_key = k
                side = 1
                continue
            parts[side].append(_RX_VALUE[t])
            gi = groups[side]
            where[k] = (side, gi, 1 if t in ("u", "t") else int(t[1]))
            g = "gs" if side == 0 else "hs"
            if t == "t":
                conv[side].append("%r: str(%s[%d][1:], 'utf-8')" % (k, g, gi))
            elif t == "u":
                conv[side].append("%r: _fb(%s[%d], 'big') - _B[len(%s[%d])]" % (k, g, gi, g, gi))
            else:
                conv[side].append("%r: [%s]" % (k, ", ".join("_fb(%s[%d], 'big') - _B[len(%s[%d])]"
                                                             % (g, gi + j, g, gi + j) for j in range(int(t[1])))))
            groups[side] += 1 if t in ("u", "t") else int(t[1])
        self._pre = re.compile(b"".join(parts[0]) + (b"" if self.bytes_key else rb"\Z"), re.DOTALL)
        self._post = re.compile(b"".join(parts[1]) + rb"\Z", re.DOTALL)
        self.items = 1 + 2 * n + sum(int(t[1]) for t in types.values() if t in ("u2", "u3"))
        if self.items > MAX_ITEMS:
            raise ValueError("Template: more than %d data items" % MAX_ITEMS)
        # one generated function per template builds the map from the match groups (straight-line code:
        # a loop over the fields with a branch per type cost twice as much)
        src = "def conv(gs, hs):\n    return {%s}\n" % ", ".join(conv[0] + conv[1])
        env: dict[str, Any] = {"_fb": int.from_bytes, "_B": _HEAD_BASE}
        exec(compile(src, "<cborscan.Template>", "exec"), env)
        self._conv = env["conv"]
        self.map_head = n
        if not set(same) <= set(where):
            raise ValueError("Template: same names fields of the template other than the byte string")
        # the groups of the ``same`` fields in gs + hs (the byte string's head is gs's last group)
        pre_groups = groups[0] + (1 if self.bytes_key else 0)
        idx = [(0 if where[k][0] == 0 else pre_groups) + where[k][1] + j for k in same for j in range(where[k][2])]
        self._same: Optional[Callable[[tuple[Any, ...]], Any]] = operator.itemgetter(*idx) if idx else None

    def read(self, buf: Any, view: Optional[memoryview]) -> Optional[Scan]:
        m = self._pre.match(buf)
        if m is None:
            return None
        start = m.end()
        offsets: dict[str, int] = {}
        hs: tuple[Any, ...] = ()
        bk = self.bytes_key
        gs = m.groups()
        if bk is not None:
            h = gs[-1]
            bn = h[0] - 0x40 if len(h) == 1 else int.from_bytes(h[1:], "big")
            if start + bn > len(buf):
                return None
            m2 = self._post.match(buf, start + bn)
            if m2 is None:
                return None
            hs = m2.groups()
        try:
            obj = self._conv(gs, hs)
        except UnicodeDecodeError:
            return None
        if bk is not None:
            obj[bk] = view[start:start + bn] if view is not None else buf[start:start + bn]
            offsets[bk] = start
        same = self._same
        return Scan(obj, True, offsets, (self, same(gs + hs)) if same is not None else None)


def scan(buf: Any, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS, max_array: int = MAX_ARRAY,
         max_map: int = MAX_MAP, views: bool = False, known: Optional[dict[bytes, tuple[int, str]]] = None,
         templates: Optional[dict[int, "Template"]] = None) -> Scan:
    """:func:`loads`, and whether ``buf`` is the deterministic encoding agent/cbor.py writes.

    Deterministic means every head in shortest form and the keys of every
    map in increasing order of their encoded bytes (RFC 8949 4.2.1, what
    pansketch.agent.cbor writes; definite lengths, no floats and no tags are required
    anyway). For the values this reader returns (int, text, bytes, lists,
    maps of text keys, false/true/null) that is exactly
    ``pansketch.agent.cbor.dumps(obj) == buf``, found in the same pass instead of by
    re-encoding (tests/test_host_decode.py checks the two agree).
    ``buf`` may be bytes or a memoryview (bytes received into a shared
    buffer); ``views``: byte strings come back as memoryview slices of
    ``buf`` (the 16 kB of counters are not copied). ``known``
    (:func:`key_table` of the release's field names): try the one-pass
    reader of the common case first (:func:`_scan_known`; with the
    default limits only), the general reader when it declines.
    ``templates`` (map size -> :class:`Template`; with ``known`` and the
    default limits only): before that, the template for the map's size.
    """
    if isinstance(buf, memoryview):
        if buf.format != "B" or buf.ndim != 1:
            buf = buf.cast("B")
    elif not isinstance(buf, bytes):
        buf = bytes(buf)
    if not len(buf):
        raise ScanError("cbor", "empty payload")
    view = (buf if isinstance(buf, memoryview) else memoryview(buf)) if views else None
    if known is not None and (max_depth, max_items, max_array, max_map) == (MAX_DEPTH, MAX_ITEMS, MAX_ARRAY, MAX_MAP):
        if templates is not None:
            ib = buf[0]
            t = templates.get(ib - 0xA0 if 0xA0 <= ib < 0xB8 else (buf[1] if ib == 0xB8 and len(buf) > 1 else -1))
            if t is not None:
                fast = t.read(buf, view)
                if fast is not None:
                    return fast
        fast = _scan_known(buf, view, known)
        if fast is not None:
            return fast
    r = _Reader(buf, max_depth, max_items, max_array, max_map, view=view)
    obj = r.item(1)
    if r.pos != len(buf):
        raise ScanError("cbor", "%d trailing bytes after the release map" % (len(buf) - r.pos))
    if r.typed is not None:  # well-formed, within the limits, but with a tag or float: 'cbor' comes first
        raise ScanError("type", r.typed)
    return Scan(obj, r.canonical, r.offsets)


def peek(buf: Optional[bytes]) -> tuple[Optional[str], Optional[int]]:
    """(``dev``, ``seq``) of the top-level map, read as far as the bytes are well formed (None each if not there).

    Bounded exactly like :func:`loads` (the same reader, stopped at the
    first error): safe on any bytes, and on a stored prefix of them.
    """
    if not buf:
        return None, None
    r = _Reader(bytes(buf), MAX_DEPTH, MAX_ITEMS, MAX_ARRAY, MAX_MAP)
    try:
        r.item(1)
    except ScanError:
        pass
    m = r.top or {}
    dev, seq = m.get("dev"), m.get("seq")
    return (dev if type(dev) is str else None,
            seq if type(seq) is int and 0 <= seq < 1 << 63 else None)
