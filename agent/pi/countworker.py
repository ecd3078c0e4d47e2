"""``feed --jobs N``: helper processes that count raw input chunks on other cores.

CPython only (os.fork; the workers run pansketch.agent.pi.batch, numpy): **not** part of the MicroPython
device core. ``add_raw`` counts one chunk (at most CHUNK_LINES lines, pansketch.agent.pi.sources) in about
4 ms, almost all of it in C calls that hold the GIL (bytes.split, Counter, SHA-256), so threads
cannot share the work; processes can.

A worker is forked **before** the recorder loads the noisy state or draws any noise, so its memory
holds only the config and imported code: no counters, no noise, no random bytes it could keep
after the parent has used them (a fork after that would leave a frozen copy of the noisy state
in the worker, and the parent's later state minus that copy is the exact count of what came
since). It then loops:

1. read one chunk from its pipe: a 4-byte little-endian length, then the complete lines (a
   chunk is at most READ_BYTES + MAX_LINE, about 2 MiB: pansketch.agent.pi.sources);
2. count it into a zeroed scratch sketch of the same kind, shape, salt and clip
   (``pansketch.agent.pi.batch.add_raw``: the same code, so the same cells as counting it in the parent);
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

The start of the input (:class:`Early`): what is already on standard input when ``feed`` starts is
read right after the fork and handed to the workers while the main process loads its modules and
boots the noisy state (30-40 ms it would otherwise count nothing in); the counting loop takes
those chunks first, in input order.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import threading
import time
from typing import Any, Callable, Optional

DEPTH = 2  # chunks handed to a worker and not yet answered: one it counts, one waiting in its pipe
EARLY = 8  # chunks read and handed to the workers while the main process starts (the daemon's queue bound)
SCRUB_GAP_S = 0.25  # a worker whose input stays quiet this long after a chunk scrubs its heap
ANSWER_S = 30.0  # a chunk takes milliseconds; a worker silent this long is stopped or wedged


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
    if not gc.isenabled():  # forked while the entry point held the collector off (pansketch.agent.pi.daemon.cli)
        gc.freeze()
        gc.enable()
    from pansketch.agent.pi.batch import add_raw
    from pansketch.agent.sketch import Sketch
    from pansketch.agent.pi.sources import Warner

    from pansketch.agent.pi.memwipe import scrub, wipe_bytes

    sk = Sketch(kind, d, w, prefix, clip)  # the scratch: one chunk's exact counts at most
    zero = bytes(4 * d * w)
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
        wipe_bytes(data)  # the chunk's raw lines: counted
        del data
        _write_all(wfd, sk.counters)
        sk.counters[:] = type(sk.counters)("i", zero)  # (the array's buffer is overwritten in place)
        # nothing arrives within SCRUB_GAP_S: overwrite the freed objects of what it counted (a busy
        # input's next chunk reuses them meanwhile; docs/PRIVACY.md "Memory residue")
        if not select.select([rfd], [], [], SCRUB_GAP_S)[0]:
            scrub()


class CountWorker:
    """The parent's handle on one worker process: at most ``depth`` chunks in flight."""

    def __init__(self, pid: int, to_w: int, from_w: int, nbytes: int, depth: int = DEPTH) -> None:
        self.pid = pid
        self.to_w = to_w
        self.from_w = from_w
        self.nbytes = nbytes
        self.depth = depth
        self.chunks: list[bytes] = []  # handed over, cells not yet taken, oldest first (recounted if the worker fails)
        self.early = 0  # chunks it may be handed while the main process starts (their answers wait in its pipe)
        self.alive = True
        self.answer_s = ANSWER_S
        # zero a chunk's bytes once its cells are taken (agent.memwipe.wipe_bytes): only for chunks
        # nobody else holds, which the daemon's are (it sets this); a caller's own bytes stay intact
        self.wipe_taken = False

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
        fits = _pipe_size(r2, nbytes * (EARLY + DEPTH)) // nbytes
        wk = cls(pid, w1, r2, nbytes, DEPTH if fits >= DEPTH else 1)
        # and the answers for the chunks handed over while the main process starts (nobody reads
        # them before it counts) on top of those
        wk.early = max(0, min(EARLY, fits - wk.depth))
        return wk

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

    def give(self, chunk: bytes, reached: bool = True) -> bool:
        """Hand over one chunk (there must be ``room()``). False if the worker is gone: the
        caller still has the chunk and counts it itself. ``reached=False``: a chunk handed over
        while the main process starts (:class:`Early`); it joins ``chunks`` when the main
        process reaches it (:meth:`reach`)."""
        assert not reached or len(self.chunks) < self.depth <= DEPTH, \
            "at most DEPTH chunks in flight per worker (the exposure bound)"
        try:
            for part in (len(chunk).to_bytes(4, "little"), chunk):
                mv = memoryview(part)
                while len(mv):
                    if not select.select([], [self.to_w], [], self.answer_s)[1]:
                        raise TimeoutError  # not reading: stopped or wedged
                    try:
                        mv = mv[os.write(self.to_w, mv):]
                    except BlockingIOError:
                        continue
        except (OSError, ValueError):  # (TimeoutError is an OSError)
            try:  # at once: a chunk half written must never be followed by another (garbage counts)
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
            return False
        if reached:
            self.chunks.append(chunk)
        return True

    def reach(self, chunk: bytes) -> None:
        """The main process reached a chunk handed over early: its answer is the next one owed."""
        self.chunks.append(chunk)

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
        chunk = self.chunks.pop(0)
        if self.wipe_taken:  # the daemon's own chunks: counted by the worker, this was their last use
            from pansketch.agent.pi.memwipe import wipe_bytes

            wipe_bytes(chunk)
        del chunk
        return out

    def kill(self) -> None:
        """SIGKILL the process unless it was closed (reaped: its pid may belong to another now)."""
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass

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


