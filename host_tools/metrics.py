"""Prometheus metrics (prometheus_client) for ``pansketch aggregate --metrics-port`` and ``pansketch serve``.

Two sources, both exported by ``aggregate --metrics-port N`` (from its
own HTTP listener) and the store half by ``serve`` (on ``/metrics``):

* the aggregator process (:class:`AggregatorMetrics`, fed by one
  :func:`record` call per handled message):
  ``pansketch_aggregator_messages_total{outcome="stored|duplicate|rejected"}``,
  ``pansketch_aggregator_rejections_total{code}``,
  ``pansketch_aggregator_ingest_lag_seconds`` (histogram: receive time minus
  the end of the release's epochs; a device that was offline shows up here),
  ``pansketch_aggregator_last_message_timestamp_seconds`` and, once the
  aggregator keeps one, ``pansketch_aggregator_ack_backlog``
  (acknowledgements not yet published);
* the store, read when its change counter moved (:class:`StoreCollector`: an
  unchanged store costs a scrape one row read; the same for every aggregator
  sharing the database, so scrape it from one process):
  ``pansketch_store_releases_total``, ``pansketch_store_duplicates_total``,
  ``pansketch_store_rejections_total{code}``, ``pansketch_store_size_bytes``
  (database + WAL), ``pansketch_store_devices``,
  ``pansketch_device_last_seen_timestamp_seconds{device}`` (last release
  received), ``pansketch_device_last_epoch_end_timestamp_seconds{device}``,
  ``pansketch_device_releases_total{device}``, gap counters from
  ``pansketch status`` (``pansketch_device_missing_releases{device}``,
  ``pansketch_device_missing_epochs{device}``) and, when status reports
  them, ``pansketch_device_delivery_releases{device,state="lost|pending|late|rejected"}``
  plus their fleet sum for pending, ``pansketch_ack_backlog_releases``
  (releases devices still hold, waiting for a host acknowledgement).

Metric values are counts of releases and times, never event counts or
estimates: nothing here depends on the data beyond what ``status`` shows --
except the query kinds' own metrics (pansketch.host_tools.query.kinds, field ``metrics``),
exported by ``serve`` (which knows the fleet salt) and computed at most once per
``QUERY_TTL_S`` per store state: ``pansketch_strhh_heavy_estimate{rank,item}``
(``_lower``, ``_upper``), ``pansketch_strhh_heavy_strings`` and
``pansketch_strhh_heavy_until_timestamp_seconds``, the answer of ``pansketch
query heavy -k 10`` over the last day of strhh releases (noisy releases
post-processed: what any query answers, docs/PRIVACY.md); a kind whose query
fails counts in ``pansketch_query_metric_errors{kind}``.

Imported by ingest (the aggregator's exporter) and web; reads the store and,
for the gap and delivery gauges, pansketch.host_tools.query.status (never ingest or web).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional

# prometheus_client (the ``web`` extra) is imported where it is used, so that importing this
# module -- the aggregator does, for the :func:`record` hook -- never needs it.

# emitted only once ``status`` reports delivery states (host acknowledgements)
CONDITIONAL_METRICS = ("pansketch_device_delivery_releases", "pansketch_ack_backlog_releases")
QUERY_TTL_S = 60.0  # a query kind's metrics are recomputed at most this often, unless the store changed
LAG_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 86400, 7 * 86400, float("inf"))
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def store_size(path: str) -> int:
    """Bytes on disk of the SQLite database and its WAL / shared-memory files."""
    n = 0
    for suffix in ("", "-wal", "-shm"):
        try:
            n += os.path.getsize(path + suffix)
        except OSError:
            pass
    return n


STORE_TTL_S = 60.0  # the store's metrics are read again at least this often (status ages with the clock)
REFRESH_INLINE_S = 0.5  # a read of the store that took longer is redone in the background, not in a scrape


class StoreCollector:
    """Reads the release database (read-only) when it changed, else answers from the last read.

    The store's change counter (SQLStore.change_count: every write transaction moves it) is read at
    each scrape; while it is unchanged and the families are younger than STORE_TTL_S, a scrape
    returns them as they are: one read of one row, whatever the store's size. When the store
    changed, the families are read again within the scrape while that costs little (the last read
    took at most REFRESH_INLINE_S); past that (a large fleet: status reads every release) the scrape
    returns the last families and one background thread reads new ones, so a scrape stays cheap and
    the numbers are at most one read old (``pansketch_store_metrics_age_seconds`` says by how much).
    """

    def __init__(self, db: str, delta: float = 1e-6, with_status: bool = True,
                 late_grace_s: Optional[float] = None, salt: Optional[str] = None) -> None:
        self.db = db
        self.delta = delta
        self.with_status = with_status
        self.late_grace_s = late_grace_s
        self.salt = salt
        self._query_cache: dict[str, tuple[Any, float, list[Any]]] = {}
        self.query_errors: dict[str, int] = {}
        # (change count read before the families were, monotonic time of that read, its cost in s, families)
        self._cached: Optional[tuple[Optional[int], float, float, list[Any]]] = None
        self._refreshing = threading.Lock()
        self._cache_lock = threading.Lock()

    def describe(self) -> Iterable[Any]:  # no scrape at registration time
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from pansketch.host_tools.store.backend import open_store

        t_start = time.perf_counter()
        up = GaugeMetricFamily("pansketch_store_up", "1 when the release database could be read")
        size = GaugeMetricFamily("pansketch_store_size_bytes", "bytes on disk of the database, its WAL and shm")
        size.add_metric([], store_size(self.db))
        try:
            st = open_store(self.db, readonly=True)
        except Exception:
            up.add_metric([], 0)
            yield up
            yield size
            return
        try:
            out, age = self._families(st)
        except Exception:
            up.add_metric([], 0)
            out, age = [], 0.0
        else:
            up.add_metric([], 1)
        finally:
            st.close()
        yield up
        yield size
        yield from out
        dur = GaugeMetricFamily("pansketch_store_scrape_duration_seconds", "time to read the store for this scrape")
        dur.add_metric([], time.perf_counter() - t_start)
        yield dur
        old = GaugeMetricFamily("pansketch_store_metrics_age_seconds",
                                "how long ago the store metrics of this scrape were read from the store")
        old.add_metric([], age)
        yield old

    def _families(self, st: Any) -> tuple[list[Any], float]:
        """The store's families and their age in seconds (class docstring)."""
        ver = st.change_count()
        now = time.monotonic()
        with self._cache_lock:
            c = self._cached
        if c is not None and ver is not None and c[0] == ver and now - c[1] < STORE_TTL_S:
            return c[3], now - c[1]
        if c is not None and c[2] > REFRESH_INLINE_S:
            if self._refreshing.acquire(blocking=False):
                threading.Thread(target=self._refresh, name="pansketch-store-metrics", daemon=True).start()
            return c[3], now - c[1]
        return self._read(st, ver), 0.0

    def _read(self, st: Any, ver: Optional[int]) -> list[Any]:
        t = time.monotonic()
        out = list(self._collect(st))
        with self._cache_lock:
            self._cached = (ver, t, time.monotonic() - t, out)
        return out

    def _refresh(self) -> None:
        from pansketch.host_tools.store.backend import open_store

        try:
            st = open_store(self.db, readonly=True)
            try:
                self._read(st, st.change_count())
            finally:
                st.close()
        except Exception:  # the next scrape tries again; until then it serves the last good families
            with self._cache_lock:
                if self._cached is not None:
                    ver, t, cost, out = self._cached
                    self._cached = (None, t, cost, out)
        finally:
            self._refreshing.release()

    def _collect(self, st: Any) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rel = CounterMetricFamily("pansketch_store_releases", "releases stored (all devices)")
        rel.add_metric([], st.release_count())
        yield rel
        dup = CounterMetricFamily("pansketch_store_duplicates", "duplicate deliveries recognised and ignored")
        dup.add_metric([], st.duplicate_count())
        yield dup
        rej = CounterMetricFamily("pansketch_store_rejections", "messages rejected, by reason code", labels=["code"])
        for code, n, _last in st.rejection_counts():
            rej.add_metric([str(code)], n)
        yield rej
        act = st.device_activity()
        ndev = GaugeMetricFamily("pansketch_store_devices", "devices with at least one stored release")
        ndev.add_metric([], len(act))
        yield ndev
        seen = GaugeMetricFamily("pansketch_device_last_seen_timestamp_seconds",
                                 "unix time the last release of the device was received", labels=["device"])
        end = GaugeMetricFamily("pansketch_device_last_epoch_end_timestamp_seconds",
                                "end (unix time) of the latest epoch the device released", labels=["device"])
        cnt = CounterMetricFamily("pansketch_device_releases", "releases stored per device", labels=["device"])
        for dev, n, last, t1 in act:
            seen.add_metric([dev], float(last))
            end.add_metric([dev], float(t1))
            cnt.add_metric([dev], n)
        yield seen
        yield end
        yield cnt
        yield from self._influence(st)
        if self.with_status:
            yield from self._status(st)
        if self.salt:
            yield from self._queries(st, act)

    def _influence(self, st: Any) -> Iterable[Any]:
        """Bounded influence (docs/HOST.md "Flagged devices"): releases quarantined by code (code
        ``bound``: over the contribution limit), excluded devices, and devices flagged in the latest
        windows -- recomputed like the query metrics, at most once per QUERY_TTL_S per store state."""
        from prometheus_client.core import GaugeMetricFamily

        from pansketch.host_tools.query import influence
        from pansketch.host_tools.store import exclusions

        q = GaugeMetricFamily("pansketch_store_quarantined_releases", "distinct releases held back (not merged), "
                              "by code (bound: over [fleet] max_events_per_window)", labels=["code"])
        codes: dict[str, int] = {}
        for row in st.quarantined():
            codes[str(row[6])] = codes.get(str(row[6]), 0) + 1
        for code in sorted(codes):
            q.add_metric([code], codes[code])
        yield q
        excl = exclusions.excluded(st)
        ex = GaugeMetricFamily("pansketch_device_excluded", "1: the device is left out of every answer "
                               "(pansketch device exclude)", labels=["device"])
        for dev in sorted(excl):
            ex.add_metric([dev], 1)
        yield ex
        snap = influence.flag_state(st)  # the store's change counter, else the flag windows' generations
        now = time.monotonic()
        cached = self.__dict__.get("_flag_cache")
        if cached is None or cached[0] != (snap, tuple(sorted(excl))) or now - cached[1] > QUERY_TTL_S:
            per: dict[str, int] = {}
            for f in influence.recent_flags(st, exclude=excl):
                per[f.device] = per.get(f.device, 0) + 1
            cached = ((snap, tuple(sorted(excl))), now, per)
            self.__dict__["_flag_cache"] = cached
        fl = GaugeMetricFamily("pansketch_device_flagged_windows", "recent windows in which the device's "
                               "contribution was out of line with the rest of the fleet", labels=["device"])
        for dev, n in sorted(cached[2].items()):
            fl.add_metric([dev], n)
        yield fl
        tot = GaugeMetricFamily("pansketch_flagged_device_windows", "flagged device-windows among the latest "
                                "windows (all devices)")
        tot.add_metric([], sum(cached[2].values()))
        yield tot

    def _queries(self, st: Any, act: list[Any]) -> Iterable[Any]:
        """The query kinds' metrics (pansketch.host_tools.query.kinds), recomputed when the store changed
        and QUERY_TTL_S passed: a scrape every few seconds must not run a descent each time."""
        from prometheus_client.core import CounterMetricFamily

        from pansketch.host_tools.query import kinds

        state = (st.release_count(), max((a[3] for a in act), default=0))
        now = time.monotonic()
        for qk in kinds.KINDS:
            if qk.metrics is None:
                continue
            hit = self._query_cache.get(qk.name)
            if hit is not None and (hit[0] == state or now - hit[1] < QUERY_TTL_S):
                fams = hit[2]
            else:
                try:
                    fams = qk.metrics(st, self.salt or "")
                except Exception:
                    self.query_errors[qk.name] = self.query_errors.get(qk.name, 0) + 1
                    fams = []
                self._query_cache[qk.name] = (state, now, fams)
            yield from fams
        err = CounterMetricFamily("pansketch_query_metric_errors", "query-kind metrics that failed to compute",
                                  labels=["kind"])
        for k, n in sorted(self.query_errors.items()):
            err.add_metric([k], n)
        yield err

    def _status(self, st: Any) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from pansketch.host_tools.query import fleetview
        from pansketch.host_tools.query import status

        rep = status.report(st, self.delta, windows=0, late_grace_s=self.late_grace_s)
        miss = GaugeMetricFamily("pansketch_device_missing_releases",
                                 "sequence numbers between the device's first and last stored release never "
                                 "received", labels=["device"])
        mep = GaugeMetricFamily("pansketch_device_missing_epochs",
                                "epochs between the device's first and last release that no release covers",
                                labels=["device"])
        dlv = GaugeMetricFamily("pansketch_device_delivery_releases",
                                "releases per delivery state (from status: host acknowledgements)",
                                labels=["device", "state"])
        backlog: Optional[int] = None
        for d in rep["devices"]:
            miss.add_metric([d["device"]], d.get("missing_seq_count", 0) or 0)
            mep.add_metric([d["device"]], d.get("missing_epoch_count", 0) or 0)
            for k, v in fleetview.delivery(d).items():
                if v is not None:
                    dlv.add_metric([d["device"], k], v)
                    if k == "pending":
                        backlog = (backlog or 0) + v
        yield miss
        yield mep
        yield dlv
        if backlog is not None:
            b = GaugeMetricFamily("pansketch_ack_backlog_releases",
                                  "releases the devices still hold, waiting for a host acknowledgement")
            b.add_metric([], backlog)
            yield b


