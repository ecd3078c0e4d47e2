"""``feed --jobs N``: helper processes that count raw input chunks on other cores.

CPython only (os.fork; the workers run agent.batch, numpy): **not** part of the MicroPython
device core. ``add_raw`` counts one chunk (at most CHUNK_LINES lines, agent.sources) in about
4 ms, almost all of it in C calls that hold the GIL (bytes.split, Counter, SHA-256), so threads
cannot share the work; processes can.

A worker is forked **before** the recorder loads the noisy state or draws any noise, so its memory
holds only the config and imported code: no counters, no noise, no random bytes it could keep
after the parent has used them (a fork after that would leave a frozen copy of the noisy state
in the worker, and the parent's later state minus that copy is the exact count of what came
since). It then loops:

1. read one chunk from its pipe: a 4-byte little-endian length, then the complete lines;
2. count it into a zeroed scratch sketch of the same kind, shape, salt and clip
   (``agent.batch.add_raw``: the same code, so the same cells as counting it in the parent);
3. write the scratch's d*w int32 cells back (always d*w*4 bytes, whatever the chunk held);
4. zero the scratch and its input buffer.

The parent adds the cells into every open array of its noisy sketch (:func:`add_cells`), mod
2**32 like every other update, and zeroes its copy. Counters are a sum, so which process counts
which chunk does not change any cell: ``feed --jobs 2`` commits byte-identical releases to
``--jobs 1`` (tests/test_countworker.py).

Exposure (docs/PRIVACY.md, "The intruder's view"): a worker counts one chunk at a time, so with
N processes up to N chunks are being counted at once, each with the same one-chunk window as the
parent's own. At most DEPTH = 2 chunks are handed to a worker and not yet answered (one counted,
one waiting in its pipe as raw lines in flight, so the worker never idles between chunks); the
cells of a counted chunk wait in the result pipe only until the parent takes them. The parent
keeps the chunks it handed over until their cells arrive: if the worker dies (killed, out of
memory) or does not answer or read within ``ANSWER_S``, the parent kills it, counts those chunks
itself and goes on without it, so nothing is lost and nothing is counted twice. A sketch whose
cells do not fit in the result pipe (more than /proc/sys/fs/pipe-max-size, 1 MiB by default)
gets one chunk at a time instead of two: the parent writing the second chunk reads nothing, and
a worker blocked writing the first one's cells would read nothing either.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import time
from typing import Any, Callable, Optional

DEPTH = 2  # chunks handed to a worker and not yet answered: one it counts, one waiting in its pipe
ANSWER_S = 30.0  # a chunk takes milliseconds; a worker silent this long is stopped or wedged
MAX_CHUNK = (1 << 32) - 1  # the length prefix's range (a chunk is at most about 2 MiB)


def default_jobs() -> int:
    """Processes ``feed`` counts with when not told: 2 where fork and a second core exist (a
    third process gains little on the 2-core boards this targets; --jobs asks for more)."""
    if not hasattr(os, "fork"):
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use (taskset, a cgroup's cpuset)
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return 2 if cpus >= 2 else 1


def _pipe_size(fd: int, want: int) -> int:
    """Ask for a pipe of at least ``want`` bytes (Linux; capped by /proc/sys/fs/pipe-max-size);
    the capacity it has, or 4096 (POSIX's least) where it cannot be read."""
    try:
        import fcntl

        size = fcntl.fcntl(fd, getattr(fcntl, "F_GETPIPE_SZ", 1032))
        if size < want:
            try:
                size = fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), want)
            except OSError:
                pass
        return size
    except (ImportError, OSError):
        return 4096


def _read_exact(fd: int, buf: bytearray) -> bool:
    """Fill ``buf`` from ``fd``; False at end of file before it is full."""
    mv = memoryview(buf)
    got = 0
    while got < len(buf):
        n = os.readv(fd, [mv[got:]])
        if n == 0:
            return False
        got += n
    return True


def _write_all(fd: int, data: Any) -> None:
    mv = memoryview(data).cast("B")
    while len(mv):
        n = os.write(fd, mv)
        mv = mv[n:]


