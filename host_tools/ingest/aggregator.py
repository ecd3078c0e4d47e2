"""The aggregator's transport-free core: validate a message, store it, say what happened.

:class:`Aggregator`: ``handle(topic, payload)`` validates one message
(pansketch.host_tools.ingest.decode), stores it idempotently (pansketch.host_tools.store.write)
or logs the rejection with its reason, and returns an :class:`Outcome`.
The service that feeds it from a broker (``pansketch aggregate``) is
pansketch.host_tools.ingest.service; its validate -> store -> acknowledge threads are
pansketch.host_tools.ingest.pipeline, the acknowledgements pansketch.host_tools.ingest.acks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pansketch.host_tools import metrics
from pansketch.host_tools.hostconfig import HostConfig
from pansketch.host_tools.ingest.decode import Rejected, Release, topic_device
from pansketch.host_tools.ingest.loglines import RateLimitedWarnings, _span, _utc, info_lines
from pansketch.host_tools.ingest.validproc import Settings as ValidationSettings
from pansketch.host_tools.ingest.validproc import Verdict, verdict
from pansketch.host_tools.store.backend import open_store
from pansketch.host_tools.store.rows import Limits, Pending
from pansketch.host_tools.store.sql import SQLStore

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
        self.store = store if store is not None else open_store(cfg.aggregator.db, compress=cfg.store.compress)
        self.log = logger or log
        self.counts = {"stored": 0, "duplicate": 0, "rejected": 0, "quarantined": 0}
        self.flag_scanner: Any = None  # pansketch.host_tools.metrics.FlagScanner when run as the service
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
        """The :class:`Pending` for one message and its validation verdict (pansketch.host_tools.ingest.validproc)."""
        now = time.time() if received is None else received
        payload = bytes(payload)
        if v[0] == "ok":
            rel = Release.from_state(v[1], payload)
            p = Pending(payload, topic, now, rel=rel, device=rel.dev)
            skew = self.cfg.aggregator.max_clock_skew_s
            if len(v) >= 4:  # valid, but over [fleet] max_events_per_window (pansketch.host_tools.store.bounds)
                p.quarantine = Rejected(v[2], v[3])
            elif rel.t0 > now + skew:  # no honest device releases epochs that have not started
                p.quarantine = Rejected("future", "epochs [%s, %s) start more than %g s (aggregator.max_clock_skew_s) "
                                                  "after the host's clock (%s)"
                                        % (_utc(rel.t0), _utc(min(rel.t1, 1 << 40)), skew, _utc(int(now))))
            past = self.cfg.aggregator.max_past_s
            if past > 0 and rel.t1 < now - past:  # a clock at 1970 or 2000, or a forgery of old windows
                p.quarantine = Rejected("past", "epochs [%s, %s) ended more than %.0f days (aggregator.max_past_s) "
                                                "before the host's clock (%s)"
                                        % (_utc(rel.t0), _utc(rel.t1), past / 86400, _utc(int(now))))
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


class MessageError(Exception):
    """Some messages of a group hit a database error of their own (the rest is committed)."""

    def __init__(self, outcomes: list[Outcome], failed: list[tuple[int, BaseException]]) -> None:
        Exception.__init__(self, "; ".join("message %d: %s" % (i, e) for i, e in failed))
        self.outcomes = outcomes
        self.failed = failed
