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
                regions.append((lo, _read(fd, lo, hi), name))
        finally:
            os.close(fd)
        return cls(pid, regions)

    def size(self) -> int:
        return sum(len(b) for _a, b, _n in self.regions)


def _read(fd: int, lo: int, hi: int) -> bytes:
    """One region; pages that cannot be read (guard pages) come back as zeros."""
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
        """For each needle (a uint32 sequence, e.g. 16 int32 cells or 16 int64 cells as 32
        words), whether it occurs at a 4-byte aligned place in any region. Every array the
        agent makes (numpy, array('i'), bytes) is at least 4-byte aligned. Vectorised: the
        first word of each needle is looked up at every position (searchsorted), then the
        candidates are narrowed word by word."""
        hit = np.zeros(len(needles), dtype=bool)
        by_len: dict[int, list[int]] = {}
        for i, n in enumerate(needles):
            by_len.setdefault(len(n), []).append(i)
        for length, idx in by_len.items():
            mat = np.stack([needles[i] for i in idx]).astype(np.uint32)
            # rounds in which every needle has a distinct first word (searchsorted finds one key)
            left = np.arange(len(idx))
            while len(left):
                _u, first = np.unique(mat[left, 0], return_index=True)
                now = left[first]
                left = np.setdiff1d(left, now)
                order = now[np.argsort(mat[now, 0], kind="stable")]
                keys = mat[order, 0]
                for v in self._u32:
                    if len(v) < length:
                        continue
                    vv = v[:len(v) - length + 1]
                    pos = np.searchsorted(keys, vv)
                    pos[pos == len(keys)] = 0
                    cand = np.flatnonzero(keys[pos] == vv)
                    which = order[pos[cand]]
                    for j in range(1, length):
                        if not len(cand):
                            break
                        ok = v[cand + j] == mat[which, j]
                        cand, which = cand[ok], which[ok]
                    for w in which:
                        hit[idx[int(w)]] = True
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
            cand = np.flatnonzero((vv - lo[0]) <= span)
            for j in range(1, len(ref)):
                if not len(cand):
                    break
                cand = cand[(v[cand + j] - lo[j]) <= span]
            for c in cand:
                out.append(v[c:c + len(ref)].view(np.int32).astype(np.int64))
        return out


def as_words(cells: np.ndarray, dtype: str) -> np.ndarray:
    """Cells encoded as the agent's arrays would hold them ('<i4', '<i8', '<f8'), as uint32s."""
    return np.ascontiguousarray(cells.astype(dtype)).view("<u4").copy()
