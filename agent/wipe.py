"""Wiping memory the program lets go of (MicroPython boards).

The intruder reads every byte of RAM, freed or not (docs/PRIVACY.md,
"Memory residue on boards"). MicroPython's garbage collector frees a block
by marking it free in its allocation table: the bytes stay where they were
until a later allocation reuses the block. So on a board:

* :func:`buf` zeroes, in place, the storage of a ``bytes`` object this code
  made and is done with (a digest, the bytes of an ``os.urandom`` read)
  through ``uctypes.bytearray_at`` (the object is immutable to Python, not
  to memory). Never call it on a ``str`` (MicroPython may hand back an
  interned string) or on a constant (frozen code keeps those in flash).
* :func:`obj` zeroes the body of an object after its type pointer (a
  ``hashlib.sha256`` object: its context holds the last partial block of
  input, i.e. the item, and the state words, i.e. the digest).
* :func:`heap` scrubs every free byte of the heap: a full collection, then
  the free heap allocated in zero-filled ``bytearray`` chunks with automatic
  collection off (so nothing freed in between is reused: every free block
  is taken once), then dropped and collected again. After it, freed memory
  holds zeros only. The firmware calls it at the end of every main-loop step
  that counted events or may have drawn noise (firmware/app.py).

On CPython every function here does nothing (``sys.implementation.name``
is checked once): the Pi daemon handles its own memory. ``ENABLED = False``
turns everything off: the negative control of
tests/test_firmware_unix_residue.py, never a board setting.
"""

import gc
import sys

ENABLED = True
_MP = sys.implementation.name == "micropython"
try:
    import uctypes
except ImportError:  # CPython; MicroPython builds without uctypes (then buf/obj do nothing)
    uctypes = None
if not _MP:
    uctypes = None

# Ports whose heap grows on demand from the system heap (ESP32 since MicroPython 1.21):
# an allocation that fails there adds a heap area instead of raising MemoryError, so
# heap() must never ask for more than is free (see _fill_exact).
GROWS = sys.platform == "esp32"
# The WebAssembly port (the tests' other VM, tests/mpvm.py, never a board) collects only
# between top-level calls: a fill there would only grow its heap. heap() skips it.
_SCRUB = _MP and sys.platform != "webassembly"
WORD = 4 if sys.maxsize < (1 << 32) else 8
BLOCK = 4 * WORD  # the collector's block (MICROPY_BYTES_PER_GC_BLOCK)
_ZEROS = memoryview(bytes(64)) if uctypes is not None else None
_sizes = {}  # type: dict  # type -> heap bytes of one object (measured once, see obj())


def _zero_at(addr, n):
    v = uctypes.bytearray_at(addr, n)
    if n <= 32:  # a digest, a random read: a loop makes no slice objects (garbage per draw)
        for i in range(n):
            v[i] = 0
        return
    z = _ZEROS
    i = 0
    while n - i >= 64:
        v[i:i + 64] = z
        i += 64
    if i < n:
        v[i:n] = z[0:n - i]


def buf(b):
    """Zero the storage of ``b`` (bytes or bytearray we made and no longer need) in place."""
    if ENABLED and uctypes is not None:
        n = len(b)
        if n:
            _zero_at(uctypes.addressof(b), n)


def _addr(o):
    """The address of heap object ``o``. MicroPython's id() is the object's address as an int,
    but a pointer with bit 30 set comes back as a negative small int (bit 31, resp. 63, lost,
    and known to be 0 on that path): add it back."""
    a = id(o)
    if a < 0:
        a += sys.maxsize + 1
    return a


def _addressing_ok():
    """Self-test of _addr: a bytes object's data pointer (its 4th word, py/objstr.h) read
    at _addr(b) must be what uctypes.addressof(b) says."""
    try:
        b = bytes(48)  # not interned, data outside the object
        word = uctypes.bytes_at(_addr(b) + 3 * WORD, WORD)
        v = 0
        for i in range(WORD - 1, -1, -1):
            v = (v << 8) | word[i]
        return v == uctypes.addressof(b)
    except Exception:
        return False


def size_of(make):
    """Heap bytes one object of ``make()`` takes (0 if it cannot be measured: a collection ran,
    or object addresses cannot be checked on this port)."""
    if uctypes is None or not _addressing_ok():
        return 0
    a = gc.mem_alloc()
    o = make()
    n = gc.mem_alloc() - a
    del o
    if n <= 0 or n > 1024 or n % BLOCK:
        return 0
    return n


def obj(o, n):
    """Zero the ``n`` heap bytes of object ``o`` (:func:`size_of`) after its type pointer."""
    if ENABLED and uctypes is not None and n > WORD:
        _zero_at(_addr(o) + WORD, n - WORD)


def heap():
    """Collect, then overwrite every free byte of the heap with zeros (see module doc)."""
    if not (ENABLED and _SCRUB):
        return
    gc.collect()
    gc.disable()
    try:
        if GROWS:
            _fill_exact()
        else:
            _fill_probe()
    finally:
        gc.enable()
    gc.collect()


def _fill_probe():
    """Fixed heap (Unix port, RP2040, ESP8266): chunks from the largest power of two that
    can fit down to one block, each size until it no longer fits. A dropped chunk stays
    allocated until the next collection (off meanwhile), so each chunk takes free blocks."""
    size = BLOCK
    free = gc.mem_free()
    while size * 2 <= free:
        size *= 2
    while size:
        try:
            bytearray(size)
        except MemoryError:
            size >>= 1


def _fill_exact():
    """Growing heap: only allocations that cannot fail. mem_free() counts free blocks
    exactly; a bytearray(0) is one block (its header: no data array), so as many of them
    as there are free blocks, less a margin for the loop itself, never makes the port add
    a heap area. The margin (8 blocks) is left unscrubbed."""
    for _ in range(gc.mem_free() // BLOCK - 8):
        bytearray(0)
