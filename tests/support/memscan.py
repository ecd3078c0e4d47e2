"""Read a process's memory the way the intruder does, and search it (Linux, CPython tests).

The threat model's intruder reads every byte of the device's RAM once, freed or not. On Linux
the closest a test gets is every readable mapping of every agent process: ``/proc/PID/maps``
lists them, ``/proc/PID/mem`` reads them (root, or a ptrace-permitted parent). Each process is
stopped with SIGSTOP while it is read, so the snapshot is one instant, and continued afterwards.

    with stopped([pid, *children(pid)]):
        snap = [Snapshot.of(p) for p in pids]
    snap.items(rb"secret-mac-[0-9a-f]{12}")     # raw items found (a set of bytes)
    snap.find_words(needles)                    # which uint32 sequences occur (4-byte aligned)

Freed memory is readable exactly when the allocator kept the pages mapped: the snapshot sees
what the intruder sees, nothing more (the kernel's own buffers -- pipes, sockets, the page
cache -- are not in any mapping; docs/PRIVACY.md "Memory residue" says what that leaves out).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np


def can_read_memory() -> Optional[str]:
    """None if this process may read other processes' memory, else why not."""
    if not os.path.exists("/proc/self/mem"):
        return "no /proc/PID/mem (not Linux)"
    if os.geteuid() != 0:
        try:
            with open("/proc/sys/kernel/yama/ptrace_scope") as f:
                if f.read().strip() not in ("0",):
                    return "not root and ptrace_scope forbids reading a child's memory"
        except OSError:
            pass
    return None


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (a count worker of ``feed --jobs``)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir("/proc/%d/task" % p)
        except OSError:
            continue
        for t in tids:
            try:
                with open("/proc/%d/task/%s/children" % (p, t)) as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _state(pid: int) -> str:
    """The state letters of every thread of ``pid`` ('T'/'t': stopped)."""
    states = ""
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/stat" % (pid, t)) as f:
                states += f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            pass
    return states


@contextlib.contextmanager
def stopped(pids: Sequence[int], timeout: float = 5.0) -> Iterator[None]:
    """SIGSTOP every process (all its threads), wait until each thread is stopped, then
    SIGCONT them on exit: what is read inside is one instant of all of them."""
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        for p in pids:
            while any(c not in "Tt" for c in _state(p)):
                if time.monotonic() > deadline:
                    raise TimeoutError("process %d did not stop" % p)
                time.sleep(0.002)
        yield
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass


