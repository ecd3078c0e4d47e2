"""Wiping what CPython frees: the Pi daemon's defence against a read of all of its RAM.

CPython only (ctypes, glibc): **not** part of the MicroPython device core. The threat model's
intruder reads every byte of the process, freed or not, and neither CPython nor glibc zeroes
memory when it is freed: the raw lines of the last chunk, their digests, a noise draw freed by
numpy would stay readable until something reuses the bytes. Three layers close that:

1. :func:`harden` (once, at start): glibc's ``M_PERTURB`` makes ``free()`` overwrite every heap
   chunk it takes back (``malloc`` fills new ones with the complement byte), so the large
   objects CPython and numpy get from malloc -- a 1 MiB read, a chunk's bytes, the list of its
   lines, a Counter's hash table (which holds the items' hashes), numpy's arrays -- hold the
   perturb byte once freed. Not covered: glibc's per-thread cache (tcache: up to 7 freed chunks
   per size up to 1032 bytes) and numpy's own cache of small buffers (below 1024 bytes): every
   numpy array that holds noise or exact counts is zeroed explicitly (agent/bulknoise.py,
   agent/batch.py) for that reason.
2. :func:`scrub` (after a chunk is counted when nothing else waits, after a persist or a
   release): CPython's small-object allocator (pymalloc: objects up to 512 bytes, i.e. every
   line's ``bytes``, each digest, each SHA-256 object) keeps freed blocks in its pools with
   their contents. ``scrub`` asks pymalloc how many blocks are free in each size class
   (``_PyObject_DebugMallocStats``, the report ``sys._debugmallocstats()`` prints) and
   allocates that many zero-filled objects of that size, then frees them: every free block and
   every unused pool then holds zeros. A pool keeps what its earlier size class left wherever
   its current class has not carved a block yet, so unused pools are carved whole, first, and
   nothing else is allocated while the fillers are (:func:`scrub`); the tail of each pool past
   its class's last block, which no allocation reaches, is zeroed directly (:func:`_zero_tails`).
   It costs about one allocation per free block (~4 ms after a 32,768-line chunk), so it runs
   when the daemon is about to wait, not between two chunks of a busy input (the next chunk's
   objects take the same blocks meanwhile).
3. :func:`wipe_bytes`: a ``bytes`` object the agent made and alone references (a read, a
   chunk) is zeroed in place with ``ctypes.memset`` just before its last reference goes.

``PANSKETCH_TEST_NO_WIPE=1`` turns all three off (and the explicit wipes of the noise and
count arrays that check :data:`ON`): the negative control of tests/test_memory_residue.py,
which must then find the residue. It gives no privacy; the daemon logs a warning.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections import deque
from itertools import repeat, starmap
from operator import neg
from typing import Any, Iterator, Optional

ENV_OFF = "PANSKETCH_TEST_NO_WIPE"
ON = not os.environ.get(ENV_OFF)

# A bytes object is its header (refcount, type, size, cached hash: 32 bytes on 64-bit) followed
# by its data and a NUL: sys.getsizeof(b"") is the header plus that NUL.
_DATA = sys.getsizeof(b"") - 1
_HASH = _DATA - ctypes.sizeof(ctypes.c_ssize_t)  # ob_shash: -1 = not computed yet
_M_PERTURB = -6  # mallopt parameters (malloc.h)
_PERTURB_BYTE = 0x5A  # free() fills with this, malloc() with its complement (0xA5)
_libc: Optional[Any] = None
_stats: Optional[Any] = None
# Unused pools are carved into 480-byte blocks: 34 of them cover a 16 KiB pool from its 48-byte
# header to 16 bytes before its end (the end only ever holds 16-byte blocks). pymalloc's largest
# class, 512, would leave the last 464 bytes of each pool, where the objects of the pool's
# earlier size class stay (seven freed 23-byte lines in a 64-byte pool).
_CARVE = 480
_CARVE_BLOCKS = 34
# Blocks filled beyond each class's free count: the plan's own objects (a tuple, a bound method,
# an iterator or two and an int per class: 64, 48 and 32 bytes; the plan list in the larger
# classes) take free blocks after the counts were read, and a fill that stops short leaves the
# last free blocks in pymalloc's order, the same ones in every pass, unfilled. Going past the
# end takes a pool from a new arena (the unused pools were carved first): zero pages.
_MARGIN_SMALL = 256
_MARGIN = 16
# pymalloc's pools (CPython 3.10+, 64-bit): 16 KiB, aligned, a 48-byte header, then blocks of
# one size class up to the last whole block; the rest (16336 mod size bytes) is the pool's tail.
_POOL = 16384
_POOL_HEAD = 48


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def harden() -> bool:
    """Ask glibc to overwrite every chunk it frees (M_PERTURB). False where that is not
    available (another libc, the wipes turned off): the explicit wipes still hold."""
    if not ON:
        return False
    try:
        return bool(_c().mallopt(_M_PERTURB, _PERTURB_BYTE))
    except (AttributeError, OSError):
        return False


def wipe_bytes(b: Any) -> None:
    """Zero a ``bytes`` object's data (and its cached hash) in place.

    Only for an object the caller made and alone holds (a read, a chunk it built): every other
    holder would see zeros. Objects of length 0 or 1 are never touched: CPython shares one
    object per byte value (and b""), so zeroing one would change that value everywhere; their
    contents are the same in every process anyway. Writing into a bytes object's own buffer is
    safe because CPython never moves it and reads it only through this object; the size and
    type fields are left as they are, so the object stays valid until it is freed."""
    if not ON or type(b) is not bytes or len(b) < 2:
        return
    addr = id(b)  # CPython: the object's address
    ctypes.memset(addr + _DATA, 0, len(b))
    ctypes.c_ssize_t.from_address(addr + _HASH).value = -1


def _free_blocks() -> Optional[tuple[list[tuple[int, int]], int]]:
    """pymalloc's (block size, free blocks) per size class and its unused pools, read from its
    own statistics (the text of ``sys._debugmallocstats()``, written into memory)."""
    global _stats
    try:
        if _stats is None:
            libc = _c()
            libc.open_memstream.restype = ctypes.c_void_p
            libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
            libc.fclose.argtypes = [ctypes.c_void_p]
            libc.free.argtypes = [ctypes.c_void_p]
            fn = ctypes.pythonapi._PyObject_DebugMallocStats
            fn.argtypes = [ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _stats = (libc, fn)
        libc, fn = _stats
        buf = ctypes.c_char_p()
        size = ctypes.c_size_t()
        fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not fp:
            return None
        try:
            fn(fp)
        finally:
            libc.fclose(fp)
        text = ctypes.string_at(buf, size.value).decode("ascii", "replace")
        libc.free(ctypes.cast(buf, ctypes.c_void_p))
    except (AttributeError, OSError, ValueError):
        return None
    classes: list[tuple[int, int]] = []
    unused = 0
    for line in text.splitlines():
        f = line.split()
        if len(f) == 5 and f[0].isdigit():
            classes.append((int(f[1]), int(f[4])))
        elif "unused pools" in line and f and f[0].isdigit():
            unused = int(f[0])
    return classes, unused


def _filler(size: int, k: int) -> Iterator[Any]:
    """k new objects that each fill one block of pymalloc size class ``size``, every byte written."""
    if size == 16:
        return starmap(object, repeat((), k))  # an object(): its refcount and type, 16 bytes
    if size == 32:
        return map(neg, repeat(1 << 40, k))  # a new two-digit int: header and digits, 32 bytes
    return map(bytes, repeat(size - _DATA - 1, k))  # size - 33 data bytes + NUL: the block, zeroed (calloc)


def _tail_offsets(fills: list[tuple[int, deque]]) -> Optional[dict[int, int]]:
    """Where the unused tail of a pool of each filled class begins, once this build's layout is
    confirmed from the fillers themselves: every filler's block must lie at _POOL_HEAD + k * size
    in a _POOL-aligned pool (pymalloc of CPython 3.10 and later, 64-bit). None when it does not
    (another layout: the tails are then left, as before)."""
    tails = {}
    for size, dq in fills:
        for x in (dq[0], dq[-1]) if dq else ():
            off = id(x) & (_POOL - 1)
            if off < _POOL_HEAD or (off - _POOL_HEAD) % size or off + size > _POOL:
                return None
        tails[size] = _POOL_HEAD + (_POOL - _POOL_HEAD) // size * size
    return tails


def _zero_tails(fills: list[tuple[int, deque]]) -> int:
    """Zero the tail of every pool that holds a filler: the bytes past the last block of the
    pool's size class, which no allocation of that class ever reaches and which keep what the
    pool's previous class left there (a freed 23-byte line in the last 80 bytes of a pool of
    128-byte blocks). Safe while the fillers are alive: a pool with a live block keeps its size
    class, and pymalloc never reads or writes past its last block. Returns the pools zeroed."""
    tails = _tail_offsets(fills)
    if tails is None:
        return 0
    n = 0
    mask = ~(_POOL - 1)
    for size, dq in fills:
        start = tails[size]
        if start >= _POOL:
            continue
        for pool in {a & mask for a in map(id, dq)}:
            ctypes.memset(pool + start, 0, _POOL - start)
            n += 1
    return n


def _fill_once(tails: bool) -> Optional[int]:
    got = _free_blocks()
    if got is None:
        return None
    classes, unused = got
    plan: list[tuple[int, deque, Iterator[Any]]] = []
    n = 0
    if unused:  # first, every unused pool, carved into zeroed blocks from header to end
        k = unused * _CARVE_BLOCKS
        plan.append((_CARVE, deque(), _filler(_CARVE, k)))
        n += k
    for size, free in classes:
        k = free + (_MARGIN_SMALL if size <= 64 else _MARGIN)
        plan.append((size, deque(), _filler(size, k)))
        n += k
    for _size, dq, it in plan:
        dq.extend(it)
    fills = [(size, dq) for size, dq, _it in plan]
    del plan
    if tails:
        _zero_tails(fills)
    del fills
    return n


def scrub() -> int:
    """Overwrite every free pymalloc block and unused pool with zeros (see the module's text).
    Returns the number of blocks filled (0 when turned off or unavailable).

    The fillers are built as iterators first and drained by deques (whose blocks are larger
    than pymalloc's), and the unused pools are carved first, so that little else is allocated
    while they fill. Little is not nothing: the few objects that plan needs are made after the
    counts were read, and one of a size class with no free block takes an unused pool and
    carves it block by block (the rest of that pool keeps the freed lines of its previous
    class), while the class's count then falls short by that pool's blocks, leaving as many
    free blocks unfilled elsewhere (measured: ~180 lines left after 40,000; each class is
    filled a margin past its count for the same reason, see _MARGIN). So it runs twice:
    the second pass reads fresh counts just after the first freed its fillers, when every size
    class has free (zeroed) blocks, so its own objects take no pool, and it fills what the
    first pass missed (about twice the cost). The second pass also zeroes the tails of the
    pools its fillers are in (every pool with a free block): only then are all of them held,
    and a pool the first pass zeroed either is among them or was emptied by freeing the first
    pass's fillers and carved whole by the second. ~4 ms after a 32,768-line chunk."""
    if not ON:
        return 0
    n = 0
    for last in (False, True):
        got = _fill_once(last)
        if got is None:
            break
        n += got
    return n


SWAPS = "/proc/swaps"


def swap_devices(path: Optional[str] = None) -> list[str]:
    """The swap areas in use that are not RAM (``/proc/swaps``; zram is compressed RAM, read
    with the rest of it). Swapped-out pages of the agent -- raw lines, a chunk's counts, a
    noise draw being added -- would stay on that disk or SD card after the agent has wiped
    them in RAM, as readable as stale flash blocks. [] where there is no such file."""
    try:
        with open(path or SWAPS) as f:
            lines = f.read().splitlines()[1:]  # a header line, then one line per area
    except OSError:
        return []
    out = []
    for line in lines:
        name = line.split()[0] if line.split() else ""
        if name and not os.path.basename(name).startswith("zram"):
            out.append(name)
    return out
