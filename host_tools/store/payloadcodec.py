"""How the store keeps a release's bytes: losslessly compressed, decoded back to the exact CBOR payload.

The wire format stays fixed width (docs/FORMAT.md: every release of a
shape is the same size whatever its counters); compression is only what
the host does with bytes it already holds. A release's counters are small
noisy integers in 32-bit cells, so most of each cell's bytes are zero or
sign bytes. The stored form (``releases.payload``, docs/HOST.md "Stored
encoding"):

    0x00  0x01  ctr_off:u32  n:u32  k:u8  offset:i32  crc32:u32   zstd frame of
          head (ctr_off bytes) + tail + k byte planes of n bytes

(little-endian; ``crc32`` covers the four fields before it, the frame
carries zstd's own checksum of its content: a damaged row is an error,
never other bytes);

* ``offset``: the median of the counters (of a strided sample); the
  counters minus it (mod 2^32), zigzagged (``(x << 1) ^ (x >> 31)``), so
  that values near the offset, of either sign, become small unsigned ones;
* byte planes: the low bytes of all n values, then the next bytes, ...,
  only the ``k`` planes the largest value needs (a plane of zeros costs
  zstd nearly nothing, but skipping it costs nothing at all);
* zstd level 1 (the ``zstandard`` package): on real releases of every kind
  it is within 1.1x of the counters' entropy (cms 1.27x; the Miller-Madow
  estimate over a device's windows pooled, docs/HOST.md "Stored encoding"
  says why that one), as small as zlib/lzma/bz2 at their best and 5 to
  100 times faster (host_tools/bench/storage.py measures them all).

A payload stored raw (written before this encoding, or one that would not
get smaller) is kept as it came: a release is a CBOR map, whose first byte
is 0xa0-0xbf, never 0x00, so the first byte tells the two apart; the empty
payload is a release pruned by retention (SQLStore.prune) and stays empty.
:func:`decode` returns the payload byte for byte as the device sent it
(its SHA-256 is the row's ``sha256``: tests/test_store_compress.py).
"""

from __future__ import annotations

import struct
import threading
import zlib
from typing import Any, Optional

import numpy as np

MAGIC = b"\x00\x01"
_HEAD = struct.Struct("<IIBi")  # ctr_off, n, k, offset
_CRC = struct.Struct("<I")
_BODY = 2 + _HEAD.size + _CRC.size  # where the zstd frame starts
LEVEL = 1
# fewer counter bytes than this are stored raw: a dbits release (d counters, ~240 bytes) would save a few
# dozen bytes of a row that costs over a kilobyte anyway, for more CPU than the rest of its write
MIN_BYTES = 1024
_SAMPLE = 16  # the offset is the median of every 16th counter: as good as the full median here, 10x cheaper

_zstd: Any
try:
    import zstandard as _zstd
except ImportError:  # pragma: no cover (a host install has it: pyproject.toml)
    _zstd = None

# a ZstdCompressor/-Decompressor is not safe for simultaneous use from two threads (a PostgreSQL store and a
# SQLite one, or a reader beside the writer): one of each per thread, made once (making one per call would
# cost a few microseconds of a ~20-40 us encode). The frame's content checksum (XXH64, under a microsecond
# for a cs d=4 w=2048 release) is what makes a damaged row an error rather than other bytes.
_tls = threading.local()


def _compressor() -> Any:
    c = getattr(_tls, "c", None)
    if c is None:
        c = _tls.c = _zstd.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=True)
    return c


def _decompressor() -> Any:
    d = getattr(_tls, "d", None)
    if d is None:
        d = _tls.d = _zstd.ZstdDecompressor()
    return d


class PayloadError(ValueError):
    """A stored payload that does not decode (a damaged row, or zstandard missing)."""


def available() -> bool:
    """Whether payloads are compressed on write (the ``zstandard`` package is importable)."""
    return _zstd is not None


def encode(payload: bytes, ctr_off: int, n: int) -> bytes:
    """The stored form of ``payload`` whose ``n`` int32 counters start at ``ctr_off`` (see the module
    docstring); ``payload`` itself when that is not smaller, its counters are fewer than
    :data:`MIN_BYTES` bytes, or zstandard is missing."""
    end = ctr_off + 4 * n
    if _zstd is None or 4 * n < MIN_BYTES or ctr_off < 0 or end > len(payload):
        return payload
    c = np.frombuffer(payload, dtype="<i4", count=n, offset=ctr_off)
    sample = c[::_SAMPLE]
    offset = int(np.partition(sample, len(sample) // 2)[len(sample) // 2])
    x = c - np.int32(offset)  # int32 arithmetic wraps mod 2^32: reversible
    sign = x >> 31
    x <<= 1  # the zigzag (x << 1) ^ (x >> 31) in place: one temporary array fewer
    x ^= sign
    u = x.view("<u4")
    top = int(u.max())
    k = 1 if top < 0x100 else 2 if top < 0x10000 else 3 if top < 0x1000000 else 4
    planes = u.view(np.uint8).reshape(n, 4)[:, :k].T.tobytes()
    body = _compressor().compress(b"".join((payload[:ctr_off], payload[end:], planes)))
    head = _HEAD.pack(ctr_off, n, k, offset)
    out = MAGIC + head + _CRC.pack(zlib.crc32(head)) + body
    return out if len(out) < len(payload) else payload


def decode(stored: bytes, max_size: Optional[int] = None) -> bytes:
    """The payload :func:`encode` was given (``stored`` itself for a raw or pruned one).

    ``max_size`` bounds the decompressed size (default: the sizes the header names, which the
    frame must match exactly)."""
    if stored[:1] != b"\x00":
        return stored
    if stored[:2] != MAGIC or len(stored) < _BODY:
        raise PayloadError("stored payload of unknown encoding %r" % (bytes(stored[:2]),))
    if zlib.crc32(stored[2:2 + _HEAD.size]) != _CRC.unpack_from(stored, 2 + _HEAD.size)[0]:
        raise PayloadError("stored payload header fails its checksum")
    if _zstd is None:
        raise PayloadError("stored payload is zstd-compressed and the zstandard package is not installed "
                           "(pip install zstandard)")
    ctr_off, n, k, offset = _HEAD.unpack_from(stored, 2)
    if not 1 <= k <= 4:
        raise PayloadError("stored payload with %d byte planes" % k)
    body = memoryview(stored)[_BODY:]
    try:
        size = _zstd.frame_content_size(body)
        limit = max_size if max_size is not None else ctr_off + k * n + (1 << 16)
        if size < 0 or size > limit:
            raise PayloadError("stored payload frame of %d bytes (at most %d)" % (size, limit))
        raw = _decompressor().decompress(body, max_output_size=size)
    except _zstd.ZstdError as exc:
        raise PayloadError("stored payload does not decompress: %s" % exc) from exc
    tail = len(raw) - ctr_off - k * n
    if tail < 0 or (max_size is not None and ctr_off + 4 * n + tail > max_size):
        raise PayloadError("stored payload frame of %d bytes, too short for its header" % len(raw))
    u = np.zeros((n, 4), dtype=np.uint8)
    u[:, :k] = np.frombuffer(raw, dtype=np.uint8, count=k * n, offset=ctr_off + tail).reshape(k, n).T
    z = u.view("<u4").ravel()
    x = (z >> 1).view("<i4") ^ -(z & 1).view("<i4")
    c = (x + np.int32(offset)).astype("<i4", copy=False)
    return raw[:ctr_off] + c.tobytes() + raw[ctr_off:ctr_off + tail]