class Snapshot:
    """Every readable byte of one process, region by region (start address, bytes)."""

    def __init__(self, pid: int, regions: list[tuple[int, bytes, str]]) -> None:
        self.pid = pid
        self.regions = regions

    @classmethod
    def of(cls, pid: int) -> "Snapshot":
        regions: list[tuple[int, bytes, str]] = []
        with open("/proc/%d/maps" % pid) as f:
            maps = f.read().splitlines()
        fd = os.open("/proc/%d/mem" % pid, os.O_RDONLY)
        try:
            pm: Optional[int] = os.open("/proc/%d/pagemap" % pid, os.O_RDONLY)
        except OSError:
            pm = None
        try:
            for line in maps:
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                perms = parts[1]
                name = parts[5] if len(parts) > 5 else ""
                if perms[0] != "r" or name in ("[vvar]", "[vsyscall]", "[vvar_vclock]"):
                    continue
                # A library's code and read-only data never hold what the program computed;
                # everything writable (heap, stacks, anonymous maps, .data/.bss) is read.
                if name.startswith("/") and "w" not in perms:
                    continue
                present = _present(pm, lo, hi)
                if present is None:
                    regions.append((lo, _read(fd, lo, hi), name))
                    continue
                idx = np.flatnonzero(present)  # runs of pages in RAM: never-written ones read as zeros
                if len(idx):
                    for run in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1):
                        a, b = lo + int(run[0]) * PAGE, lo + (int(run[-1]) + 1) * PAGE
                        regions.append((a, _read(fd, a, b), name))
        finally:
            os.close(fd)
            if pm is not None:
                os.close(pm)
        return cls(pid, regions)

    def size(self) -> int:
        return sum(len(b) for _a, b, _n in self.regions)


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _present(pm: Optional[int], lo: int, hi: int) -> Optional[np.ndarray]:
    """Which pages of [lo, hi) are in RAM or swap (``/proc/PID/pagemap`` bits 63 and 62). A
    page that is neither was never written: it reads as zeros, so it holds nothing to find.
    None where pagemap cannot be read (then every page is read)."""
    if pm is None:
        return None
    n = (hi - lo) // PAGE
    try:
        raw = os.pread(pm, 8 * n, 8 * (lo // PAGE))
    except OSError:
        return None
    if len(raw) != 8 * n:
        return None
    ent = np.frombuffer(raw, dtype="<u8")
    return (ent >> np.uint64(62)) != 0


def _read(fd: int, lo: int, hi: int, present: Optional[np.ndarray] = None) -> bytes:
    """One region (its never-written pages as zeros, unread); pages that cannot be read (guard
    pages) come back as zeros too."""
    if present is not None and not present.all():
        out = bytearray(hi - lo)
        idx = np.flatnonzero(present)
        if len(idx):  # runs of present pages, one read each
            cuts = np.flatnonzero(np.diff(idx) != 1) + 1
            for run in np.split(idx, cuts):
                a, b = lo + int(run[0]) * PAGE, lo + (int(run[-1]) + 1) * PAGE
                out[a - lo:b - lo] = _read(fd, a, b)
        return bytes(out)
    try:
        return os.pread(fd, hi - lo, lo)
    except OSError:
        out = bytearray(hi - lo)
        step = 4096
        for a in range(lo, hi, step):
            try:
                out[a - lo:a - lo + step] = os.pread(fd, step, a)
            except OSError:
                pass
        return bytes(out)


class Scan:
    """Searches over the snapshots of all processes taken at one moment."""

    def __init__(self, snaps: Iterable[Snapshot]) -> None:
        self.snaps = list(snaps)
        self._u32: list[np.ndarray] = []
        for s in self.snaps:
            for _a, b, _n in s.regions:
                if len(b) >= 64:
                    self._u32.append(np.frombuffer(b, dtype="<u4", count=len(b) // 4))

    def size(self) -> int:
        return sum(s.size() for s in self.snaps)

    def items(self, pattern: bytes) -> set[bytes]:
        """Every match of a regular expression (raw items are text: any alignment)."""
        rx = re.compile(pattern)
        found: set[bytes] = set()
        for s in self.snaps:
            for _a, b, _n in s.regions:
                found.update(rx.findall(b))
        return found

    def find_words(self, needles: Sequence[np.ndarray]) -> list[bool]:
        """For each needle (a uint32 sequence of at least 2 words, e.g. 16 int32 cells or 16
        int64 cells as 32 words), whether it occurs at a 4-byte aligned place in any region.
        Every array the agent makes (numpy, array('i'), bytes) is at least 4-byte aligned.
        Vectorised: the needles' first two words, as one 64-bit key, are looked up at every
        position (searchsorted over the region read as uint64 at both 4-byte phases), then the
        candidates are narrowed word by word."""
        hit = np.zeros(len(needles), dtype=bool)
        if not needles:
            return []
        keys_all = np.array([int(n[0]) | (int(n[1]) << 32) for n in needles], dtype=np.uint64)
        lens = np.array([len(n) for n in needles])
        groups: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for length in set(lens.tolist()):
            idx = np.flatnonzero(lens == length)
            rows = np.zeros(len(needles), dtype=np.intp)
            rows[idx] = np.arange(len(idx))
            groups[length] = (rows, np.stack([needles[int(i)] for i in idx]).astype(np.uint32))
        order = np.argsort(keys_all, kind="stable")
        keys = keys_all[order]
        # equal keys sit together once sorted: run[k] = how many equal keys start at k
        run = np.ones(len(keys), dtype=np.intp)
        for k in range(len(keys) - 2, -1, -1):
            if keys[k] == keys[k + 1]:
                run[k] = run[k + 1] + 1
        for v in self._u32:
            for phase in (0, 1):
                n64 = (len(v) - phase) // 2
                if n64 < 1:
                    continue
                v64 = v[phase:phase + 2 * n64].view(np.uint64)
                pos = np.searchsorted(keys, v64)
                pos[pos == len(keys)] = 0
                cand = np.flatnonzero(keys[pos] == v64)
                if not len(cand):
                    continue
                first = pos[cand]
                del pos
                cnt = run[first]
                cand = np.repeat(cand, cnt)  # one row per (position, needle with that key)
                step = np.arange(len(cand)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
                which = order[np.repeat(first, cnt) + step]
                start = phase + 2 * cand  # word offset in v
                for length, (rows, mat) in groups.items():
                    sel = np.flatnonzero((lens[which] == length) & (start + length <= len(v)))
                    w, st = which[sel], start[sel]
                    r = rows[w]
                    for j in range(2, length):
                        if not len(w):
                            break
                        ok = v[st + j] == mat[r, j]
                        w, st, r = w[ok], st[ok], r[ok]
                    hit[w] = True
        return [bool(x) for x in hit]

    def find_near(self, ref: np.ndarray, bound: int) -> list[np.ndarray]:
        """Every int32 array of len(ref) in memory that differs from ``ref`` by at most
        ``bound`` in each cell (the intruder locating the counters: state on flash + a
        draw + the events since). Returns copies of the arrays found."""
        ref = ref.astype(np.int64)
        out: list[np.ndarray] = []
        # |x - r| <= bound  <=>  (x - (r - bound)) mod 2**32 <= 2*bound: uint32 arithmetic only
        lo = ((ref - bound) & 0xFFFFFFFF).astype(np.uint32)
        span = np.uint32(2 * bound)
        for v in self._u32:
            if len(v) < len(ref):
                continue
            vv = v[:len(v) - len(ref) + 1]
            # at least half of the array's words nonzero (the counters hold a draw in every cell,
            # zero in a few): zero-filled memory, near any small reference, is skipped at once
            nzc = np.concatenate(([0], np.cumsum(v != 0, dtype=np.int64)))
            dense = (nzc[len(ref):len(ref) + len(vv)] - nzc[:len(vv)]) * 2 >= len(ref)
            cand = np.flatnonzero(dense & ((vv - lo[0]) <= span))
            for j in range(1, len(ref)):
                if not len(cand):
                    break
                cand = cand[(v[cand + j] - lo[j]) <= span]
            for c in cand:
                arr = v[c:c + len(ref)].view(np.int32).astype(np.int64)
                # zero-filled memory is "near" a reference that is near zero (a fresh accumulator
                # holds one draw: most cells nonzero): not the counters
                if np.count_nonzero(arr) * 2 < len(arr) or any(np.array_equal(arr, o) for o in out):
                    continue
                out.append(arr)
                if len(out) >= 8:
                    return out
        return out


def as_words(cells: np.ndarray, dtype: str) -> np.ndarray:
    """Cells encoded as the agent's arrays would hold them ('<i4', '<i8', '<f8'), as uint32s."""
    return np.ascontiguousarray(cells.astype(dtype)).view("<u4").copy()
