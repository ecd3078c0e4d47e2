"""The aggregator's pipeline: received messages -> validator thread -> writer thread (group commit) ->
acknowledgements, with a bound on the bytes held and deferred fsyncs (:class:`_Writer`)."""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from pansketch.host_tools.ingest import devstatus
from pansketch.host_tools.ingest.acks import group_acks
from pansketch.host_tools.ingest.aggregator import Aggregator, MessageError, Outcome
from pansketch.host_tools.ingest.mqttparent import MQTTProcess
from pansketch.host_tools.ingest.mqttshared import Msg
from pansketch.host_tools.ingest.validproc import ValidatorDied, ValidatorProcess
from pansketch.host_tools.store.rows import Pending

log = logging.getLogger("pansketch.aggregator")


GROUP_MAX = 256  # messages per group commit
# a group of this many is committed without waiting for more (group_wait_ms): its commit's fixed
# cost (the roll-up row, index pages, the fsync) is then a small part of the group's, and during a
# burst the writer waiting with a backlog behind it only idles (the next group gathers meanwhile).
# 128: in the 1,000-device soak at 700/s, groups of 134 (group_wait_ms 200) cost the aggregator 7-9 us
# less per release than groups of 67 (64 and 100 ms), in two interleaved pairs
GROUP_ENOUGH = 128
# a group stops waiting for more when nothing has arrived for this long (the inflow stopped: the end of
# a burst, or a lull); at 700 releases/s from 1,000 devices arrivals are about 1.4 ms apart on average
IDLE_GAP_S = 0.02
# ... or, when arrivals come in clumps, for IDLE_GAP_CLUMPS x the upper quartile of the last GAP_WINDOW
# gaps between arrivals (those under group_wait_ms: longer ones are lulls, not the rhythm of the inflow;
# the quartile, not the longest: one stall inside a burst would make that burst's last group wait).
# In the 1,000-device soak releases reach the MQTT process in clumps of ~16 about 23 ms apart (devices
# released on a shared schedule, here simulated by four processes on two cores): a fixed 20 ms gap ended
# nearly every group after one clump (19.7 releases per commit instead of 128).
IDLE_GAP_CLUMPS = 1.5
GAP_WINDOW = 64
# ... but only where the inflow is fast enough that the longer wait gathers at least this many messages
# (arrival rate over the window x the longer gap): `pansketch-agent feed` sends a status message and,
# a fraction of a second later, its one release; taken for a rhythm, that gap held each release 1.5x
# as long (make bench feed 1.10x -> 0.60x wall)
CLUMP_MIN = 8
# Bytes of received messages this process holds at once (queued, being validated, being stored), each
# counted as its payload plus MSG_OVERHEAD. Several full groups of 16.6 KB releases fit many times over;
# past it the MQTT process's reader waits, so a flood the store cannot keep up with backs up into the
# MQTT process (QoS 1: Receive Maximum; QoS 0: its inbox bound, then dropped and counted) instead of
# growing this process without bound.
HELD_BYTES_MAX = 64 << 20
MSG_OVERHEAD = 256