class AggregatorMetrics:
    """Process metrics of one aggregator, plus the store collector, in one registry."""

    def __init__(self, db: Optional[str] = None, delta: float = 1e-6) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.messages = Counter("pansketch_aggregator_messages", "messages handled, by outcome", ["outcome"],
                                registry=r)
        for o in ("stored", "duplicate", "rejected"):
            self.messages.labels(o)
        self.rejections = Counter("pansketch_aggregator_rejections", "messages rejected by this process, by reason",
                                  ["code"], registry=r)
        self.lag = Histogram("pansketch_aggregator_ingest_lag_seconds",
                             "time from the end of a release's epochs to its storage (stored and duplicate)",
                             buckets=LAG_BUCKETS, registry=r)
        self.last = Gauge("pansketch_aggregator_last_message_timestamp_seconds",
                          "unix time of the last message handled", registry=r)
        self._agg: Optional[Callable[[], Any]] = None
        self.backlog = Gauge("pansketch_aggregator_ack_backlog",
                             "acknowledgements this aggregator has not yet published (NaN: not tracked)", registry=r)
        self.backlog.set_function(self._backlog)
        if db is not None:
            r.register(StoreCollector(db, delta))
        self.server: Any = None

    def _backlog(self) -> float:
        agg = self._agg() if self._agg is not None else None
        if agg is None:
            return float("nan")
        for name in ("ack_backlog", "acks_pending", "pending_acks"):
            v = getattr(agg, name, None)
            if v is None:
                continue
            try:
                v = v() if callable(v) else v
                return float(len(v) if hasattr(v, "__len__") else v)
            except Exception:
                return float("nan")
        return float("nan")

    def observe(self, agg: Any, status: str, code: Optional[str], t1: Optional[int], now: float) -> None:
        if self._agg is None or self._agg() is not agg:
            self._agg = weakref.ref(agg)
        self.messages.labels(status).inc()
        if status == "rejected":
            self.rejections.labels(code or "?").inc()
        elif t1 is not None:
            self.lag.observe(max(0.0, now - t1))
        self.last.set(now)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[str, int]:
        """Start the HTTP listener (a daemon thread); returns the bound address."""
        from prometheus_client import start_http_server

        self.server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        host, bound = self.server.server_address[:2]
        return host, bound

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        deactivate(self)


