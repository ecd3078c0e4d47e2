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

from pansketch.agent import wipe


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

    fresh = True  # read() returns a new object each time: Rng wipes it once copied (agent/wipe.py)

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

    fresh = True  # read() returns a new object (bytes(out))

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


# CPython has int.bit_length; MicroPython does not (same values either way)
_BIT_LENGTH = hasattr(0, "bit_length")


class Rng:
    """Exact uniform integers drawn from a byte source.

    Pan-privacy (docs/PRIVACY.md, "The intruder's view"): the byte buffer is
    part of what an intruder reads, so the Rng never keeps randomness from
    one noise sample to the next. Bytes are fetched into one preallocated
    ``bytearray`` of ``CHUNK`` bytes *for the sample being drawn*; when the
    sample is done, :meth:`wipe` zeroes the buffer in place and drops the
    unconsumed tail (the samplers in :mod:`pansketch.agent.noise` call it in a
    ``finally``). Unconsumed bytes would predict the next draw (e.g. the
    output noise of cell 0 at the next release), and consumed ones would
    reveal the draws just made (e.g. the fresh noise added at a persist).

    The consumption order is fully deterministic, so a deterministic source
    gives the same samples on every VM. The ``bytes`` object each
    ``source.read`` returns is copied into the buffer; on MicroPython it is
    then zeroed in place (agent/wipe.py) when the source says its reads are
    new objects (``fresh``: os.urandom, DeterministicSource, and wrappers that
    pass it on), so the freed heap does not keep the bytes a draw came from.
    (On CPython freed memory is the Pi daemon's concern, docs/PRIVACY.md.)
    """

    CHUNK = 32  # bytes per read: one read covers most dlap/dgauss samples

    def __init__(self, source=None):
        self.source = source if source is not None else SystemSource()
        self._buf = bytearray(self.CHUNK)
        self._zero = bytes(self.CHUNK)
        self._pos = self.CHUNK  # == CHUNK: nothing buffered
        # a source's reads are new objects we may wipe (never a constant: frozen code keeps those in flash)
        self._fresh = getattr(self.source, "fresh", False) is True

    def _fill(self):
        data = self.source.read(self.CHUNK)
        if len(data) != self.CHUNK:
            raise NoEntropyError("byte source returned %d bytes" % len(data))
        self._buf[:] = data
        if self._fresh:
            wipe.buf(data)

    def _byte(self):
        if self._pos >= self.CHUNK:
            self._fill()
            self._pos = 0
        b = self._buf[self._pos]
        self._pos += 1
        return b

    def wipe(self):
        """Zero the byte buffer in place and forget its tail (end of a sample)."""
        self._buf[:] = self._zero
        self._pos = self.CHUNK

    def randbits(self, k):
        """Uniform integer in [0, 2**k)."""
        nbytes = (k + 7) >> 3
        buf = self._buf
        pos = self._pos
        v = 0
        for _ in range(nbytes):
            if pos >= self.CHUNK:
                self._fill()
                pos = 0
            v = (v << 8) | buf[pos]
            pos += 1
        self._pos = pos
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
        k = (m - 1).bit_length() if _BIT_LENGTH else bit_length(m - 1)
        buf = self._buf
        chunk = self.CHUNK
        if k <= 8:  # one byte per try: the common case in the samplers
            shift = 8 - k
            while True:
                pos = self._pos
                if pos >= chunk:
                    self._fill()
                    pos = 0
                self._pos = pos + 1
                v = buf[pos] >> shift
                if v < m:
                    return v
        nbytes = (k + 7) >> 3
        extra = nbytes * 8 - k
        while True:
            pos = self._pos
            v = 0
            for _ in range(nbytes):
                if pos >= chunk:
                    self._fill()
                    pos = 0
                v = (v << 8) | buf[pos]
                pos += 1
            self._pos = pos
            if extra:
                v >>= extra
            if v < m:
                return v

    def bernoulli(self, num, den):
        """True with probability num/den (0 <= num <= den, den > 0)."""
        return self.randbelow(den) < num
