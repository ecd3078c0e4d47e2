"""The agent loop: source -> Recorder -> outbox -> MQTT, one :class:`Agent` per process.

The counting, noise and crash-safe commit protocol are the device core's
(pansketch.agent.recorder); the loop wires a source, the clock, the count workers
(``feed --jobs``) and the publisher around it.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import signal
import threading
import time
from typing import Any, Callable, Optional

from pansketch.agent.pi import common
from pansketch.agent.pi.memwipe import scrub, wipe_bytes

from pansketch.agent.pi.common import EXIT_OK, EXIT_RUNTIME, EXIT_UNDELIVERED, SEED_ENV, die, logger

# A queue that empties between two chunks of a busy input (the reader a little slower than the
# counting) scrubs at most this often; the next tick (1 s) scrubs what was counted since
# (docs/PRIVACY.md "Memory residue"): a scrub costs 2-15 ms, a chunk about 5.
SCRUB_GAP_S = 0.25



class Clock:
    """UTC seconds; optionally shifted/scaled for tests and the demo.

    ``start`` pins the time at start-up, ``speed`` scales its progress
    (0 freezes it). Only release timing depends on the clock, never noise.
    """

    def __init__(self, start: Optional[float] = None, speed: float = 1.0) -> None:
        self.start = start
        self.speed = speed
        self.t0 = time.time() if start is None else start
        self.m0 = time.monotonic()
        self.real = start is None and speed == 1.0

    def now(self) -> int:
        if self.real:
            return int(time.time())
        return int(self.t0 + (time.monotonic() - self.m0) * self.speed)

    def seconds(self, real: float) -> float:
        """Simulated seconds -> real seconds to wait (>= 0.05)."""
        if self.speed <= 0:
            return 1.0
        return max(0.05, real / self.speed)


def _make_rng(args: argparse.Namespace, log: Callable[[str], None]) -> Any:
    from pansketch.agent.rng import DeterministicSource, NoEntropyError, Rng, SystemSource

    seed = args.insecure_seed or os.environ.get(SEED_ENV)
    if seed:
        log("WARNING: --insecure-seed / %s is set: noise is DETERMINISTIC and gives NO privacy. "
            "For tests and reproductions only." % SEED_ENV)
        return Rng(DeterministicSource(seed))
    try:
        try:  # whole-array noise draws with numpy (agent/pi/bulknoise.py): same distributions, faster
            from pansketch.agent.pi.bulknoise import BulkRng
        except ImportError:
            return Rng(SystemSource())
        return BulkRng(SystemSource())
    except NoEntropyError as exc:
        raise SystemExit(die(EXIT_RUNTIME, "refusing to start: %s" % exc))


# A clock before 2024 has not been set (a Pi without a real-time clock boots at 1970, or at the last
# time fake-hwclock saved): the same floor as the board firmware's (firmware/clock.py MIN_VALID_UNIX).
MIN_VALID_UNIX = 1704067200  # 2024-01-01T00:00:00Z
CLOCK_WAIT_LOG_S = 60.0


def wait_for_plausible_clock(clock: Clock, log: Callable[[str], None], now: Callable[[], float] = time.time,
                             sleep: Callable[[float], None] = time.sleep) -> int:
    """Wait until the real clock reads 2024 or later (NTP, systemd-timesyncd); returns that time.

    Counting starts after this: the recorder dates its first window by the clock, so a window
    opened at 1970 would become a release for 1970 (which the host quarantines as ``past``). The
    board firmware counts meanwhile and re-dates its accumulator at the first NTP answer; the Pi
    agent simply starts once the time is known, which on a networked Pi is seconds after boot. Says
    so at once and then once a minute. A clock given with --clock-start/--clock-speed is the
    caller's own time and is taken as it is."""
    t = now()
    if not clock.real or t >= MIN_VALID_UNIX:
        return int(t)
    waited = 0.0
    while t < MIN_VALID_UNIX:
        if waited % CLOCK_WAIT_LOG_S == 0:
            log("the clock reads %s, before 2024: not set yet (NTP); waiting for it before counting or "
                "releasing anything" % time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(max(0, t))))
        sleep(1.0)
        waited += 1.0
        t = now()
    log("the clock is set (%s): starting" % time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)))
    return int(t)


