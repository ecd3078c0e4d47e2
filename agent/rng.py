"""Random integers from a byte source, with integer arithmetic only.

All noise in pansketch is drawn through :class:`Rng`. It turns bytes from a
*byte source* (any object with ``read(n) -> bytes``) into uniform integers by
rejection sampling, so the result is exact (no modulo bias, no floats) and
identical on CPython and MicroPython for the same bytes.

Byte sources:

* :class:`SystemSource` -- ``os.urandom``: the kernel CSPRNG on CPython, the
  hardware RNG on ESP32/ESP8266/RP2040 MicroPython ports. The default.
* :class:`DeterministicSource` -- SHA-256 in counter mode over a seed. For
  tests and reproductions only: bit-identical on both VMs.

MicroPython's ``random`` module is *not* cryptographic and is never used.
"""

import hashlib


class NoEntropyError(Exception):
    """Raised when no cryptographic byte source is available."""


class SystemSource:
    """Cryptographic bytes from ``os.urandom``.

    Raises :class:`NoEntropyError` at construction when the platform has no
    working ``os.urandom`` (a device must then refuse to start unless the
    operator explicitly opts into :class:`DeterministicSource`).
    """

    def __init__(self):
        try:
            import os

            self._urandom = os.urandom
            self._urandom(1)
        except Exception as exc:  # AttributeError, OSError, NotImplementedError
            raise NoEntropyError("no cryptographic byte source (os.urandom): %r" % (exc,))

    def read(self, n):
        return self._urandom(n)


class DeterministicSource:
    """SHA-256(seed || counter) blocks; NOT private, for tests and replays.

    ``counter`` is an 8-byte little-endian block index, so the stream is a
    pure function of the seed and identical on every VM.
    """

    def __init__(self, seed):
        if isinstance(seed, str):
            seed = seed.encode()
        elif isinstance(seed, int):
            seed = str(seed).encode()
        self._seed = bytes(seed)
        self._block = 0
        self._buf = b""
        self._pos = 0

    def read(self, n):
        out = bytearray()
        while len(out) < n:
            if self._pos >= len(self._buf):
                ctr = bytearray(8)
                b = self._block
                for i in range(8):
                    ctr[i] = b & 0xFF
                    b >>= 8
                self._buf = hashlib.sha256(self._seed + bytes(ctr)).digest()
                self._block += 1
                self._pos = 0
            take = min(n - len(out), len(self._buf) - self._pos)
            out.extend(self._buf[self._pos : self._pos + take])
            self._pos += take
        return bytes(out)


def bit_length(n):
    """``int.bit_length`` (missing on MicroPython) for n >= 0."""
    k = 0
    while n >= 0x40000000:  # stay in small-int range on 32-bit ports
        n >>= 30
        k += 30
    while n:
        n >>= 1
        k += 1
    return k


class Rng:
    """Exact uniform integers drawn from a byte source.

    Bytes are fetched in 64-byte chunks to keep the per-sample cost low; the
    consumption order is fully deterministic, so a deterministic source gives
    the same samples on every VM.
    """

    CHUNK = 64

    def __init__(self, source=None):
        self.source = source if source is not None else SystemSource()
        self._buf = b""
        self._pos = 0

    def _byte(self):
        if self._pos >= len(self._buf):
            self._buf = self.source.read(self.CHUNK)
            if len(self._buf) != self.CHUNK:
                raise NoEntropyError("byte source returned %d bytes" % len(self._buf))
            self._pos = 0
        b = self._buf[self._pos]
        self._pos += 1
        return b

    def randbits(self, k):
        """Uniform integer in [0, 2**k)."""
        v = 0
        nbytes = (k + 7) >> 3
        for _ in range(nbytes):
            v = (v << 8) | self._byte()
        extra = nbytes * 8 - k
        if extra:
            v >>= extra
        return v

    def randbelow(self, m):
        """Uniform integer in [0, m) by rejection sampling (m >= 1)."""
        if m <= 1:
            if m == 1:
                return 0
            raise ValueError("randbelow needs m >= 1")
        k = bit_length(m - 1)
        while True:
            v = self.randbits(k)
            if v < m:
                return v

    def bernoulli(self, num, den):
        """True with probability num/den (0 <= num <= den, den > 0)."""
        return self.randbelow(den) < num
