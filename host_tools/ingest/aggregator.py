"""The aggregator: MQTT releases -> validation -> store (SQLite or PostgreSQL); ``pansketch aggregate``.

:class:`Aggregator` is the transport-free core: ``handle(topic, payload)``
validates one message (host_tools.ingest.decode), stores it idempotently
(host_tools.store.write) or logs the rejection with its reason, and returns an
:class:`Outcome`. :func:`run` connects it to a broker with paho-mqtt 2.x
(``CallbackAPIVersion.VERSION2``, MQTT v5):

* subscribes ``[aggregator] topic`` (default ``pansketch/+/release``) at
  QoS 1, as the shared subscription ``$share/<group>/<topic>`` when
  ``shared_group`` is set, so several aggregators split the load;
* two processes, so that no CPU work competes with the writer for this
  process's GIL (docs/HOST.md, "Performance")::

      mosquitto ──▶ MQTT process ──batches: verdicts + payloads──▶ aggregator
                   (host_tools.ingest.mqttproc: paho client,     │ validator thread: verdicts -> store items
                    validation under a CPU budget, reconnects)   │ writer thread: group commit ──▶ SQLite / PostgreSQL
                         ▲                                        │
                         └──── PUBACKs + host acks, after each commit

  the MQTT process validates each release as it arrives (a per-message
  CPU budget; a message that kills it is remembered, the process
  restarted, and the message refused as ``timeout`` when it killed it
  twice) and forwards it with its verdict; it sends what it is told; the
  validator thread turns verdicts into store items; the writer thread
  stores them as one group commit (one transaction; one bad message rolls
  back alone; host_tools.store.write), which amortises the fsync over the
  group. With ``[broker] kind = "rabbitmq"`` the AMQP client runs in a
  thread of this process and validation in a helper process of its own
  (host_tools.ingest.validproc), as before. If a helper process dies
  other than while validating a message, the aggregator stops with exit
  code 1 and says which (nothing committed is lost; what was not is
  redelivered); if the aggregator dies its helpers exit too;
* acknowledges a message only after its outcome is committed to the
  store (manual acks): a crash before the commit means the broker
  redelivers, and redelivery is harmless (idempotent store);
* after the commit, tells each device of the group, in one message per
  device: ``{"dev", "ok": [seq, ...]}`` on
  ``<prefix>/<device>/ack`` (QoS 1) for a stored release or a duplicate of
  one, ``{"dev", "bad": [[seq, code]]}`` for a release it will never store
  (docs/FORMAT.md section 7). The device deletes a release from its outbox
  only on that acknowledgement, so "delivered" means stored here;
* a persistent session (clean_start = False, session expiry
  ``session_expiry_s``) with a stable client id, so releases published
  while the aggregator is down wait in the broker; a shared-group member
  starts clean instead (session expiry 0 by default): its session, and
  its place in the group, end with its connection, so a member that dies
  does not keep taking its turn of the releases (mosquitto 2.0 hands
  offline members' sessions their share); what was in flight to it comes
  back as the devices' re-sends;
* TLS (CA, client certificate) and username/password from ``[broker]``;
  reconnects with capped exponential backoff (``reconnect_min_s`` ..
  ``reconnect_max_s``);
* ``until_idle``: exit 0 after that many seconds without a message
  (exit 1 if it never managed to connect); SIGINT/SIGTERM: store and
  acknowledge what was received, then exit 0 (the helpers ignore both
  signals and stop when told).

Hostile input (docs/HOST.md "Hostile input"): validation has a per-message
CPU budget in the process that validates (host_tools.ingest.mqttproc, or
host_tools.ingest.validproc for AMQP); refused messages are kept
bounded (host_tools.store.Limits); a valid release from the future (beyond
``max_clock_skew_s``) or with a seq jump beyond ``max_seq_jump`` is
quarantined, not stored, and not acknowledged.

Output (stderr, ``logging``): a line per connection and when the
subscription is in place, one per stored release (device, seq, what it covers, size), warnings for
rejections (at most 10 per ``reject_log_interval_s``, then a summary line) and lost connections, a summary at exit; ``-q`` keeps only the
warnings and errors, ``-v`` adds the MQTT client's packet log.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from agent.tomlconf import placeholder_salt_warning
from host_tools import hostconfig
from host_tools.logsetup import setup_logging
from host_tools.ingest import child
from host_tools.ingest import devstatus
from host_tools import metrics
from host_tools.ingest.decode import Rejected, Release, topic_device
from host_tools.hostconfig import HostConfig
from host_tools.ingest.mqttproc import Msg, MQTTProcess, Settings
from host_tools.store.rows import Limits, Pending
from host_tools.store.sql import SQLStore
from host_tools.store.backend import open_store
from host_tools.ingest.validproc import Settings as ValidationSettings
from host_tools.ingest.validproc import ValidatorDied, ValidatorProcess, Verdict, verdict

log = logging.getLogger("pansketch.aggregator")


@dataclass
class Outcome:
    """What happened to one message."""

    status: str  # 'stored' | 'duplicate' | 'rejected' | 'quarantined' | 'error' (database error: not stored)
    reason: Optional[str] = None
    code: Optional[str] = None
    device: Optional[str] = None
    key: Optional[tuple[str, int, int, int]] = None
    seq: Optional[int] = None

    @property
    def stored(self) -> bool:
        return self.status == "stored"

    def __str__(self) -> str:
        if self.status in ("rejected", "quarantined"):
            return "%s (%s): %s" % (self.status, self.code, self.reason)
        return self.status


class Aggregator:
    """Validate and store releases; one instance per process (thread-safe)."""

    def __init__(self, cfg: HostConfig, store: Optional[SQLStore] = None,
                 logger: Optional[logging.Logger] = None) -> None:
        self.cfg = cfg
        self.store = store if store is not None else open_store(cfg.aggregator.db)
        self.log = logger or log
        self.counts = {"stored": 0, "duplicate": 0, "rejected": 0, "quarantined": 0}
        a = cfg.aggregator
        self.validation = ValidationSettings(cfg.fleet, a.max_bytes, a.topic, a.validate_cpu_s)
        self.store.limits = Limits(keep_bytes=a.reject_keep_bytes, max_rows=a.rejections_max_rows,
                                   max_bytes=a.rejections_max_bytes, retention_s=a.rejections_retention_s,
                                   quarantine_rows=a.quarantine_max_rows, quarantine_bytes=a.quarantine_max_bytes,
                                   max_seq_jump=a.max_seq_jump)
        self.warnings = RateLimitedWarnings(self.log, a.reject_log_interval_s)
        self._lock = threading.Lock()

    def close(self) -> None:
        self.store.close()

    def handle(self, topic: str, payload: bytes, received: Optional[float] = None) -> Outcome:
        """Validate and store one message. Storage errors (disk full...) propagate."""
        return self.handle_many([(topic, payload)], received)[0]

    def validate(self, topic: str, payload: bytes, received: Optional[float] = None) -> Pending:
        """Decode and validate one message (no storage): a :class:`Pending` for the store."""
        return self.pending(topic, payload, verdict(self.validation, topic, payload), received)

    def pending(self, topic: str, payload: bytes, v: Verdict, received: Optional[float] = None) -> Pending:
        """The :class:`Pending` for one message and its validation verdict (host_tools.ingest.validproc)."""
        now = time.time() if received is None else received
        payload = bytes(payload)
        if v[0] == "ok":
            rel = Release.from_state(v[1], payload)
            p = Pending(payload, topic, now, rel=rel, device=rel.dev)
            skew = self.cfg.aggregator.max_clock_skew_s
            if rel.t0 > now + skew:  # no honest device releases epochs that have not started
                p.quarantine = Rejected("future", "epochs [%s, %s) start more than %g s (aggregator.max_clock_skew_s) "
                                                  "after the host's clock (%s)"
                                        % (_utc(rel.t0), _utc(min(rel.t1, 1 << 40)), skew, _utc(int(now))))
            return p
        dev, seq = (v[3], v[4]) if len(v) >= 5 else (None, None)
        return Pending(payload, topic, now, rej=Rejected(v[1], v[2]),
                       device=topic_device(topic, self.cfg.aggregator.topic) if topic else None, seq=seq, pdev=dev)

    def handle_many(self, msgs: Sequence[tuple[str, bytes]], received: Optional[float] = None,
                    pending: Optional[Sequence[Pending]] = None, committed: bool = False) -> list[Outcome]:
        """Validate and store messages in one transaction (a savepoint each); outcomes in order.

        A database error that concerns one message alone (rolled back to its
        savepoint) raises :class:`MessageError` for it after the others are
        committed; a failure of the transaction raises and stores nothing.
        ``committed``: ``pending`` went through ``store.commit_group`` already (only the outcomes are made).
        """
        items = list(pending) if pending is not None else [self.validate(t, p, received) for t, p in msgs]
        if not committed:
            self.store.commit_group(items)
        out: list[Outcome] = []
        failed: list[tuple[int, BaseException]] = []
        stored: Optional[list[str]] = [] if self.log.isEnabledFor(logging.INFO) else None
        for i, p in enumerate(items):
            if p.status == "error":
                assert p.error is not None
                failed.append((i, p.error))
                out.append(Outcome("error", str(p.error), None, p.device, None, None))
                continue
            out.append(self._outcome(p, stored))
        if stored:
            info_lines(self.log, stored)
        if failed:
            raise MessageError(out, failed)
        return out

    def _outcome(self, p: Pending, stored: Optional[list[str]] = None) -> Outcome:
        """The outcome of one committed message, logged; a stored release's INFO line is added to
        ``stored`` (written by :func:`info_lines` after the group) when it is given."""
        if p.status == "rejected":
            assert p.rej is not None
            self.warnings.warn(p.rej.code, "rejected message on %s (%d bytes): %s: %s"
                               % (str(p.topic)[:200], len(p.payload), p.rej.code, p.rej.reason[:300]))
            self._count("rejected")
            metrics.record(self, "rejected", p.rej.code, None, p.received)
            return Outcome("rejected", p.rej.reason, p.rej.code, p.device, None,
                           p.rel.seq if p.rel is not None else p.seq)
        rel = p.rel
        assert rel is not None
        if p.status == "quarantined":
            q = p.quarantine
            assert q is not None
            self.warnings.warn(q.code, "quarantined release %s seq %d epochs [%d, %d) part %d: %s: %s"
                               % (rel.dev, rel.seq, rel.elo, rel.ehi, rel.part, q.code, q.reason))
            self._count("quarantined")
            metrics.record(self, "quarantined", q.code, None, p.received)
            return Outcome("quarantined", q.reason, q.code, rel.dev, rel.key, rel.seq)
        if p.status == "duplicate":
            self.log.info("duplicate of stored release %s seq %d epochs [%d, %d) part %d ignored",
                          rel.dev, rel.seq, rel.elo, rel.ehi, rel.part)
        elif stored is not None:
            stored.append("stored %s seq %d: %s, %d bytes" % (rel.dev, rel.seq, _span(rel), len(p.payload)))
        elif self.log.isEnabledFor(logging.INFO):
            info_lines(self.log, ["stored %s seq %d: %s, %d bytes" % (rel.dev, rel.seq, _span(rel), len(p.payload))])
        self._count(p.status)
        metrics.record(self, p.status, None, rel.t1, p.received)
        return Outcome(p.status, None, None, rel.dev, rel.key, rel.seq)

    def _count(self, k: str) -> None:
        with self._lock:
            self.counts[k] += 1


LINE_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"  # host_tools.logsetup's


def _plain_handler(lg: logging.Logger) -> Optional[logging.StreamHandler]:  # type: ignore[type-arg]
    """The one handler ``lg``'s INFO records reach, if it is a plain stream handler with the line format
    of host_tools.logsetup, nothing filters them and no other handler sees them (``pansketch
    aggregate``); None otherwise (e.g. under pytest's log capture)."""
    if lg.filters:
        return None
    found: Optional[logging.StreamHandler] = None  # type: ignore[type-arg]
    c: Optional[logging.Logger] = lg
    while c is not None:
        for h in c.handlers:
            f = h.formatter
            if (found is not None or type(h) is not logging.StreamHandler or h.filters or h.level > logging.INFO
                    or f is None or type(f) is not logging.Formatter or f._fmt != LINE_FORMAT):
                return None
            found = h
        if not c.propagate:
            break
        c = c.parent
    return found


def info_lines(lg: logging.Logger, lines: list[str]) -> None:
    """Log ``lines`` at INFO, one record each (operators and tests read one line per stored release).

    To the plain stderr handler of ``pansketch aggregate`` (:func:`_plain_handler`) they are written
    as logging would write them, with the time of the group, in one write: one LogRecord per line,
    its caller lookup, formatting and a flushed write each cost about as much as storing the
    release's row. Otherwise one record per line through the logger's handlers.
    """
    h = _plain_handler(lg)
    if h is None:
        for line in lines:
            lg.handle(lg.makeRecord(lg.name, logging.INFO, "aggregator.py", 0, "%s", (line,), None))
        return
    prefix = h.format(lg.makeRecord(lg.name, logging.INFO, "aggregator.py", 0, "", (), None))
    text = "".join([prefix + line + h.terminator for line in lines])
    h.acquire()
    try:
        h.stream.write(text)
        h.flush()
    except Exception:  # what logging does with a failed write: report it, never raise
        h.handleError(lg.makeRecord(lg.name, logging.INFO, "aggregator.py", 0, "%s", (text[:200],), None))
    finally:
        h.release()


class MessageError(Exception):
    """Some messages of a group hit a database error of their own (the rest is committed)."""

    def __init__(self, outcomes: list[Outcome], failed: list[tuple[int, BaseException]]) -> None:
        Exception.__init__(self, "; ".join("message %d: %s" % (i, e) for i, e in failed))
        self.outcomes = outcomes
        self.failed = failed


class RateLimitedWarnings:
    """Warning lines for refused messages, at most ``burst`` per ``interval`` s; then one summary line per
    interval with the counts per code of those not shown (a flood of garbage must not flood the log)."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, burst: int = 10) -> None:
        self.log = logger
        self.interval = interval
        self.burst = burst
        self._start = time.monotonic()
        self._shown = 0
        self._hidden: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, code: str, line: str) -> None:
        with self._lock:
            self._roll(time.monotonic())
            if self._shown < self.burst:
                self._shown += 1
                self.log.warning("%s", line)
            else:
                self._hidden[code] = self._hidden.get(code, 0) + 1

    def flush(self) -> None:
        """Say what was not shown (called at exit, and whenever an interval ends)."""
        with self._lock:
            self._roll(time.monotonic(), force=True)

    def _roll(self, now: float, force: bool = False) -> None:
        if not force and now - self._start < self.interval:
            return
        if self._hidden:
            self.log.warning("%d more message(s) refused or quarantined in the last %.0f s (not shown one by one): %s",
                             sum(self._hidden.values()), now - self._start,
                             ", ".join("%s %d" % kv for kv in sorted(self._hidden.items(), key=lambda kv: -kv[1])))
        self._start = now
        self._shown = 0
        self._hidden = {}


def _ack_entry(out: Outcome) -> Optional[tuple[str, Any]]:
    """What a host acknowledgement says of one outcome: ``("ok", seq)``, ``("bad", [seq, code])`` or None.

    Stored and duplicate releases are acknowledged as stored; a rejected one
    whose seq is known as refused for good, except ``internal`` (a validator
    bug: the device should keep it and send it again after the fix),
    ``timeout`` and ``topic``; a quarantined one is not acknowledged.
    """
    if out.device is None or out.seq is None:
        return None
    if out.status in ("stored", "duplicate"):
        return ("ok", out.seq)
    # not for quarantined releases (the device keeps re-sending: a window from the future is stored once
    # its time has come), nor for refusals that are the host's own limits (internal, timeout)
    if out.status == "rejected" and out.code is not None and out.code not in ("internal", "topic", "timeout"):
        return ("bad", [out.seq, out.code])
    return None


def ack_topic(release_topic: str) -> str:
    """``<prefix>/<device>/release`` -> ``<prefix>/<device>/ack``."""
    return release_topic.rsplit("/", 1)[0] + "/ack"


_UTC: dict[int, str] = {}  # epoch boundaries shown in the log lines (a few per window; cleared when large)


def _utc(t: int) -> str:
    s = _UTC.get(t)
    if s is None:
        if len(_UTC) >= 4096:
            _UTC.clear()
        s = _UTC[t] = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(t))
    return s


def _span(rel: Any) -> str:
    """What a release covers, for one log line: its window, or its epochs inside the window."""
    if rel.mode == "window" and rel.ehi - rel.elo == 1:
        what = "window %s (%d s)" % (_utc(rel.elo * rel.ep_s), rel.win_s)
    else:
        what = "epochs %s..%s (window %s)" % (_utc(rel.elo * rel.ep_s), _utc(rel.ehi * rel.ep_s),
                                            _utc(rel.win * rel.win_s))
    return what + (" part %d" % rel.part if rel.part else "")


def group_acks(done: Sequence[tuple[str, Outcome]]) -> list[tuple[str, bytes]]:
    """One acknowledgement per device for a committed group: (ack topic, payload), in first-seen order.

    docs/FORMAT.md section 7: one message may acknowledge several releases
    of one device (``ok`` and ``bad`` lists); the rules per outcome are
    those of :func:`_ack_entry`.
    """
    docs: dict[str, dict[str, Any]] = {}
    for topic, out in done:
        e = _ack_entry(out)
        if e is None:
            continue
        t = ack_topic(topic)
        doc = docs.get(t)
        if doc is None:
            doc = docs[t] = {"dev": out.device}
        doc.setdefault(e[0], []).append(e[1])
    enc = _ACK_JSON.encode
    return [(t, enc(d).encode()) for t, d in docs.items()]


_ACK_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps with separators builds an encoder per call


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


class _Writer:
    """Validates and stores what the MQTT process received: a validator and a writer thread.

    The validator thread has whatever has queued up validated by the
    validation process (``validator``) and records device status messages;
    the writer thread stores what is validated (at most :data:`GROUP_MAX`
    messages) as one group commit (a savepoint per message), and only then
    acknowledges each message to the broker (PUBACK) and publishes the host
    acknowledgements to the devices (one per device per group), both in one
    request to the MQTT process (``transport``). Validation of the next
    messages overlaps the commit. A failed transaction is retried 3 times
    with backoff; then the aggregator stops without acknowledging anything
    of that group (the broker redelivers it; storing is idempotent).
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
        self._next_prune = 0.0
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
            n = self.agg.store.prune(time.time() - a.retain_raw_s, PRUNE_BATCH)
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
        delay = 0.5
        why = ""
        for attempt in range(4):
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
            except Exception as exc:  # the transaction failed: nothing of the group is stored
                why = "%s: %s" % (type(exc).__name__, exc)
            if attempt == 3:
                break
            log.warning("storing %d message(s) failed (%s); retrying", len(todo), why)
            time.sleep(delay)
            delay *= 2
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


def run(cfg: HostConfig, until_idle: Optional[float] = None, stop: Optional[threading.Event] = None,
        ready: Optional[threading.Event] = None, counts: Optional[dict[str, int]] = None) -> int:
    """Aggregate from the broker until stopped (SIGINT/SIGTERM, ``stop``) or idle.

    The MQTT client and validation run in helper processes
    (host_tools.ingest.mqttproc, host_tools.ingest.validproc); this process stores and
    decides every acknowledgement. ``ready`` is set once the subscription
    is acknowledged; ``counts``, if given, receives the numbers of
    stored/duplicate/rejected messages at exit. Returns an exit code (1
    also when a helper process dies).
    """
    stop = stop or threading.Event()
    agg = Aggregator(cfg)
    agg.store.background_checkpoints(drop_behind=cfg.aggregator.drop_cache_behind_mb << 20)
    cid = hostconfig.default_client_id(cfg)
    sub = cfg.aggregator.subscription
    state: dict[str, Any] = {"last": time.monotonic(), "connected": False, "ever": False, "fatal": None, "closing": False,
                             "fail_logged": -1e9}
    persistent = cfg.aggregator.session_expiry_s > 0 and (bool(cfg.broker.client_id) or not cfg.aggregator.shared_group)
    if persistent and cfg.aggregator.shared_group:
        # mosquitto 2.0 keeps handing an offline member's session its turn of the group's messages
        log.warning("shared_group %r with session_expiry_s = %d: if this aggregator dies, the broker keeps "
                    "giving its session a share of the releases for up to %d s (held there until the devices "
                    "re-send them, not lost); session_expiry_s = 0 (the default with a shared group) avoids it",
                    cfg.aggregator.shared_group, cfg.aggregator.session_expiry_s, cfg.aggregator.session_expiry_s)
    # releases (maybe a shared subscription) and every device's retained status
    # (never shared: each aggregator keeps its own copy; gap detection)
    # the MQTT process validates releases before it forwards them (host_tools.ingest.mqttproc._Judge)
    settings = Settings(cfg.broker, cid, ((sub, cfg.aggregator.qos), (devstatus.status_filter(cfg), 1)), persistent,
                        cfg.aggregator.session_expiry_s, RECEIVE_MAXIMUM, verbose=log.isEnabledFor(logging.DEBUG),
                        validation=agg.validation)

    where = "%s:%d" % (cfg.broker.host, cfg.broker.port)  # for the log
    if cfg.broker.kind == "rabbitmq":
        where = "AMQP " + ", ".join("%s:%d" % n for n in cfg.broker.amqp_nodes)

    def fatal(why: str) -> None:
        state["fatal"] = why
        stop.set()

    def on_event(ev: tuple[Any, ...]) -> None:
        """Connection events of the MQTT process (its reader thread)."""
        kind = ev[0]
        if kind == "connected":
            state["connected"] = state["ever"] = True
            state["fail_logged"] = -1e9
            # the MQTT process says how many host acknowledgements it keeps in flight (the broker's Receive Maximum)
            log.info("connected to %s as %s; subscribing %s%s", where, cid, sub,
                     "" if len(ev) < 2 else " (host acknowledgements in flight: up to %d)" % ev[1])
        elif kind == "refused":
            log.error("broker %s refused the connection: %s", where, ev[1])
        elif kind == "subscribed" and ev[1] is not None:
            log.error("broker refused the subscription to %s: %s", sub, ev[1])
            fatal("subscription refused: %s" % ev[1])
        elif kind == "subscribed":
            state["last"] = time.monotonic()  # --until-idle counts from here: start-up is not idleness
            log.info("subscribed to %s (QoS %d%s); storing releases in %s", sub, cfg.aggregator.qos,
                     ", persistent session" if persistent else ", clean session", cfg.aggregator.db)
            if ready is not None:
                ready.set()
        elif kind == "connect_failed":
            now = time.monotonic()
            if now - state["fail_logged"] >= 60:  # once a minute while the broker stays unreachable
                state["fail_logged"] = now
                log.warning("cannot connect to broker %s; retrying (up to %g s apart)", where,
                            cfg.broker.reconnect_max_s)
        elif kind == "disconnected":
            state["connected"] = False
            if not stop.is_set() and not state["closing"]:
                log.warning("disconnected from broker (%s); reconnecting", ev[1])
        elif kind == "dropped":
            state["dropped"] = state.get("dropped", 0) + ev[1]
            now = time.monotonic()
            if now - state.get("drop_logged", -1e9) >= 60:  # once a minute while a flood lasts
                state["drop_logged"] = now
                log.warning("dropped %d QoS 0 messages (%d in all): more than %d were waiting for validation "
                            "(a QoS 0 flood? devices publish releases at QoS 1 and re-send them until "
                            "acknowledged)", ev[1], state["dropped"], ev[2])
        elif kind == "restarted":
            log.warning("MQTT process restarted (validating a message %s)", ev[1])
        elif kind == "exited":
            fatal("the MQTT process (pid %s) exited unexpectedly (%s)" % (transport.pid, child.exit_status(ev[1])))

    def on_messages(msgs: list[Msg]) -> None:
        state["last"] = time.monotonic()
        writer.put(msgs)

    transport: Any
    validator: Optional[ValidatorProcess] = None
    if cfg.broker.kind == "rabbitmq":  # a quorum queue over AMQP (host_tools/ingest/amqp.py)
        from host_tools.ingest import amqp

        sub = "queue %s on %s" % (cfg.broker.queue, ", ".join("%s:%d" % n for n in cfg.broker.amqp_nodes))
        transport = amqp.AMQPTransport(amqp.Settings(cfg.broker, cfg.aggregator.topic, RECEIVE_MAXIMUM, cid),
                                       on_messages, on_event)
        # pika delivers in this process: validation in a helper process of its own (CPU budget there)
        validator = ValidatorProcess(agg.validation)
    else:
        transport = MQTTProcess(settings, on_messages, on_event)
    # SQLite: group commits return before their fsync, which the writer's syncer thread runs before any
    # acknowledgement (Store.defer_sync); PostgreSQL commits are durable when they return
    writer = _Writer(agg, validator, transport, stop, state, deferred=agg.store.defer_sync())
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, lambda *_a: stop.set())
    warning = placeholder_salt_warning("fleet.salt", cfg.fleet.salt, "in every device's config")
    if warning:
        log.warning("%s", warning)
    cpu0 = time.process_time()
    try:
        if validator is not None:
            validator.start()
        writer.start()
        transport.start()
        start = time.monotonic()
        while not stop.is_set():
            stop.wait(0.05)
            try:
                if validator is not None:
                    validator.check()
            except ValidatorDied as exc:
                fatal(str(exc))
            if until_idle is not None and time.monotonic() - state["last"] > until_idle and writer.idle():
                break
        writer.drain(5.0)  # messages already received: store and acknowledge them before disconnecting
        if state["fatal"]:
            log.error("stopping: %s", state["fatal"])
            return 1
        if not state["ever"]:
            log.error("could not connect to broker %s within %.0f s", where,
                      time.monotonic() - start)
            return 1
        return 0
    finally:
        state["closing"] = True  # our own disconnect is not a lost connection
        # bounded, well below systemd's 30 s stop timeout: MQTT child <= 10 s, validation helper <= 2 s
        # (killed if busy: what it was validating is not acknowledged and comes again), threads <= 8 s
        transport.close()
        if validator is not None:
            validator.close()
        writer.close()
        agg.warnings.flush()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        c = agg.counts
        guard: Any = validator if validator is not None else transport  # whichever process validated
        restarts, timeouts = getattr(guard, "restarts", 0), getattr(guard, "timeouts", 0)
        if counts is not None:
            counts.update(c)
        log.info("aggregator stopped: %d stored, %d duplicates, %d rejected, %d quarantined; %d group commit(s), "
                 "%.1f messages per group%s", c["stored"], c["duplicate"], c["rejected"], c["quarantined"],
                 writer.groups, writer.messages / max(1, writer.groups),
                 "; %s restarted %d time(s), %d timeout(s)"
                 % ("validation helper" if validator is not None else "MQTT process", restarts, timeouts)
                 if restarts else "")
        if writer.held.waits:
            log.info("received messages held here peaked at %.1f MB: the MQTT process waited %d time(s) for the "
                     "store to catch up (at most %d MB are held)", writer.held.peak / 1e6, writer.held.waits,
                     HELD_BYTES_MAX >> 20)
        ck = getattr(agg.store, "checkpoints", None)
        if ck is not None:
            # one line at exit, also under -q (the soak benchmark reads it)
            summary = logging.getLogger("pansketch.aggregator.summary")
            summary.setLevel(logging.INFO)
            summary.info("WAL checkpoints: %d completed, %d gave up (readers); %d pruned (retention); %d group "
                         "commit(s), %.1f messages per group", ck[1], ck[0], writer.pruned, writer.groups,
                         writer.messages / max(1, writer.groups))
        cpu = dict(writer.cpu)
        cpu["receive"] = getattr(transport, "cpu_s", 0.0)
        cpu["process_total"] = time.process_time() - cpu0  # all threads: the stages and the rest
        child.log_stage_cpu("aggregator", cpu, writer.messages)
        agg.close()