_ACTIVE: list[AggregatorMetrics] = []
_LOCK = threading.Lock()


def activate(m: AggregatorMetrics) -> AggregatorMetrics:
    """Make :func:`record` feed ``m``."""
    with _LOCK:
        if m not in _ACTIVE:
            _ACTIVE.append(m)
    return m


def deactivate(m: AggregatorMetrics) -> None:
    with _LOCK:
        if m in _ACTIVE:
            _ACTIVE.remove(m)


def record(agg: Any, status: str, code: Optional[str] = None, t1: Optional[int] = None,
           now: Optional[float] = None) -> None:
    """Hook called by the aggregator for every handled message (no-op without an active exporter)."""
    if not _ACTIVE:
        return
    now = time.time() if now is None else now
    for m in list(_ACTIVE):
        m.observe(agg, status, code, t1, now)


def start_aggregator_exporter(db: str, port: int, addr: str = "127.0.0.1", delta: float = 1e-6) -> AggregatorMetrics:
    """Registry with process + store metrics, served on addr:port, fed by :func:`record`."""
    m = AggregatorMetrics(db, delta)
    m.serve(port, addr)
    return activate(m)


def store_registry(db: str, delta: float = 1e-6, late_grace_s: Optional[float] = None,
                   salt: Optional[str] = None) -> Any:
    """A registry with only the store metrics (what ``serve`` exposes on /metrics); with the fleet
    ``salt`` also the query kinds' metrics."""
    from prometheus_client import CollectorRegistry

    r = CollectorRegistry(auto_describe=False)
    r.register(StoreCollector(db, delta, late_grace_s=late_grace_s, salt=salt))
    return r