def _worker_main(rfd: int, wfd: int, kind: str, d: int, w: int, prefix: bytes, clip: int,
                 log: Callable[[str], None]) -> None:
    """The forked process: count chunks until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    if not gc.isenabled():  # forked while the entry point held the collector off (agent.daemon.cli)
        gc.freeze()
        gc.enable()
    from agent.batch import add_raw
    from agent.sketch import Sketch
    from agent.sources import Warner

    sk = Sketch(kind, d, w, prefix, clip)  # the scratch: one chunk's exact counts at most
    warn = Warner(log)
    head = bytearray(4)
    while _read_exact(rfd, head):
        buf = bytearray(int.from_bytes(head, "little"))
        if not _read_exact(rfd, buf):
            break
        data = bytes(buf)  # add_raw counts bytes lines (a bytearray's split gives unhashable pieces)
        buf[:] = bytes(len(buf))
        del buf
        add_raw(sk, data, warn)
        del data
        _write_all(wfd, sk.counters)
        sk.counters[:] = type(sk.counters)("i", bytes(4 * d * w))


class CountWorker:
    """The parent's handle on one worker process: at most ``depth`` chunks in flight."""

    def __init__(self, pid: int, to_w: int, from_w: int, nbytes: int, depth: int = DEPTH) -> None:
        self.pid = pid
        self.to_w = to_w
        self.from_w = from_w
        self.nbytes = nbytes
        self.depth = depth
        self.chunks: list[bytes] = []  # handed over, cells not yet taken, oldest first (recounted if the worker fails)
        self.alive = True
        self.answer_s = ANSWER_S

    @classmethod
    def start(cls, kind: str, d: int, w: int, prefix: bytes, clip: int, log: Callable[[str], None],
              others: "list[CountWorker]") -> "CountWorker":
        """Fork one worker (OSError if the system refuses a process or a pipe). ``others``: the
        workers started before, whose pipe ends the new process must not hold (a worker sees the
        end of its input only when every copy of the parent's end is closed)."""
        r1, w1 = os.pipe()
        try:
            r2, w2 = os.pipe()
        except OSError:
            os.close(r1)
            os.close(w1)
            raise
        try:
            pid = os.fork()
        except OSError:
            for fd in (r1, w1, r2, w2):
                os.close(fd)
            raise
        if pid == 0:  # the worker: never returns into the parent's code, never runs its exit handlers
            code = 0
            try:
                for fd in [w1, r2] + [x for o in others if o.alive for x in (o.to_w, o.from_w)]:
                    os.close(fd)
                _worker_main(r1, w2, kind, d, w, prefix, clip, log)
            except BaseException:  # noqa: BLE001 - a broken pipe or a bug: the parent recounts the chunk
                code = 1
            os._exit(code)
        os.close(r1)
        os.close(w2)
        os.set_blocking(w1, False)  # give() waits at most answer_s for a worker to read (a stopped one never does)
        nbytes = 4 * d * w
        _pipe_size(w1, 1 << 20)  # a whole chunk fits: handing it over is one copy, not 16 wake-ups of the worker
        # A second chunk is handed over while the worker may still be writing the first one's cells;
        # the parent, writing that chunk, reads nothing, so the cells must fit in the result pipe
        # or both would wait for each other. Where they cannot (a huge sketch), one chunk at a time.
        depth = DEPTH if _pipe_size(r2, nbytes) >= nbytes else 1
        return cls(pid, w1, r2, nbytes, depth)

    def room(self) -> bool:
        """Fewer than ``depth`` chunks are in flight: one more can be handed over."""
        return len(self.chunks) < self.depth

    def done(self) -> bool:
        """A chunk is in flight and the cells of the oldest can be read without waiting (or the
        worker has died)."""
        if not self.chunks:
            return False
        try:
            return bool(select.select([self.from_w], [], [], 0)[0])
        except (OSError, ValueError):
            return True  # take() finds out

    def give(self, chunk: bytes) -> bool:
        """Hand over one chunk (there must be ``room()``). False if the worker is gone: the
        caller still has the chunk and counts it itself."""
        assert len(self.chunks) < self.depth <= DEPTH, "at most DEPTH chunks in flight per worker (the exposure bound)"
        try:
            for part in (len(chunk).to_bytes(4, "little"), chunk):
                mv = memoryview(part)
                while len(mv):
                    if not select.select([], [self.to_w], [], self.answer_s)[1]:
                        return False  # not reading: stopped or wedged (the caller kills it)
                    try:
                        mv = mv[os.write(self.to_w, mv):]
                    except BlockingIOError:
                        continue
        except (OSError, ValueError):
            return False
        self.chunks.append(chunk)
        return True

    def take(self) -> Optional[bytearray]:
        """The cells of the oldest chunk in flight (that chunk is released), or None if the
        worker died or stayed silent for ``answer_s``: its chunks are then still in ``chunks``."""
        timeout = self.answer_s
        out = bytearray(self.nbytes)
        mv = memoryview(out)
        got = 0
        try:
            while got < self.nbytes:
                if not select.select([self.from_w], [], [], timeout)[0]:
                    break
                n = os.readv(self.from_w, [mv[got:]])
                if n == 0:
                    break
                got += n
        except (OSError, ValueError):
            pass
        del mv
        if got < self.nbytes:
            out[:] = bytes(len(out))  # part of a chunk's exact cells: wiped like every copy
            return None
        del self.chunks[0]
        return out

    def close(self, kill: bool = False, grace_s: float = 2.0) -> None:
        """End the worker: closing its input ends its loop; ``kill`` when it cannot be trusted to.
        One that has not exited ``grace_s`` after its input closed (a stopped process) is killed:
        it holds nothing that needs a clean exit."""
        if not self.alive:
            return
        self.alive = False
        for fd in (self.to_w, self.from_w):
            try:
                os.close(fd)
            except OSError:
                pass
        deadline = time.monotonic() + (0.0 if kill else grace_s)
        try:
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() >= deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    break
                time.sleep(0.002)
        except OSError:  # already reaped
            pass