class Agent:
    """One agent process: config, recorder, source queue, publisher, clock."""

    def __init__(self, cfg: Any, args: argparse.Namespace, source_type: Optional[str] = None,
                 workers: Optional[list[Any]] = None, early: Any = None) -> None:
        from pansketch.agent.pi.publisher import Publisher
        from pansketch.agent.recorders import make
        from pansketch.agent.pi.sources import make_source

        self.cfg = cfg
        self.args = args
        self.log = logger(cfg.device, args.quiet)
        self.clock = Clock(args.clock_start, args.clock_speed)
        wait_for_plausible_clock(self.clock, self.log)  # before the recorder dates its first window
        rng = _make_rng(args, self.log)
        self.rec = make(cfg.params, cfg.state_dir, self.clock.now(), rng=rng, log=self.log,
                        outbox_max=cfg.outbox_max)
        self.q: "queue.Queue[Any]" = queue.Queue(maxsize=8)  # few raw events in flight (pan-privacy)
        scfg = cfg.source
        if source_type is not None and source_type != scfg.type:
            from pansketch.agent.pi.config import SourceConfig

            scfg = SourceConfig(type=source_type)
        self.source = make_source(scfg, self.q, self.log, cfg.device + "-source")
        # cms/cs count raw line chunks in bulk (pansketch.agent.pi.batch.add_raw); other kinds get parsed batches
        self.source.raw = cfg.params.kind in ("cms", "cs")
        self.pub = Publisher.from_config(cfg, self.rec.outbox, self.log, clock=self.clock.now)
        self.pub.next_seq = lambda: self.rec.seq
        self.stopping = threading.Event()
        self.counted = False  # events counted since the last scrub (pansketch.agent.pi.memwipe)
        self.scrubbed = 0.0  # time.monotonic() of the last scrub
        self.failed = False
        self.workers: list[Any] = list(workers or ())  # feed --jobs: count worker processes (agent/pi/countworker.py)
        self.chunks_here = 0  # raw chunks counted in this process / by the workers (the last log line of pump)
        self.chunks_handed = 0
        # feed --jobs: the input's start, read and handed to the workers while this process started
        # (pansketch.agent.pi.countworker.Early): its items come before the queue's, and the source goes on after it
        self.early = early
        self.pre: list[Any] = []
        if early is not None:  # taken, not copied: a chunk counted here must not stay referenced there
            self.pre, early.items = early.items, []
            self.source.resume(early.reader, early.at_end)

    def boundary(self) -> int:
        return self.rec.ehi * self.cfg.params.epoch_s

    def tick(self) -> None:
        self._settle()  # chunks a worker is counting arrived before this tick: they count in this epoch
        persisted = self.rec.last_persist
        released = self.rec.tick(self.clock.now())
        if released:
            self.pub.wake()
        if released or self.rec.last_persist != persisted or (self.counted and self.q.empty()):
            # a draw was made (the scalar samplers' Python ints, the release's CBOR pieces), or
            # events were counted since the last scrub: the source thread frees its last pieces of
            # a read after this thread's scrub at the end of the count (docs/PRIVACY.md "Memory residue")
            self.counted = False
            self.scrubbed = time.monotonic()
            scrub()

    def _raw_adder(self, sk: Any, data: bytes, _weights: Any) -> None:
        from pansketch.agent.pi.batch import add_raw

        add_raw(sk, data, self.source.warn)

    def _hand_over(self, data: bytes) -> bool:
        """Give a raw chunk to a count worker with room (taking the cells of what it finished
        first); False when every worker is full (or none is left): the caller counts it."""
        if self.early is not None and self.early.busy():
            return False  # the start of the input is still being written to the workers: nothing between
        for wk in list(self.workers):
            while wk.alive and wk.done():
                self._take(wk)
            if not wk.alive or not wk.room():
                continue
            if wk.chunks and self.source.ended and self.q.qsize() <= len(wk.chunks) + 1:
                continue  # the input's last chunks (the queue's last item may be its end): queued behind
                # the worker's, this one would finish last while this process waited
            if wk.give(data):
                self.chunks_handed += 1
                return True
            self._fail(wk, "it stopped taking input")
        return False

    def _take(self, wk: Any) -> None:
        """Add the cells of the oldest chunk ``wk`` counted; if it died or went silent, count
        every chunk it still had here."""
        from pansketch.agent.pi.batch import add_cells

        cells = wk.take()
        if cells is not None:
            self.rec.add_many(cells, None, adder=add_cells)  # zeroes cells
            return
        self._fail(wk, "it died or did not answer within %g s" % wk.answer_s)

    def _fail(self, wk: Any, why: str) -> None:
        """Kill a worker that failed and count every chunk it still had here: nothing lost, and
        nothing twice (killed first, it can no longer answer)."""
        wk.kill()
        if self.early is not None:
            self.early.stop()  # the hand-over may be writing to it: over before its pipes close
        wk.close(kill=True)
        self.workers.remove(wk)
        self.log("count worker %d left (%s); counting with %d process(es)" % (wk.pid, why, len(self.workers) + 1))
        left, wk.chunks = wk.chunks, []
        while left:
            chunk = left.pop(0)
            self.rec.add_many(chunk, None, adder=self._raw_adder)
            wipe_bytes(chunk)
            del chunk
            self.chunks_handed -= 1
            self.chunks_here += 1

    def _settle_idle(self) -> None:
        """Nothing waits in the queue: take the cells of chunks the workers finished, then scrub
        this process's freed small objects (pansketch.agent.pi.memwipe.scrub)."""
        for wk in list(self.workers):
            while wk.alive and wk.done():
                self._take(wk)
        self.counted = False
        self.scrubbed = time.monotonic()
        scrub()

    def _settle(self) -> None:
        """Wait for every chunk in flight and add it (before a tick and when counting ends)."""
        for wk in list(self.workers):
            while wk.alive and wk.chunks:
                self._take(wk)

    def pump(self) -> bool:
        """Count events and tick the clock until stopped (False) or end of input (True)."""
        helpers = len(self.workers)
        try:
            return self._pump()
        finally:
            self.pre = []  # on a stop: the input's start not reached is dropped like the queue
            if self.early is not None:
                self.early.stop()  # before any pipe closes
            self._settle()
            for wk in self.workers:  # not needed any more: their memory goes back now
                wk.close()
            self.workers = []
            if helpers:
                self.log("counted %d input chunk(s), %d of them in %d helper process(es)"
                         % (self.chunks_here + self.chunks_handed, self.chunks_handed, helpers))

    def _pump(self) -> bool:
        from pansketch.agent.pi.batch import add_batch
        from pansketch.agent.pi.countworker import Ticket
        from pansketch.agent.pi.sources import EOF, RawLines, SourceFailed

        tick_real = self.clock.seconds(1.0)
        next_tick = time.monotonic()
        while not self.stopping.is_set():
            wait = next_tick - time.monotonic()
            try:
                if self.pre:  # the input's start (Early): before the queue, in order
                    c = self.pre.pop(0)
                    batch = c if type(c) is Ticket else RawLines(c)
                    del c
                else:
                    batch = self.q.get(timeout=wait) if wait > 0 else self.q.get_nowait()
            except queue.Empty:
                batch = ()
            if batch is EOF:
                return True
            if isinstance(batch, SourceFailed):
                self.log("event source failed: %s" % batch.reason)
                self.failed = True
                return False
            if time.monotonic() >= next_tick:
                self.tick()
                next_tick = max(next_tick + tick_real, time.monotonic())
            if batch:
                if self.clock.now() >= self.boundary():
                    # Events after an epoch end belong to the next epoch, but the
                    # release is committed (and the publisher woken) only on the
                    # scheduled tick: committing on event arrival would make the
                    # publish time tell whether an event came in the first second
                    # after the boundary. Hold the batch until that tick.
                    if not self.stopping.wait(max(0.0, next_tick - time.monotonic())):
                        self.tick()
                        next_tick = max(next_tick + tick_real, time.monotonic())
                if type(batch) is Ticket:
                    while not batch.done.wait(0.1):  # its hand-over was tried (so were the ones before)
                        if self.stopping.is_set():
                            return False
                    if batch.ok and batch.worker in self.workers:
                        batch.worker.reach(batch.data)  # its answer is the next one owed
                        self.chunks_handed += 1
                        while batch.worker.alive and batch.worker.done():
                            self._take(batch.worker)
                    else:  # its worker failed: counted here
                        self.rec.add_many(batch.data, None, adder=self._raw_adder)
                        self.chunks_here += 1
                        wipe_bytes(batch.data)
                    batch.data = b""
                elif type(batch) is RawLines:
                    if not (self.workers and self._hand_over(batch.data)):
                        self.rec.add_many(batch.data, None, adder=self._raw_adder)  # cms/cs only (Agent.__init__)
                        self.chunks_here += 1
                        wipe_bytes(batch.data)  # counted: its last use (a handed-over one is wiped when taken)
                    batch.data = b""
                else:
                    items, weights = batch
                    self.rec.add_many(items, weights, adder=add_batch)  # numpy path; counters wrap mod 2^32
                    del items, weights
                del batch
                self.counted = True
                if not self.pre and self.q.empty() and time.monotonic() - self.scrubbed >= SCRUB_GAP_S:
                    # about to wait for input: overwrite the freed lines, digests and hash objects of
                    # what was just counted (a busy input's next chunk reuses them meanwhile)
                    self._settle_idle()
        return False

    def _flush_when_room(self, timeout: Optional[float]) -> bool:
        """Commit the final release; if the outbox is full (outbox_max), wait up
        to ``timeout`` for the host to acknowledge enough to make room."""
        if self.rec.flush(self.clock.now()):
            return True
        if not self.rec.outbox.full():
            return False  # a real write failure (disk): nothing to wait for
        self.log("the outbox holds its limit of %d releases; waiting for the host to acknowledge some"
                 % self.rec.outbox.limit)
        deadline = None if not timeout else time.monotonic() + timeout
        self.pub.wake()
        while self.rec.outbox.full() and not self.stopping.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return self.rec.flush(self.clock.now())

    def main(self, finite_timeout: Optional[float]) -> int:
        def on_signal(signum: int, frame: Any) -> None:
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        p = self.cfg.params
        pending = len(self.rec.outbox.pending())
        self.log("device %s: %s sketch d=%d w=%d, mode %s, window %d s, epoch %d s, %s budget %d/%d; "
                 "%d release(s) waiting in the outbox; broker %s:%d%s"
                 % (p.device, p.kind, p.d, p.w, p.mode, p.window_s, p.epoch_s, p.mechanism, p.budget[0],
                    p.budget[1], pending, self.cfg.broker.host, self.cfg.broker.port,
                    " (TLS)" if self.cfg.broker.tls else ""))
        # the counting code (numpy: 0.1-0.3 s to import) is loaded before "online" goes out, so an
        # agent that says it is online counts what it is given at once
        import pansketch.agent.pi.batch  # noqa: F401
        if common.gc_held and not gc.isenabled():  # off while the modules loaded (cli); objects made so far stay
            gc.freeze()
            gc.enable()
        self.pub.start()
        self.source.start()
        ended = self.pump()
        code = EXIT_OK
        if ended and getattr(self.args, "no_flush", False):
            # deliver only what waits in the outbox. The open window is NOT skipped because it is
            # empty: that choice is the operator's flag, never the data (a release that exists only
            # when events were counted would tell that none were); it goes out at its boundary.
            self.rec.persist(self.clock.now())
            self.log("--no-flush: the open window stays in the noisy state until its boundary; "
                     "delivering the %d release(s) in the outbox" % len(self.rec.outbox.pending()))
            ended = False
            code = EXIT_OK
            self.pub.wake()
            if not self.pub.wait_delivered(finite_timeout, self.stopping):
                left = self.rec.outbox.pending()
                self.log("%d release(s) not stored by the host within %g s (seq %s); they stay in %s"
                         % (len(left), finite_timeout or 0, _seq_list(left), self.rec.outbox.dir))
                code = EXIT_UNDELIVERED
            else:
                self.log("all releases stored by the host (next seq %d)" % (self.rec.seq,))
            self.source.stop()
            self.pub.stop()
            return code
        if ended:
            # end of a batch input: release early (docs/ARCHITECTURE.md "Release modes" allows it for batch replays). Also with
            # no events at all (feed < /dev/null): whether a release exists must not depend on the
            # data; --no-flush is the way to only deliver the outbox.
            if not self._flush_when_room(finite_timeout):
                self.rec.persist(self.clock.now())
                self.log("could not commit the final release (see above); the noisy state is saved and is "
                         "released by the next run or feed")
                code = EXIT_RUNTIME
            self.pub.wake()
            n = len(self.rec.outbox.pending())
            refused_before = self.rec.outbox.rejected()
            ok = self.pub.wait_delivered(finite_timeout, self.stopping)
            refused = self.rec.outbox.rejected() - refused_before
            if not ok:
                left = self.rec.outbox.pending()
                why = self.pub.last_error or ("not connected to the broker" if not self.pub.connected else
                                              "the host (pansketch aggregate) has not acknowledged them: is an "
                                              "aggregator subscribed?")
                if self.stopping.is_set():
                    why = "interrupted"
                self.log("%d of %d release(s) not stored by the host within %g s (seq %s): %s; they stay in %s "
                         "and are re-sent until the host acknowledges them (next run or feed)"
                         % (len(left), n, finite_timeout or 0, _seq_list(left), why, self.rec.outbox.dir))
                code = code or EXIT_UNDELIVERED
            elif refused > 0:
                self.log("the host refused %d release(s) for good (its reason is logged above and in "
                         "pansketch status); they are kept in %s/rejected, not re-sent" % (refused, self.rec.outbox.dir))
                code = code or EXIT_UNDELIVERED
            elif code == EXIT_OK:
                self.log("all releases stored by the host (next seq %d)" % (self.rec.seq,))
        else:
            self.rec.persist(self.clock.now())
            self.log("stopping; noisy state saved, %d release(s) waiting in the outbox"
                     % len(self.rec.outbox.pending()))
            if self.failed:
                code = EXIT_RUNTIME
        self.source.stop()
        self.pub.stop()
        return code


def _seq_list(seqs: list[int], most: int = 8) -> str:
    if len(seqs) <= most:
        return ", ".join(str(s) for s in seqs)
    return "%s, ... %d" % (", ".join(str(s) for s in seqs[:most]), seqs[-1])