# -- CLI ---------------------------------------------------------------------
def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("aggregate", help="subscribe to releases and store them",
                              description="Subscribe to device releases over MQTT, validate each one, store it "
                                          "idempotently in SQLite and log rejections (docs/HOST.md).")
    p.add_argument("--config", required=True, metavar="FILE", help="host config TOML")
    p.add_argument("--until-idle", type=float, metavar="SECONDS",
                   help="exit after this many seconds without a message")
    v = p.add_mutually_exclusive_group()
    v.add_argument("-v", "--verbose", action="store_true", help="also log the MQTT client's packets (debug)")
    v.add_argument("-q", "--quiet", action="store_true",
                   help="log only warnings and errors (rejections, lost connections), not each stored release")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="serve Prometheus metrics on http://BIND:N/metrics (host_tools/metrics.py)")
    p.add_argument("--metrics-bind", default="127.0.0.1", metavar="ADDR", help="address for --metrics-port (127.0.0.1)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cfg = hostconfig.load_for_command(args.config)
    if cfg is None:
        return 2
    if args.until_idle is not None and args.until_idle <= 0:
        print("pansketch aggregate: --until-idle must be positive", file=sys.stderr)
        return 2
    setup_logging(args.verbose, getattr(args, "quiet", False))
    exporter = None
    if getattr(args, "metrics_port", None) is not None:
        try:
            exporter = metrics.start_aggregator_exporter(cfg.aggregator.db, args.metrics_port, args.metrics_bind,
                                                         cfg.query.delta)
        except (ImportError, OSError) as exc:
            print("pansketch aggregate: --metrics-port: %s" % exc, file=sys.stderr)
            return 2
        log.info("metrics on http://%s:%d/metrics", *exporter.server.server_address[:2])
    try:
        return run(cfg, until_idle=args.until_idle)
    except Exception as exc:  # e.g. the database cannot be opened
        print("pansketch aggregate: %s" % exc, file=sys.stderr)
        return 1
    finally:
        if exporter is not None:
            exporter.close()