def read_now(fd: int, reader: Any, most: int) -> tuple[list[bytes], bool]:
    """What is on ``fd`` now (no waiting: a terminal or an idle pipe gives nothing), cut into
    chunks by ``reader`` (pansketch.agent.pi.sources.FdLineReader, which the stdin source then goes on with):
    at most ``most`` reads of up to READ_BYTES, stopping once there are ``most`` chunks (a read of
    short lines holds several), and whether the input ended (its unfinished last line is then
    the last chunk)."""
    from pansketch.agent.pi.sources import _drop_read, read_available

    chunks: list[bytes] = []
    reads = 0
    try:
        while len(chunks) < most and reads < most and select.select([fd], [], [], 0)[0]:
            reads += 1
            data, at_end = read_available(fd)
            got = reader.feed(data)
            _drop_read(data, got, reader)
            chunks += got
            del data, got
            if at_end:
                tail = reader.tail()
                if tail:
                    chunks.append(tail)
                return chunks, True
    except (OSError, ValueError):
        pass  # the stdin source meets it again and says so
    return chunks, False


class Ticket:
    """A chunk handed to ``worker`` while the main process started, in its place in the input."""

    __slots__ = ("worker", "data", "ok", "done")

    def __init__(self, worker: CountWorker, data: bytes) -> None:
        self.worker = worker
        self.data = data
        self.ok = False  # the worker took it (its answer is owed)
        self.done = threading.Event()  # set once the hand-over was tried


class Early:
    """The start of the input, read and handed to the workers before the main process has
    loaded its modules and the noisy state (30-40 ms of a short ``feed``).

    The main thread reads what is on standard input right after the fork (:func:`read_now`, at
    most EARLY reads of up to 1 MiB per worker), and a thread writes up to EARLY of the chunks to
    each worker (writes wait for a worker to read; the thread holds no lock the main thread
    needs). ``items``, in input order, are Tickets and the chunks left for the main process (a
    read of short lines holds more than one chunk); the daemon's loop takes them (and clears
    this list) before its queue, so they count as if they had been queued: after the first tick,
    in order. The answers wait in each worker's result pipe, which has room for them
    (CountWorker.early). Nothing may close a worker while the thread may still write to it:
    :meth:`stop` first."""

    def __init__(self, workers: list[CountWorker], chunks: list[bytes], reader: Any, at_end: bool) -> None:
        self.reader = reader
        self.at_end = at_end
        self.items: list[Any] = []
        self.workers = list(workers)
        self._stop = threading.Event()
        load = {wk: 0 for wk in workers}
        for c in chunks:
            free = [wk for wk in workers if load[wk] < wk.early]
            if not free:
                self.items.append(c)
                continue
            wk = min(free, key=lambda x: load[x])
            load[wk] += 1
            self.items.append(Ticket(wk, c))
        self.thread: Optional[threading.Thread] = None
        tickets = tuple(t for t in self.items if isinstance(t, Ticket))
        if tickets:
            self.thread = threading.Thread(target=self._give, args=(tickets,), name="count-early", daemon=True)
            self.thread.start()

    def _give(self, tickets: "tuple[Ticket, ...]") -> None:
        dead: set[CountWorker] = set()
        for t in tickets:
            t.ok = not self._stop.is_set() and t.worker not in dead and t.worker.give(t.data, reached=False)
            if not t.ok:
                dead.add(t.worker)  # (give killed it): its later tickets are counted by the main process
            t.done.set()

    def busy(self) -> bool:
        """Still handing over: nothing else may be written to a worker before it is done."""
        return self.thread is not None and self.thread.is_alive()

    def stop(self, wait_s: float = 1.0) -> None:
        """End the hand-over before a worker is closed: no more chunks are started; one being
        written gets ``wait_s`` to finish, then the workers not yet closed (reaped) are killed,
        which fails the write at once. Their chunks are counted by the main process."""
        self._stop.set()
        if self.thread is None:
            return
        self.thread.join(wait_s)
        if self.thread.is_alive():
            for wk in self.workers:
                wk.kill()
            self.thread.join()