FLAG_CPU_SHARE = 0.02  # of each scan interval, at most, computing kept flags (the aggregator's own process)


class FlagScanner:
    """The aggregator's log of flagged devices (docs/HOST.md "Flagged devices"): every ``interval`` s, the
    latest ``windows`` windows of the store are compared (pansketch.host_tools.query.influence, excluded devices
    left out) and each flagged (device, window) is logged once, as a warning; ``devices`` holds the
    devices flagged in the last scan (retention keeps their payloads: pansketch.host_tools.ingest.pipeline).
    Each scan first computes and keeps the flags of the recent windows whose releases changed
    (pansketch.host_tools.query.influence.refresh: each window's payloads read once per change, not per
    ``status`` call; newest first, within FLAG_CPU_SHARE of the interval of CPU time per scan, so that a
    store whose windows all change faster than that costs ingest at most that share). In this module because ingest may not import query; runs in a thread of its own,
    on a connection of its own."""

    def __init__(self, db: str, logger: Any, interval: float = 300.0, windows: int = 2, max_events: Any = None) -> None:
        self.db = db
        self.max_events = max_events
        self.log = logger
        self.interval = interval
        self.windows = windows
        self.devices: frozenset[str] = frozenset()
        self._logged: set[tuple[str, int, int]] = set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def scan(self) -> list[Any]:
        from pansketch.host_tools.query import influence
        from pansketch.host_tools.store.backend import open_store

        # the flags of every recent window whose releases changed, computed once and kept in the store
        # (status, metrics and the dashboard read them there), then the latest few logged
        with open_store(self.db) as st:
            influence.refresh(st, max_events=self.max_events, cpu_budget_s=FLAG_CPU_SHARE * self.interval)
            flags = influence.recent_flags(st, windows=self.windows, max_events=self.max_events)
        for f in flags:
            k = (f.device, f.win_s, f.win)
            if k not in self._logged:
                if len(self._logged) > 100_000:  # bounded: a restart of the set only repeats old lines once
                    self._logged.clear()
                self._logged.add(k)
                self.log.warning("device %s FLAGGED in window %d (%d s): %s; `pansketch status` shows it, "
                                 "`pansketch device exclude %s` leaves it out of the answers",
                                 f.device, f.win, f.win_s, f.reason, f.device)
        self.devices = frozenset(f.device for f in flags)
        return flags

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    self.scan()
                except Exception as exc:  # a busy or half-written store: the next scan tries again
                    self.log.debug("flag scan failed: %s", exc)

        self._thread = threading.Thread(target=loop, name="flag-scan", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