class _Held:
    """The byte budget of :data:`HELD_BYTES_MAX`: ``take`` waits while it is spent (one message larger than
    the whole budget still passes alone), ``give`` returns bytes once their messages are done with."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waits = 0
        self._cond = threading.Condition()

    def take(self, n: int, give_up: Callable[[], bool]) -> bool:
        with self._cond:
            waited = False
            while self.used > 0 and self.used + n > self.limit:
                if give_up():
                    return False
                waited = True
                self._cond.wait(0.25)
            self.waits += waited
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


def _held_bytes(msgs: Any) -> int:
    return sum(len(m.payload) for m in msgs) + MSG_OVERHEAD * len(msgs)
# unacknowledged messages the broker may send (MQTT v5 Receive Maximum): several groups, so the
# next ones arrive and are validated while one commits
RECEIVE_MAXIMUM = 4 * GROUP_MAX
SYNC_QUEUE = 4  # committed groups waiting for their fsync before the writer waits (deferred syncs)
PRUNE_BATCH = 2000  # releases pruned per transaction (retention), between two groups
PRUNE_EVERY_S = 10.0
# a store outage (the database unreachable, the disk full, the file locked): the group is retried for as
# long as it lasts, acknowledging nothing, with backoff up to STORE_RETRY_MAX_S between attempts, and
# said once per STORE_OUTAGE_LOG_S; the unit's restart is the last resort, not the mechanism
STORE_RETRY_MIN_S = 0.5
STORE_RETRY_MAX_S = 10.0
STORE_OUTAGE_LOG_S = 60.0
MESSAGE_RETRIES = 3  # a message the store refuses on its own (the rest of its group committed)


class _Writer:
    """Validates and stores what the MQTT process received: a validator and a writer thread.

    The validator thread has whatever has queued up validated by the
    validation process (``validator``) and records device status messages;
    the writer thread stores what is validated (at most :data:`GROUP_MAX`
    messages) as one group commit (a savepoint per message), and only then
    acknowledges each message to the broker (PUBACK) and publishes the host
    acknowledgements to the devices (one per device per group), both in one
    request to the MQTT process (``transport``). Validation of the next
    messages overlaps the commit. A failed transaction (the store is away:
    PostgreSQL down, the disk full) is retried with backoff for as long as
    the outage lasts, acknowledging nothing of that group meanwhile; what is
    received waits in the bounded queues, then in the broker. A message the
    store refuses on its own while the rest of its group commits is retried
    3 times; then the aggregator stops without acknowledging it (the broker
    redelivers it; storing is idempotent).
    """

    def __init__(self, agg: Aggregator, validator: Optional[ValidatorProcess], transport: MQTTProcess,
                 stop: threading.Event,
                 state: dict[str, Any], deferred: bool = False) -> None:
        self.agg = agg
        # deferred (Store.defer_sync): a group's commit returns before its fsync; the syncer thread runs
        # Store.sync_committed, then acknowledges, while the writer commits the next group
        self.deferred = deferred
        self._sync_broken = False  # an fsync failed: nothing is acknowledged any more
        self.synced: "queue.Queue[Any]" = queue.Queue(maxsize=SYNC_QUEUE)  # committed groups to sync, then ack
        self.validator = validator
        self.transport = transport
        self.stop = stop
        self.state = state
        self.q: "queue.Queue[Any]" = queue.Queue()  # lists of received messages
        self.valid: "queue.Queue[Any]" = queue.Queue()  # lists of (message, Pending)
        self.held = _Held(HELD_BYTES_MAX)  # bounds what the two queues and the threads hold
        # arrival times of the last two batches from the transport: _gather waits for more only while
        # messages keep coming (a lone release after a quiet spell is committed and acknowledged at once)
        self._put_at = (-1e9, -1e9)
        # the last arrivals: (gap since the one before, messages); a ring once full, written by the reader
        # thread, read by the writer (one tuple per slot: a reader never sees half an arrival)
        self._arrivals: list[tuple[float, int]] = []
        self._arrival_i = 0
        self._behind = False  # the last group was GROUP_ENOUGH already waiting in the queue
        self._busy = [False, False, False]
        self._dead = False
        self.groups = 0
        self.messages = 0
        self.pruned = 0
        # group commits tried again: "message" (a message the store refused alone), "outage" (the whole
        # transaction failed); the store's own re-runs of a deadlocked or busy transaction are
        # Store.retry_counts(). Logged at exit ("store retries:")
        self.retries: dict[str, int] = {"message": 0, "outage": 0}
        self._next_prune = 0.0
        self._kept_warned: frozenset[str] = frozenset()  # flagged devices whose kept payloads were logged
        # CPU seconds of this process per stage (thread CPU time, read once per batch): where a release's
        # cost goes, in the summary line at exit (host_tools/bench/host.py reads it)
        self.cpu: dict[str, float] = {"status": 0.0, "validation_ipc": 0.0, "pending": 0.0, "store": 0.0,
                                      "outcomes_acks": 0.0, "housekeeping": 0.0, "sync": 0.0}
        self.threads = [threading.Thread(target=self._validate_loop, name="pansketch-validate", daemon=True),
                        threading.Thread(target=self._write_loop, name="pansketch-writer", daemon=True)]
        if deferred:
            self.threads.append(threading.Thread(target=self._sync_loop, name="pansketch-sync", daemon=True))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def put(self, msgs: list[Msg]) -> None:
        """Queue received messages; waits while :data:`HELD_BYTES_MAX` is spent. Stopping (or a dead
        writer) drops them unqueued: nothing of them is acknowledged, the broker redelivers them."""
        now = time.monotonic()
        gap = now - self._put_at[1]
        if gap * 1000.0 < self.agg.cfg.aggregator.group_wait_ms:  # longer: a lull, not the inflow's rhythm
            if len(self._arrivals) < GAP_WINDOW:
                self._arrivals.append((gap, len(msgs)))
            else:
                self._arrivals[self._arrival_i] = (gap, len(msgs))
                self._arrival_i = (self._arrival_i + 1) % GAP_WINDOW
        self._put_at = (self._put_at[1], now)
        for i in range(0, len(msgs), GROUP_MAX):
            chunk = msgs[i:i + GROUP_MAX]
            if not self.held.take(_held_bytes(chunk), lambda: self.stop.is_set() or self._dead):
                return
            self.q.put(chunk)

    def idle(self) -> bool:
        # unfinished_tasks: groups put for the syncer and not yet acknowledged (none in a hand-over gap)
        return self.q.empty() and self.valid.empty() and not self.synced.unfinished_tasks and not any(self._busy)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._dead and not self.idle() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self, timeout: float = 8.0) -> None:
        self.q.put(None)
        deadline = time.monotonic() + timeout
        for t in self.threads[:2]:
            t.join(max(0.1, deadline - time.monotonic()))
        if self.deferred:  # after the writer: what it committed is synced and acknowledged first
            try:
                self.synced.put(None, timeout=max(0.1, deadline - time.monotonic()))
            except queue.Full:
                pass
            self.threads[2].join(max(0.1, deadline - time.monotonic()))

    @staticmethod
    def _take(q: "queue.Queue[Any]", first: Any, limit: int, size: Any) -> tuple[list[Any], bool]:
        batch = [first]
        n = size(first)
        while n < limit:
            try:
                m = q.get_nowait()
            except queue.Empty:
                break
            if m is None:
                return batch, True
            batch.append(m)
            n += size(m)
        return batch, False

    def _validate_loop(self) -> None:
        while True:
            first = self.q.get()
            if first is None:
                self.valid.put(None)
                return
            self._busy[0] = True
            chunks, end = self._take(self.q, first, GROUP_MAX, len)
            batch = [m for c in chunks for m in c]
            held, passed = _held_bytes(batch), 0  # the writer gives back what it is passed
            try:
                t0 = time.thread_time()
                # a device's status (gap detection) is recorded and acknowledged here, like a release
                batch = [m for m in batch if not devstatus.handle_message(self.agg.store, self.transport, m)]
                t1 = time.thread_time()
                self.cpu["status"] += t1 - t0
                if batch:
                    verdicts: list[Any] = [m.verdict for m in batch]  # the MQTT process validated them
                    todo = [i for i, v in enumerate(verdicts) if v is None]
                    if todo:  # AMQP: validated here, in the validation process
                        if self.validator is None:
                            raise RuntimeError("%d message(s) arrived without a validation verdict" % len(todo))
                        for i, v in zip(todo, self.validator.validate([(batch[i].topic, batch[i].payload)
                                                                       for i in todo])):
                            verdicts[i] = v
                    t2 = time.thread_time()
                    pend = [(m, self.agg.pending(m.topic, m.payload, v)) for m, v in zip(batch, verdicts)]
                    self.cpu["validation_ipc"] += t2 - t1
                    self.cpu["pending"] += time.thread_time() - t2
                    passed = _held_bytes(batch)
                    self.valid.put(pend)
            except ValidatorDied as exc:
                if self.validator is None or not self.validator.closing:  # stopping: what was not validated is not acknowledged
                    self._fatal(str(exc))
            except Exception as exc:  # verdict() turns validator bugs into rejections; this is worse
                log.exception("validator failed")
                self._fatal("validator failed: %s" % exc)
            finally:
                self.held.give(held - passed)  # device statuses, and whatever failed here
                self._busy[0] = False
            if end:
                self.valid.put(None)
                return

    def _write_loop(self) -> None:
        while True:
            first = self.valid.get()
            if first is None:
                return
            self._busy[1] = True
            chunks, end = self._gather(first)
            batch = [x for c in chunks for x in c]
            try:
                if not self._dead:
                    self.groups += 1
                    self.messages += len(batch)
                    self._store(batch)
                    t0 = time.thread_time()
                    try:
                        self._housekeeping()
                    except Exception as exc:  # housekeeping is retried after the next group; ingest goes on
                        log.warning("WAL checkpoint / retention failed (%s); trying again later", exc)
                    self.cpu["housekeeping"] += time.thread_time() - t0
            except Exception as exc:  # never let the writer die silently
                log.exception("writer failed")
                self._fatal("writer failed: %s" % exc)
            finally:
                self.held.give(_held_bytes([m for m, _p in batch]))
                self._busy[1] = False
            if end:
                return

    def _gather(self, first: Any) -> tuple[list[Any], bool]:
        """A group: what is validated now, then more for up to ``group_wait_ms`` (at most GROUP_MAX).

        Under steady load messages arrive a few at a time; committing each
        trickle alone costs an fsync and rewrites the touched pages (roll-up
        row, indexes) into the WAL per message. Waiting (200 ms by default)
        lets the group grow with the rate (about rate x wait), for at most
        that much added ack latency. Only while messages keep coming: when
        the last two arrivals were further apart than the idle gap
        (:meth:`idle_gap`: 20 ms, longer for clumped arrivals), no second
        message is likely soon, so the group is committed at once (a quiet
        fleet's release is acknowledged without the wait), and the wait ends
        when nothing arrives for the idle gap (the end of a burst, or a
        lull: the last group of a burst waited the whole
        ``group_wait_ms`` before, which halved ``make bench``'s ingest
        figure in one round of two at 200 ms). And only
        while the group is small: one of :data:`GROUP_ENOUGH` messages is
        committed at once, and what arrives meanwhile makes the next group
        (in a burst the wait only idled the writer: ``make bench``'s ingest,
        three interleaved pairs, 7,634 -> 8,114 releases/s median).
        """
        chunks, end = self._take(self.valid, first, GROUP_MAX, len)
        n = sum(len(c) for c in chunks)
        wait_s = self.agg.cfg.aggregator.group_wait_ms / 1000.0
        # behind (the last group was all backlog): a burst, whose last group must not wait for a rhythm
        gap = min(wait_s, IDLE_GAP_S) if self._behind else self.idle_gap(wait_s)
        self._behind = n >= GROUP_ENOUGH
        before, last = self._put_at
        if last - before > gap and n < 2:
            wait_s = 0.0
        deadline = time.monotonic() + wait_s
        while not end and n < GROUP_ENOUGH and not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                m = self.valid.get(timeout=min(left, gap))
            except queue.Empty:
                break
            if m is None:
                end = True
                break
            chunks.append(m)
            n += len(m)
            more, end = self._take(self.valid, chunks.pop(), GROUP_MAX - n + len(m), len)
            chunks += more
            n = sum(len(c) for c in chunks)
        return chunks, end

    def idle_gap(self, wait_s: float) -> float:
        """How long without an arrival ends a group's wait: :data:`IDLE_GAP_S`, or longer when the recent
        inflow came in clumps further apart (:data:`IDLE_GAP_CLUMPS`) and fast enough that the longer
        wait gathers :data:`CLUMP_MIN` messages; never past ``wait_s``."""
        arrivals = list(self._arrivals)  # a copy first: the reader may append meanwhile
        if not arrivals:
            return min(wait_s, IDLE_GAP_S)
        gaps = sorted(g for g, _n in arrivals)
        rhythm = min(wait_s, IDLE_GAP_CLUMPS * gaps[len(gaps) * 3 // 4])
        span = sum(gaps)
        rate = sum(n for _g, n in arrivals) / span if span > 0 else 0.0  # messages/s over the window
        if rhythm > IDLE_GAP_S and rate * rhythm >= CLUMP_MIN:
            return rhythm
        return min(wait_s, IDLE_GAP_S)

    def _housekeeping(self) -> None:
        """Between groups (every message before is committed and acknowledged): bound the WAL, and
        prune raw payloads past retention (a batch at a time; again after the next group while
        batches come back full, else every PRUNE_EVERY_S)."""
        a = self.agg.cfg.aggregator
        self.agg.store.checkpoint_if_large(a.wal_limit_mb << 20)
        now = time.monotonic()
        if a.retain_raw_s > 0 and now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S  # also when it fails: not again after every group
            # the payloads of flagged devices are kept (a purge must be able to subtract them); excluded
            # devices' are kept by the store itself
            sc = self.agg.flag_scanner
            keep = sc.devices if sc is not None else frozenset()
            for dev in sorted(keep - self._kept_warned):
                log.warning("retention keeps the payloads of flagged device %s (a purge can still subtract "
                            "them); `pansketch device exclude` or `purge` decides", dev)
            self._kept_warned |= keep
            n = self.agg.store.prune(time.time() - a.retain_raw_s, PRUNE_BATCH, keep=keep)
            self.pruned += n
            if n >= PRUNE_BATCH:
                self._next_prune = now

    def _fatal(self, why: str) -> None:
        self._dead = True
        if not self.state.get("fatal"):  # the first reason is the cause; what follows it is a consequence
            self.state["fatal"] = why
        self.stop.set()

    def _store(self, batch: list[tuple[Msg, Pending]]) -> None:
        msgs = [m for m, _p in batch]
        pend = [p for _m, p in batch]
        todo = list(range(len(batch)))
        done: list[tuple[int, Outcome]] = []
        delay = STORE_RETRY_MIN_S
        why = ""
        message_tries = 0
        outage_since: Optional[float] = None  # monotonic time of the first failed attempt of this group
        logged_at = 0.0
        attempts = 0
        while True:
            attempts += 1
            try:
                t0 = time.thread_time()
                self.agg.store.commit_group([pend[i] for i in todo], sync=not self.deferred)
                t1 = time.thread_time()
                self.cpu["store"] += t1 - t0
                outs = self.agg.handle_many([], pending=[pend[i] for i in todo], committed=True)
                self.cpu["outcomes_acks"] += time.thread_time() - t1
                done += list(zip(todo, outs))
                todo = []
                break
            except MessageError as exc:  # the others are committed: acknowledge them, retry the failed ones
                bad = {j for j, _e in exc.failed}
                done += [(todo[j], o) for j, o in enumerate(exc.outcomes) if j not in bad]
                why = str(exc)
                todo = [todo[j] for j in sorted(bad)]
                message_tries += 1
                if message_tries > MESSAGE_RETRIES:
                    break
                self.retries["message"] += 1
                log.warning("storing %d message(s) failed (%s); retrying", len(todo), why)
                time.sleep(STORE_RETRY_MIN_S * 2 ** (message_tries - 1))
                continue
            except Exception as exc:  # the transaction failed: nothing of the group is stored
                why = "%s: %s" % (type(exc).__name__, exc)
            now = time.monotonic()
            self.retries["outage"] += 1
            if outage_since is None:
                outage_since = now
            if now - logged_at >= STORE_OUTAGE_LOG_S:  # the first failure, then once per interval
                logged_at = now
                log.warning("the store is not answering (%s): %d message(s) wait, none acknowledged; retrying "
                            "every %g s at most, for as long as it takes (%.0f s so far, %d attempt(s))",
                            why, len(todo), STORE_RETRY_MAX_S, now - outage_since, attempts)
            if self.stop.wait(delay):  # stopping: leave the group unacknowledged (the broker redelivers it)
                why = "stopped during a store outage (%s)" % why
                break
            delay = min(delay * 2, STORE_RETRY_MAX_S)
        if outage_since is not None and not todo:
            log.warning("the store answers again after %.0f s (%d attempt(s)); %d message(s) stored",
                        time.monotonic() - outage_since, attempts, len(done))
        if self.deferred:
            if done:  # acknowledged by the syncer once on disk; the writer goes on with the next group
                self.synced.put((msgs, done))
        else:
            t0 = time.thread_time()
            self._ack(msgs, done)
            self.cpu["outcomes_acks"] += time.thread_time() - t0
        if todo:
            log.error("cannot store %d message(s) (first on %s): %s; stopping without acknowledging them",
                      len(todo), msgs[todo[0]].topic, why)
            self._fatal("storage failed: %s" % why)

    def _sync_loop(self) -> None:
        """Deferred syncs: make the committed groups durable (one fsync for all that are waiting), then
        acknowledge them, oldest first. A failed fsync stops the aggregator without acknowledging them
        (the broker redelivers them; storing is idempotent)."""
        while True:
            first = self.synced.get()
            if first is None:
                return
            self._busy[2] = True
            items, end = self._take(self.synced, first, SYNC_QUEUE + 1, lambda _g: 1)  # all that wait
            try:
                if self._sync_broken:
                    # after a failed fsync nothing is acknowledged again, even if a later fsync succeeds:
                    # the failed writes may be lost, and with them every WAL frame after them
                    raise OSError(errno.EIO, "an earlier fsync of the WAL failed")
                t0 = time.thread_time()
                try:
                    self.agg.store.sync_committed()
                except OSError:
                    self._sync_broken = True
                    raise
                self.cpu["sync"] += time.thread_time() - t0
                t0 = time.thread_time()
                for msgs, done in items:
                    self._ack(msgs, done)
                self.cpu["outcomes_acks"] += time.thread_time() - t0
            except OSError as exc:
                log.error("cannot make stored messages durable (fsync of the WAL: %s); stopping without "
                          "acknowledging %d message(s)", exc, sum(len(d) for _m, d in items))
                self._fatal("fsync failed: %s" % exc)
            except Exception as exc:  # never let the syncer die silently
                log.exception("syncer failed")
                self._fatal("syncer failed: %s" % exc)
            finally:
                self._busy[2] = False
                for _x in range(len(items) + end):  # the end marker was a task too
                    self.synced.task_done()
            if end:
                return

    def _ack(self, batch: list[Msg], done: list[tuple[int, Outcome]]) -> None:
        done.sort(key=lambda x: x[0])
        # committed: the broker may forget them (PUBACK), and so may the devices (host acks)
        self.transport.acknowledge([(batch[i].mid, batch[i].qos) for i, _o in done],
                                   group_acks([(batch[i].topic, o) for i, o in done]))
