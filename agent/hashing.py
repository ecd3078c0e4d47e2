"""Keyed hashing of items into sketch columns and signs (hash version 1).

One SHA-256 per event (two or more only when d > 8) yields every row's
column index and sign, so an event costs one cryptographic hash whatever
the sketch depth. The construction is public and fixed:

    canonical(item) = b"s" + utf8(item)            for str
                    = b"b" + item                  for bytes/bytearray
                    = b"i" + ascii_decimal(item)   for int (e.g. b"i-42")
    prefix          = b"pansketch/h1" + bytes([len(salt)]) + salt
    block(k)        = SHA-256(prefix + canonical(item))            for k = 0
                    = SHA-256(prefix + canonical(item) + bytes([k])) for k >= 1
    stream          = block(0) + block(1) + ...   (ceil(d / 8) blocks)

Row r (0-based) reads the four bytes ``stream[4r:4r+4]`` = b0 b1 b2 b3 and

    column(r) = (b0 | b1<<8 | b2<<16 | (b3 & 0x3F)<<24) mod w
    sign(r)   = -1 if b3 & 0x80 else +1      (CountSketch only)

The 30-bit value stays a small int on 32-bit MicroPython ports (no heap
allocation) and is independent of the sign bit; the modulo bias is at most
w / 2**30.

``row_value`` / ``row_sign`` below are the reference form of that rule. The
per-event paths on a board inline it (a call per row would cost more than
the rule: pansketch.agent.sketch, pansketch.agent.levels.add_hashed, pansketch.agent.dbits.slot), and
numpy reads it for many streams at once in pansketch.agent.pi.hashvec (the Pi's batch
path and the host); tests/test_hashvec.py and the sketch tests hold every
form equal to this one. The salt is public in the threat model (docs/ARCHITECTURE.md): it fixes the
hash functions fleet-wide so that releases merge, it is not a secret.

Papers: the ideal hash functions h_r, g_r of Charikar et al. / Cormode &
Muthukrishnan as used in dp-linear-sketches.txt Algorithm 1, replaced by a
cryptographic hash as the paper suggests (Dickens et al. 2022).
"""

import hashlib

try:  # CPython's own SHA-256 (3.12+: _sha2): same bytes, a cheaper object per item than OpenSSL's on a
    # CPU without SHA instructions (pansketch.agent.pi.fastupdate picks the faster of the two for the hot paths)
    from _sha2 import sha256
except ImportError:
    try:
        from _sha256 import sha256  # CPython <= 3.11
    except ImportError:
        sha256 = hashlib.sha256  # MicroPython, and CPython builds without the builtin module

HASH_VERSION = 1
ROWS_PER_BLOCK = 8
MAX_SALT = 255


def canonical(item):
    """Canonical bytes of an item (str, bytes/bytearray or int; not bool)."""
    if isinstance(item, str):
        return b"s" + item.encode("utf-8")
    if isinstance(item, (bytes, bytearray)):
        return b"b" + bytes(item)
    if isinstance(item, bool):
        raise TypeError("bool items are ambiguous; use int or str")
    if isinstance(item, int):
        return b"i" + str(item).encode()
    raise TypeError("item must be str, bytes or int, not %s" % type(item).__name__)


def salt_prefix(salt):
    """The hash prefix for a fleet salt (bytes or str, at most 255 bytes)."""
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    salt = bytes(salt)
    if len(salt) > MAX_SALT:
        raise ValueError("salt longer than %d bytes" % MAX_SALT)
    return b"pansketch/h1" + bytes([len(salt)]) + salt


def salt_id(salt):
    """Public 16-hex-digit id of a salt, carried in releases to check merges."""
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    h = hashlib.sha256(b"pansketch/salt-id" + bytes(salt)).digest()
    out = ""
    for i in range(8):
        out += "%02x" % h[i]
    return out


def n_blocks(d):
    return (d + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK


def digest(prefix, item, d):
    """The hash stream (32 * n_blocks(d) bytes) of one item."""
    c = canonical(item)
    h = sha256(prefix)
    h.update(c)
    out = h.digest()
    for k in range(1, n_blocks(d)):
        h = sha256(prefix)
        h.update(c)
        h.update(bytes([k]))
        out += h.digest()
    return out


def digest_view(prefix, tag, view, d):
    """``digest(prefix, item, d)`` of the item whose canonical bytes are ``tag + view``
    (tag b"s": ``view`` holds the UTF-8 of a str item; b"b": a bytes item), hashed from the
    caller's buffer without a copy of the item."""
    h = sha256(prefix)
    h.update(tag)
    h.update(view)
    out = h.digest()
    for k in range(1, n_blocks(d)):
        h = sha256(prefix)
        h.update(tag)
        h.update(view)
        h.update(bytes([k]))
        out += h.digest()
    return out


def row_value(stream, r):
    """30-bit column value of row r (before ``mod w``)."""
    o = 4 * r
    return stream[o] | (stream[o + 1] << 8) | (stream[o + 2] << 16) | ((stream[o + 3] & 0x3F) << 24)


def row_sign(stream, r):
    return -1 if stream[4 * r + 3] & 0x80 else 1


def columns(prefix, item, d, w):
    """List of d (column, sign) pairs; convenience for tests and hosts."""
    s = digest(prefix, item, d)
    return [(row_value(s, r) % w, row_sign(s, r)) for r in range(d)]
