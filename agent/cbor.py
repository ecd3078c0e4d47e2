"""Deterministic CBOR encoder (RFC 8949 section 4.2.1) for releases.

Why not micropython-lib's ``cbor2`` on the board: it writes a map's keys in
dict iteration order, and MicroPython dicts are unordered hash tables, so
the same release could come out as different bytes on CPython and on a
board. Releases must be byte-identical on both VMs (tests compare them), so
the device encodes with this ~80-line deterministic encoder: shortest-form
heads, definite lengths, map keys sorted by their encoded bytes, and only
the types the board's cbor2 can also handle (int, bytes, str, bool, None,
list, dict). No tags and no floats. The host decodes with the real
``cbor2`` library.

Objects supporting the buffer protocol that are ``array.array`` instances
are written as byte strings of their raw (little-endian) memory, which is
how the counters go out without a copy.
"""

import array


def _head(major, n):
    m = major << 5
    if n < 24:
        return bytes([m | n])
    if n < 0x100:
        return bytes([m | 24, n])
    if n < 0x10000:
        return bytes([m | 25, n >> 8, n & 0xFF])
    if n < 0x100000000:
        return bytes([m | 26, (n >> 24) & 0xFF, (n >> 16) & 0xFF, (n >> 8) & 0xFF, n & 0xFF])
    if n < 0x10000000000000000:
        out = bytearray(9)
        out[0] = m | 27
        for i in range(8):
            out[8 - i] = n & 0xFF
            n >>= 8
        return bytes(out)
    raise ValueError("integer too large for CBOR without tags")


def encode_to(obj, write):
    """Write the deterministic CBOR encoding of ``obj`` through ``write``."""
    if obj is None:
        write(b"\xf6")
    elif obj is True:
        write(b"\xf5")
    elif obj is False:
        write(b"\xf4")
    elif isinstance(obj, int):
        if obj >= 0:
            write(_head(0, obj))
        else:
            write(_head(1, -1 - obj))
    elif isinstance(obj, (bytes, bytearray)):
        write(_head(2, len(obj)))
        write(obj)
    elif isinstance(obj, array.array):
        # Only array('i') (int32 counters) is used; MicroPython arrays have
        # no .typecode to check, so the sketch module guarantees it.
        write(_head(2, len(obj) * 4))
        write(obj)
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        write(_head(3, len(b)))
        write(b)
    elif isinstance(obj, (list, tuple)):
        write(_head(4, len(obj)))
        for x in obj:
            encode_to(x, write)
    elif isinstance(obj, dict):
        keys = []
        for k in obj:
            keys.append((dumps(k), k))
        keys.sort(key=_first)
        write(_head(5, len(keys)))
        for kb, k in keys:
            write(kb)
            encode_to(obj[k], write)
    else:
        raise TypeError("cannot CBOR-encode %s (floats and tags are not allowed)" % type(obj).__name__)


def _first(pair):
    return pair[0]


def dumps(obj):
    """Deterministic CBOR encoding of ``obj`` as bytes."""
    out = bytearray()
    encode_to(obj, out.extend)
    return bytes(out)
