"""Scale-out on PostgreSQL, shown by the cost of a stored release rather than by the rate.

    python -m pansketch.host_tools.bench.pgscale [--pg-aggregators 1,2,4] [--rounds 3] [--pg-warm]
        [--devices 400 --per-device 12] [--pg-sample-ms 50] [--out bench-results/host-pg-scaleout.json]
        [--pace-per-aggregator R]

The ingest benchmark's publishers, releases and helpers (pansketch.host_tools.bench.host), in a mode
of its own. On a 2-core machine one aggregator's ingest already keeps most of both cores busy, so N aggregators
cannot be shown faster than one there; what can be shown on any machine is that adding aggregators
adds no work per release: the same releases through one mosquitto into one PostgreSQL server
(deploy/OPERATIONS.md section 6: a shared subscription, every aggregator writing the one database),
with 1, 2 and 4 aggregators, and for each run:

* CPU seconds per stored release of every process, from /proc/PID/stat (user + system): each
  aggregator with its child processes (MQTT, validation), the PostgreSQL server (the postmaster and
  all its children: sessions, WAL writer, checkpointer, autovacuum workers; those that exited during
  the run through the postmaster's cutime/cstime), less the backend of the benchmark's own watching
  session; mosquitto; the publishers apart (the load generator, not part of the cost);
* releases stored (rows in ``releases``) vs sent (PUBACKed to the publishers): none may be lost;
* lock waits on the write path, sampled every ``--pg-sample-ms`` (50) from a separate session:
  ``pg_stat_activity`` wait events of the aggregators' sessions (``Lock:*`` = a heavyweight lock,
  ``LWLock:*`` a server-internal one) and ``pg_locks`` rows not granted, with the waiting statement
  and what it waited on;
* retries: each aggregator's exit line (``store retries:``: group commits tried again, transactions
  the store rolled back and ran again by SQLSTATE) and the database's rollbacks and deadlocks
  (``pg_stat_database``).

The runs of a round alternate their order of N; the figures are medians over the rounds, and the
ratio of every N to 1 is taken round by round (same machine state, minutes apart). The machine
these figures come from is shared and loaded: only CPU time is compared, never wall time (the
rate is printed, not judged).

Two modes. Flat out (the default): the publishers send as fast as they can, so the machine fixes
the total rate and each of N aggregators gets 1/N of it; its groups (what one commit holds,
gathered over ``group_wait_ms``) are then smaller and a group's fixed cost is paid more often per
release. That is not what N aggregators on N hosts see: there each gets its own share of a fleet
N times larger, the same rate as one aggregator alone. ``--pace-per-aggregator R`` measures that:
the publishers are paced to N x R releases per second in all (each aggregator receives R per
second in every configuration), R chosen so that N x R still fits on the machine, which each run
checks: the offered rate (sent over the publishing time) against the stored rate (stored over the
time until the last one was stored) and the lag of the last release; a run whose store fell behind
is marked ``queued``, one whose publishers could not send the asked rate ``publishers_behind``.
The writer sessions' in-turn runs (:func:`sessions_in_turn`) are a flat-out figure and are
skipped in this mode.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from pansketch.host_tools import localnet
from pansketch.host_tools.localnet import Mosquitto

_TICK = os.sysconf("SC_CLK_TCK")


def _stats() -> dict[int, tuple[int, float, float]]:
    """pid -> (ppid, own CPU s, reaped children's CPU s) of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                f_ = f.read().rsplit(")", 1)[1].split()
            out[int(d)] = (int(f_[1]), (int(f_[11]) + int(f_[12])) / _TICK, (int(f_[13]) + int(f_[14])) / _TICK)
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree_cpu(pids: dict[str, int], stats: Optional[dict[int, tuple[int, float, float]]] = None) -> dict[str, float]:
    """CPU seconds so far of each named process with all its descendants, living or reaped (a child's
    CPU moves into its parent's cutime/cstime when the parent waits for it, so the sum only grows)."""
    st = _stats() if stats is None else stats
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _own, _reaped) in st.items():
        kids.setdefault(ppid, []).append(pid)

    def total(pid: int) -> float:
        if pid not in st:
            return 0.0
        return st[pid][1] + st[pid][2] + sum(total(c) for c in kids.get(pid, ()))

    return {name: total(pid) for name, pid in pids.items()}


class LockWatch:
    """Samples, from its own session, what the aggregators' sessions of one database wait on.

    Every ``interval`` s: each session with ``application_name`` pansketch that is not idle counts one
    sample under its wait event (``CPU`` when it waits for none, ``idle in transaction`` when the server
    waits for the aggregator); every ``pg_locks`` row not granted in the database counts under its lock
    type, mode and relation, with the waiting statement's start and the blocking sessions' statements.
    The same session counts the stored releases (:meth:`stored`), so its backend is the one the
    benchmark subtracts from the server's CPU (:attr:`backend_pid`)."""

    def __init__(self, dsn: str, interval: float = 0.05) -> None:
        import psycopg

        self.con = psycopg.connect(dsn, autocommit=True, application_name="pansketch-bench-watch")
        self.backend_pid = int(self.con.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        self.dbname = str(self.con.execute("SELECT current_database()").fetchone()[0])  # type: ignore[index]
        self.interval = interval
        self.polls = 0
        self.waits: dict[str, int] = {}
        self.not_granted: dict[str, int] = {}
        self.lock_statements: dict[str, int] = {}
        self.polls_with_lock_wait = 0
        self._mu = threading.Lock()  # the poller and stored() share the one connection
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.before = self._db_stats()

    def _db_stats(self) -> tuple[int, int]:
        with self._mu:
            self.con.execute("SELECT pg_stat_clear_snapshot()")
            row = self.con.execute("SELECT xact_rollback, deadlocks FROM pg_stat_database WHERE datname = %s",
                                   (self.dbname,)).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def stored(self) -> int:
        with self._mu:
            row = self.con.execute("SELECT count(*) FROM releases").fetchone()
        return int(row[0]) if row else 0

    def _poll(self) -> None:
        with self._mu:
            acts = self.con.execute(
                "SELECT state, wait_event_type, wait_event, left(query, 60) FROM pg_stat_activity WHERE datname = %s "
                "AND application_name = 'pansketch' AND state IS DISTINCT FROM 'idle'", (self.dbname,)).fetchall()
            locks = self.con.execute(
                "SELECT l.locktype, l.mode, coalesce(l.relation::regclass::text, ''), left(a.query, 60), "
                "(SELECT string_agg(DISTINCT left(b.query, 60), ' | ') FROM pg_stat_activity b "
                " WHERE b.pid = ANY(pg_blocking_pids(l.pid))) "
                "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE NOT l.granted AND a.datname = %s", (self.dbname,)).fetchall()
        for state, wtype, wev, query in acts:
            k = ("idle in transaction" if state == "idle in transaction"
                 else "CPU" if wtype is None else "%s:%s" % (wtype, wev))
            self.waits[k] = self.waits.get(k, 0) + 1
            if wtype == "Lock":  # which statement waited (pg_locks, sampled apart, may miss a short wait)
                q = "%s in: %s" % (k, " ".join(query.split()))
                self.lock_statements[q] = self.lock_statements.get(q, 0) + 1
        for locktype, mode, rel, query, blockers in locks:
            k = "%s %s %s; waiting: %s; blocked by: %s" % (locktype, mode, rel or "-", " ".join(query.split()),
                                                          " ".join((blockers or "?").split()))
            self.not_granted[k] = self.not_granted.get(k, 0) + 1
        if any(lt != "extend" for lt, *_r in locks) or any(w == "Lock" and e != "extend" for _s, w, e, _q in acts):
            self.polls_with_lock_wait += 1
        self.polls += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll()

    def __enter__(self) -> "LockWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def result(self) -> dict[str, Any]:
        time.sleep(0.6)  # sessions that ended have sent their statistics
        after = self._db_stats()
        self.con.close()
        # a row, transaction, advisory or table lock: one writer waiting for another's transaction. Apart:
        # "extend", two sessions adding pages to one table at once (held while a page is added, not to
        # the end of a transaction), and LWLocks (the server's internal locks: WAL buffers, buffer pages)
        lock_samples = sum(v for k, v in self.waits.items() if k.startswith("Lock:") and k != "Lock:extend")
        return {"polls": self.polls, "session_samples": sum(self.waits.values()),
                "lock_wait_samples": lock_samples, "extend_wait_samples": self.waits.get("Lock:extend", 0),
                "lwlock_wait_samples": sum(v for k, v in self.waits.items() if k.startswith("LWLock:")),
                "locks_not_granted_samples": sum(v for k, v in self.not_granted.items() if not k.startswith("extend ")),
                "polls_with_lock_wait": self.polls_with_lock_wait,
                "locks_not_granted": dict(sorted(self.not_granted.items(), key=lambda kv: -kv[1])),
                "wait_events": dict(sorted(self.waits.items(), key=lambda kv: -kv[1])),
                "lock_wait_statements": dict(sorted(self.lock_statements.items(), key=lambda kv: -kv[1])),
                "rollbacks": after[0] - self.before[0], "deadlocks": after[1] - self.before[1]}


def _exit_lines(log: str) -> dict[str, Any]:
    """What an aggregator's exit lines say: its counts and its retries."""
    from pansketch.host_tools.ingest.service import RETRIES_LINE
    import re

    out: dict[str, Any] = {"retries": None}
    try:
        text = open(log).read()
    except OSError:
        return out
    m = re.search(r"aggregator stopped: (\d+) stored, (\d+) duplicates, (\d+) rejected, (\d+) quarantined; "
                  r"(\d+) group commit\(s\), ([0-9.]+) messages per group", text)
    if m:
        out.update(stored=int(m[1]), duplicates=int(m[2]), rejected=int(m[3]), quarantined=int(m[4]),
                   group_commits=int(m[5]), messages_per_group=float(m[6]))
    for ln in text.splitlines():
        if RETRIES_LINE in ln:
            out["retries"] = json.loads(ln.split(RETRIES_LINE, 1)[1])
    warned = [ln for ln in text.splitlines() if "retrying" in ln or "deadlock" in ln.lower()]
    out["retry_warnings"] = len(warned)
    return out


def _paced_publisher(where: tuple[int, float], batches: list[list[tuple[str, bytes]]], start: Any, done: Any,
                     tag: str) -> None:
    """A publisher process of ``--pace-per-aggregator``: ``where`` = (broker port, releases per second
    of this process); its devices interleaved as in host.publish_interleaved, message ``i`` sent at
    ``i / rate`` s after ``start`` (at once when behind). Puts (published, seconds from start to the last
    PUBACK, the latest a message went out after its time, time.monotonic() of the last PUBACK) on
    ``done``, before its clients disconnect (300 of them take a few tenths of a second, which would
    count as publishing time): a publisher that fell behind offered less than asked."""
    from pansketch.host_tools.bench import host

    port, rate = where
    clients = host.connect_devices(port, batches, tag)
    order = host.interleaved(clients)
    start.wait()
    t0 = time.monotonic()
    late = 0.0
    infos = []
    for i, (c, (topic, payload)) in enumerate(order):
        due = t0 + i / rate
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        else:
            late = max(late, now - due)
        infos.append(c.publish(topic, payload, qos=1))
    for inf in infos:
        inf.wait_for_publish(120)
    t_last = time.monotonic()
    done.put((len(infos), t_last - t0, late, t_last))
    for c, _m in clients:
        c.disconnect()
        c.loop_stop()


def _pace_verdict(asked: float, offered: float, lag_s: float, sent: int, stored: int) -> dict[str, bool]:
    """``queued``: the store fell behind the publishers (the last release stored more than a group's wait
    and a second after the last was sent, or not all stored); ``publishers_behind``: the publishers
    offered less than 97 % of the asked rate (the machine could not send it: each aggregator then
    received less than the rate asked, though what it received was stored as it came)."""
    return {"queued": bool(lag_s > 1.2 or stored < sent), "publishers_behind": bool(offered < 0.97 * asked)}


def _rows(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT count(*) FROM releases").fetchone()
    return int(row[0]) if row else 0


def warmup_bursts(msgs: list[tuple[str, bytes]], per_aggregator: int, k: int, bursts: int) -> list[list[tuple[str, bytes]]]:
    """``bursts`` lists of ``per_aggregator`` x ``k`` releases like ``msgs`` (their counters, devices and
    parameters) in windows long before theirs: fed to the aggregators before the measured run, a burst at
    a time, so that each process has run its first groups (imports, the compressor, psycopg's prepared
    statements after 5 runs of a query, the server's plans) before its CPU is counted, as in a running
    deployment. Without it each added aggregator added its own start-up to the figures: with 4 x 1,200
    releases, 20-40 % more CPU per release."""
    import array

    from pansketch.agent import release
    from pansketch.agent.params import Params
    from pansketch.host_tools.bench import host
    from pansketch.host_tools.ingest.decode import decode

    firsts: dict[str, bytes] = {}
    for t, raw in msgs:
        firsts.setdefault(t, raw)
    n = per_aggregator * k
    if n > len(firsts):
        raise ValueError("warm-up bursts of %d need as many devices (%d)" % (n, len(firsts)))
    out = []
    for b in range(bursts):
        burst = []
        for t, raw in list(firsts.items())[:n]:
            r = decode(raw, t)
            p = Params({"device": r.dev, "salt": host.SALT, "kind": r.kind, "d": r.d, "w": r.w})
            ctr = array.array("i")
            ctr.frombytes(r.counters().ravel().astype("<i4").tobytes())
            elo = host.EPOCH0 - 1000 + b
            burst.append((t, release.encode(p, 0, elo, elo + 1, 0, ctr)))
        out.append(burst)
    return out


def one_run(msgs: list[tuple[str, bytes]], k: int, dsn: str, pg_pid: int, tmp: str, tag: str, workers: int,
            sample_s: float, already: int = 0, warmup: Optional[list[list[tuple[str, bytes]]]] = None,
            pace: Optional[float] = None) -> dict[str, Any]:
    """``k`` aggregators on a shared subscription store ``msgs`` into ``dsn``; the figures of the module
    docstring. ``warmup``: bursts stored first, each in turn, outside the measurement (:func:`warmup_bursts`).
    ``pace``: the publishers send this many releases per second in all (:func:`_paced_publisher`), not
    flat out; the run then reports the offered and the stored rate."""
    if pace is not None and pace <= 0:
        raise ValueError("pace must be a positive rate (releases per second), not %r" % pace)
    from pansketch.host_tools.bench import host

    broker = Mosquitto(tmp, conf_extra="max_queued_messages 0")
    aggs: list[subprocess.Popen[bytes]] = []
    logs = [os.path.join(tmp, "agg-%s-%d.log" % (tag, i)) for i in range(k)]
    ctx = mp.get_context("fork")
    try:
        for i in range(k):
            conf = os.path.join(tmp, "host-%s-%d.toml" % (tag, i))
            with open(conf, "w") as f:
                f.write('[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "agg-%s-%d"\n'
                        '[aggregator]\ndb = "%s"\nmax_bytes = 65536\nshared_group = "aggs"\n'
                        '[fleet]\nsalt = "%s"\n' % (broker.port, tag, i, dsn, host.SALT))
            aggs.append(subprocess.Popen(
                [sys.executable, "-m", "pansketch.host_tools.cli", "aggregate", "--config", conf, "--until-idle", "20"],
                env=host._env(), stdout=subprocess.DEVNULL, stderr=open(logs[i], "w")))
        deadline = time.monotonic() + 60
        while not all("subscribed to" in open(lf).read() for lf in logs) and time.monotonic() < deadline:
            time.sleep(0.05)
        warm = 0
        for burst in warmup or []:
            localnet.publish(broker.port, burst, "bench-warmup")
            warm += len(burst)
            wait_until = time.monotonic() + 60
            while _rows(dsn) < already + warm and time.monotonic() < wait_until:
                time.sleep(0.05)
        already += warm
        if pace is None:
            pubs, start, done = host.start_publishers(ctx, host._publisher, broker.port, msgs, workers, tag)
        else:
            pubs, start, done = host.start_publishers(ctx, _paced_publisher, (broker.port, pace / workers), msgs,
                                                      workers, tag)
        time.sleep(1.5)  # publishers connected
        with LockWatch(dsn, sample_s) as watch:
            names = {"aggregator %d" % i: a.pid for i, a in enumerate(aggs)}
            names.update({"postgres": pg_pid, "mosquitto": broker.pid, "watch session": watch.backend_pid})
            names.update({"publisher %d" % i: p.pid for i, p in enumerate(pubs) if p.pid is not None})
            cpu0 = tree_cpu(names)
            t0 = time.monotonic()
            start.set()
            got = [done.get(timeout=600) for _ in pubs]
            # paced: until the last PUBACK (the publishers' own clock, CLOCK_MONOTONIC as this one's)
            published_s = (max(g[3] for g in got) if pace is not None else time.monotonic()) - t0
            sent = sum(g[0] if isinstance(g, tuple) else g for g in got)
            while watch.stored() < len(msgs) + already and time.monotonic() - t0 < 120:
                time.sleep(0.01)
            wall = time.monotonic() - t0
            cpu1 = tree_cpu(names)
        stored = watch.stored() - already
        server = watch.result()
        for p in pubs:
            p.join(30)
    finally:
        localnet.stop_processes(aggs, 60)  # (a loaded machine: the aggregator's own shutdown is bounded at about 20 s)
        broker.stop()
    cpu = {n: max(0.0, cpu1[n] - cpu0[n]) for n in names}
    cpu["postgres"] = max(0.0, cpu["postgres"] - cpu.pop("watch session"))  # the benchmark's own session
    per = {n: round(v / max(1, stored) * 1e6, 1) for n, v in sorted(cpu.items())}
    aggs_us = sum(v for n, v in per.items() if n.startswith("aggregator"))
    exits = [_exit_lines(lf) for lf in logs]
    retries: dict[str, int] = {}
    for e in exits:
        for key, v in (e["retries"] or {}).items():
            retries[key] = retries.get(key, 0) + v
    own = []  # each aggregator's CPU per release it stored itself (its share of the shared subscription)
    for i, e in enumerate(exits):
        if e.get("stored"):
            own.append(round(cpu["aggregator %d" % i] / e["stored"] * 1e6, 1))
    paced: dict[str, Any] = {}
    if pace is not None:
        offered = sent / max(1e-9, published_s)
        stored_rate = stored / max(1e-9, wall)
        paced = {"pace_asked": pace, "offered_per_second": round(offered, 1),
                 "stored_per_second": round(stored_rate, 1),
                 "stored_over_offered": round(stored_rate / max(1e-9, offered), 3),
                 "publishing_seconds": round(published_s, 3),
                 "last_stored_after_last_sent_s": round(wall - published_s, 3),
                 "publisher_late_max_s": round(max(g[2] for g in got), 3),
                 **_pace_verdict(pace, offered, wall - published_s, sent, stored)}
    return {"aggregators": k, "releases": len(msgs), **paced,
            "cpu_us_per_own_release_each_aggregator": own, "sent": sent, "stored": stored, "lost": sent - stored,
            "seconds": round(wall, 3), "releases_per_second": round(stored / wall, 1),
            "cpu_us_per_release": per, "cpu_us_per_release_aggregators": round(aggs_us, 1),
            "cpu_us_per_release_total": round(aggs_us + per["postgres"] + per["mosquitto"], 1),
            "retries": retries, "retries_total": sum(retries.values()),
            "retry_warnings": sum(e["retry_warnings"] for e in exits),
            "retries_missing": sum(1 for e in exits if e["retries"] is None),
            "aggregator_exit": exits, "server": server,
            "stages_cpu_us_per_message": {role: host._stage_cpu(logs, role) for role in ("aggregator", "MQTT")}, "loadavg_1min": round(os.getloadavg()[0], 2)}


def run(srv: Any, msgs: list[tuple[str, bytes]], args: Any, tmp: str) -> dict[str, Any]:
    """Every N of ``--pg-aggregators`` in each of ``--rounds`` rounds (order alternating), a fresh
    database per run; the medians and the round-by-round ratios to the first N."""
    from pansketch.host_tools.bench import host

    ks = [int(k) for k in args.pg_aggregators.split(",")]
    per_agg = getattr(args, "pace_per_aggregator", None)
    with open(os.path.join(srv.data, "postmaster.pid")) as f:
        pg_pid = int(f.readline())
    out: dict[str, Any] = {"server": "PostgreSQL from %s, fsync on, synchronous_commit on" % srv.bindir,
                           "warm": bool(args.pg_warm), "sample_ms": args.pg_sample_ms,
                           "releases_per_run": len(msgs), "cpus": os.cpu_count(),
                           "pace_per_aggregator": per_agg,
                           "note": "CPU time, not wall time, is compared: the machine is shared and loaded",
                           "rounds": []}
    for r in range(args.rounds):
        rnd: dict[str, Any] = {}
        for k in (ks if r % 2 == 0 else ks[::-1]):
            name = "scale_r%d_k%d" % (r, k)
            dsn = srv.create_database(name)
            already = host._warm(dsn, msgs) if args.pg_warm else 0
            host._checkpoint(srv.dsn())
            res = one_run(msgs, k, dsn, pg_pid, tmp, "sc%d-%d" % (r, k), args.workers, args.pg_sample_ms / 1000,
                          already, warmup_bursts(msgs, 20, k, 8) if args.pg_warm else None,
                          pace=per_agg * k if per_agg else None)
            rnd[str(k)] = res
            if per_agg:
                print("round %d, %d aggregator(s) paced: offered %s/s (asked %s), stored %s/s, last stored %s s after "
                      "the last sent, publishers late by up to %s s%s" % (
                          r, k, res["offered_per_second"], res["pace_asked"], res["stored_per_second"],
                          res["last_stored_after_last_sent_s"], res["publisher_late_max_s"],
                          (", QUEUED" if res["queued"] else "") + (", PUBLISHERS BEHIND" if res["publishers_behind"] else "")),
                      flush=True)
            print("round %d, %d aggregator(s): stored %d of %d sent, CPU us/release total %s (aggregators %s, "
                  "postgres %s, mosquitto %s), lock-wait samples %d, not granted %d, retries %d, %s/s, load %s"
                  % (r, k, res["stored"], res["sent"], res["cpu_us_per_release_total"],
                     res["cpu_us_per_release_aggregators"], res["cpu_us_per_release"]["postgres"],
                     res["cpu_us_per_release"]["mosquitto"], res["server"]["lock_wait_samples"],
                     res["server"]["locks_not_granted_samples"], res["retries_total"],
                     res["releases_per_second"], res["loadavg_1min"]), flush=True)
            if res["server"]["locks_not_granted"]:
                print("  locks not granted:", json.dumps(res["server"]["locks_not_granted"]), flush=True)
        out["rounds"].append(rnd)
    out["summary"] = summarize(out["rounds"], ks)
    if per_agg:
        print(paced_table(out["summary"], ks), flush=True)
        return out
    out["sessions_in_turn"] = sessions_in_turn(srv, msgs, ks, 200, args.rounds)
    print(table(out["summary"], ks), flush=True)
    print(turns_table(out["sessions_in_turn"], ks), flush=True)
    return out


def sessions_in_turn(srv: Any, msgs: list[tuple[str, bytes]], ks: list[int], group: int, rounds: int) -> dict[str, Any]:
    """The server's side alone, without the machine's sharing: the same releases stored in groups of
    ``group`` by N writer sessions (PgStore, each its own roll-up shard) taking turns from one thread,
    each session warmed up first (:func:`warmup_bursts`); the server's CPU (postmaster and children),
    this process's and the WAL bytes per release, and the roll-up rows written. With the concurrent runs
    on a 2-core machine the processes of N aggregators, the server and the broker share two cores, so
    every process's CPU per release rises with N (cache, switches); here only what N writers make the
    server do differs."""
    import psycopg

    from pansketch.host_tools.bench import host
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.store.pg import PgStore
    from pansketch.host_tools.store.rows import Pending

    with open(os.path.join(srv.data, "postmaster.pid")) as f:
        pg_pid = int(f.readline())
    rels = [decode(p, t) for t, p in msgs]

    def pend(rs: list[Any]) -> list[Pending]:
        return [Pending(r.payload, "pansketch/%s/release" % r.dev, time.time(), rel=r, device=r.dev) for r in rs]

    out: dict[str, Any] = {"group": group, "releases": len(rels), "rounds": []}
    for r in range(rounds):
        rnd = {}
        for k in (ks if r % 2 == 0 else ks[::-1]):
            dsn = srv.create_database("turns_r%d_k%d" % (r, k))
            host._warm(dsn, msgs)
            sts = [PgStore(dsn) for _ in range(k)]
            for burst in warmup_bursts(msgs, 20, k, 8):
                wr = [decode(p, t) for t, p in burst]
                for j, st in enumerate(sts):
                    st.commit_group(pend(wr[j * 20:(j + 1) * 20]))
            host._checkpoint(srv.dsn())
            with psycopg.connect(srv.dsn(), autocommit=True) as adm:
                lsn = adm.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
                names = {"postgres": pg_pid, "writer": os.getpid()}
                c0 = tree_cpu(names)
                for g, i in enumerate(range(0, len(rels), group)):
                    sts[g % k].commit_group(pend(rels[i:i + group]))
                c1 = tree_cpu(names)
                lsn1 = adm.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
            rows = sts[0]._q("SELECT count(*) FROM rollups")[0][0]
            for st in sts:
                st.close()
            rnd[str(k)] = {"cpu_us_per_release": {n: round((c1[n] - c0[n]) / len(rels) * 1e6, 1) for n in names},
                           "wal_bytes_per_release": round((host._lsn(lsn1) - host._lsn(lsn)) / len(rels)),
                           "rollup_rows": int(rows)}
        out["rounds"].append(rnd)
        print("writer sessions in turn, round %d:" % r, json.dumps(rnd), flush=True)
    for k in ks:
        runs = [x[str(k)] for x in out["rounds"]]
        out[str(k)] = {"postgres_cpu_us_per_release": statistics.median(x["cpu_us_per_release"]["postgres"] for x in runs),
                       "writer_cpu_us_per_release": statistics.median(x["cpu_us_per_release"]["writer"] for x in runs),
                       "wal_bytes_per_release": statistics.median(x["wal_bytes_per_release"] for x in runs)}
    return out


def summarize(rounds: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    base = str(ks[0])
    summ: dict[str, Any] = {}
    for k in ks:
        runs = [r[str(k)] for r in rounds]
        med = statistics.median
        e: dict[str, Any] = {
            "cpu_us_per_release_total": med(x["cpu_us_per_release_total"] for x in runs),
            "cpu_us_per_release_aggregators": med(x["cpu_us_per_release_aggregators"] for x in runs),
            "cpu_us_per_release_postgres": med(x["cpu_us_per_release"]["postgres"] for x in runs),
            "cpu_us_per_release_mosquitto": med(x["cpu_us_per_release"]["mosquitto"] for x in runs),
            # each aggregator's CPU per release it stored (the largest of the run's aggregators)
            "cpu_us_per_own_release_max": med(max(x["cpu_us_per_own_release_each_aggregator"] or [0]) for x in runs),
            "sent": sum(x["sent"] for x in runs), "stored": sum(x["stored"] for x in runs),
            "lost": sum(x["lost"] for x in runs),
            "lock_wait_samples": sum(x["server"]["lock_wait_samples"] for x in runs),
            "locks_not_granted_samples": sum(x["server"]["locks_not_granted_samples"] for x in runs),
            "extend_wait_samples": sum(x["server"]["extend_wait_samples"] for x in runs),
            "lwlock_wait_samples": sum(x["server"]["lwlock_wait_samples"] for x in runs),
            "session_samples": sum(x["server"]["session_samples"] for x in runs),
            "retries": sum(x["retries_total"] + (x["retry_warnings"] if x["retries_missing"] else 0) for x in runs),
            "deadlocks": sum(x["server"]["deadlocks"] for x in runs),
            "releases_per_group": med(statistics.mean(a.get("messages_per_group", 0) for a in x["aggregator_exit"])
                                      for x in runs),
            "releases_per_second": med(x["releases_per_second"] for x in runs)}
        if all("offered_per_second" in x for x in runs):
            own = [max(x["cpu_us_per_own_release_each_aggregator"] or [0]) for x in runs]
            e.update({"offered_per_second": med(x["offered_per_second"] for x in runs),
                      "stored_per_second": med(x["stored_per_second"] for x in runs),
                      "stored_over_offered_min": min(x["stored_over_offered"] for x in runs),
                      "last_stored_after_last_sent_s_max": max(x["last_stored_after_last_sent_s"] for x in runs),
                      "queued_runs": sum(1 for x in runs if _pace_verdict(
                          x["pace_asked"], x["offered_per_second"], x["last_stored_after_last_sent_s"], x["sent"],
                          x["stored"])["queued"]),
                      "publishers_behind_runs": sum(1 for x in runs if _pace_verdict(
                          x["pace_asked"], x["offered_per_second"], x["last_stored_after_last_sent_s"], x["sent"],
                          x["stored"])["publishers_behind"]),
                      "cpu_us_per_own_release_max_spread": [min(own), max(own)],
                      "cpu_us_per_release_total_spread": [min(x["cpu_us_per_release_total"] for x in runs),
                                                          max(x["cpu_us_per_release_total"] for x in runs)],
                      "releases_per_group_rounds": [round(statistics.mean(a.get("messages_per_group", 0)
                                                                          for a in x["aggregator_exit"]), 1)
                                                    for x in runs],
                      "stages_aggregator_us": {st: med(x["stages_cpu_us_per_message"]["aggregator"].get(st, 0.0)
                                                       for x in runs)
                                               for st in runs[0]["stages_cpu_us_per_message"]["aggregator"]},
                      "stages_mqtt_us": {st: med(x["stages_cpu_us_per_message"]["MQTT"].get(st, 0.0) for x in runs)
                                         for st in runs[0]["stages_cpu_us_per_message"]["MQTT"]}})
        if str(k) != base:
            ratios = [x["cpu_us_per_release_total"] / r[base]["cpu_us_per_release_total"] for x, r in zip(runs, rounds)]
            e["cpu_total_ratio_to_%s_rounds" % base] = [round(v, 3) for v in ratios]
            e["cpu_total_ratio_to_%s" % base] = round(statistics.median(ratios), 3)
            pr = [x["cpu_us_per_release"]["postgres"] / r[base]["cpu_us_per_release"]["postgres"]
                  for x, r in zip(runs, rounds)]
            e["cpu_postgres_ratio_to_%s" % base] = round(statistics.median(pr), 3)
            e["cpu_total_ratio_to_%s_spread" % base] = [round(min(ratios), 3), round(max(ratios), 3)]
            ar = [x["cpu_us_per_release_aggregators"] / r[base]["cpu_us_per_release_aggregators"]
                  for x, r in zip(runs, rounds)]
            e["cpu_aggregators_ratio_to_%s" % base] = round(statistics.median(ar), 3)
        summ[str(k)] = e
    return summ


def table(summ: dict[str, Any], ks: list[int]) -> str:
    """The summary as a Markdown table (printed, and pasted into deploy/OPERATIONS.md)."""
    base = str(ks[0])
    head = ("| aggregators | CPU µs/release: total | aggregators (sum) | each aggregator, per release it stored (max) | PostgreSQL | mosquitto "
            "| total vs %s | stored / sent | lock-wait samples | locks not granted | extend waits | retries | releases/group (with warm-up) |"
            % base)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for k in ks:
        e = summ[str(k)]
        lines.append("| %d | %.0f | %.0f | %.0f | %.0f | %.0f | %s | %d / %d | %d | %d | %d | %d | %.0f |" % (
            k, e["cpu_us_per_release_total"], e["cpu_us_per_release_aggregators"],
            e["cpu_us_per_own_release_max"], e["cpu_us_per_release_postgres"],
            e["cpu_us_per_release_mosquitto"], "%.3f" % e["cpu_total_ratio_to_%s" % base] if str(k) != base else "1",
            e["stored"], e["sent"], e["lock_wait_samples"], e["locks_not_granted_samples"], e["extend_wait_samples"],
            e["retries"],
            e["releases_per_group"]))
    return "\n".join(lines)


def paced_table(summ: dict[str, Any], ks: list[int]) -> str:
    """The ``--pace-per-aggregator`` summary as a Markdown table: medians over the rounds, the spread of
    the round-by-round ratio in brackets."""
    base = str(ks[0])
    head = ("| aggregators | offered / stored per s | CPU µs/release: all | all vs %s [spread] | aggregators (sum) "
            "| each aggregator, per release it stored (max) | PostgreSQL | mosquitto | releases/group | lock waits "
            "| locks not granted | retries | stored / sent | runs queued / publishers behind |" % base)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for k in ks:
        e = summ[str(k)]
        ratio = ("%.3f [%.2f–%.2f]" % ((e["cpu_total_ratio_to_%s" % base],) + tuple(e["cpu_total_ratio_to_%s_spread" % base]))
                 if str(k) != base else "1")
        lines.append("| %d | %.0f / %.0f | %.0f | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %d | %d | %d | %d / %d | %d / %d |" % (
            k, e["offered_per_second"], e["stored_per_second"], e["cpu_us_per_release_total"], ratio,
            e["cpu_us_per_release_aggregators"], e["cpu_us_per_own_release_max"], e["cpu_us_per_release_postgres"],
            e["cpu_us_per_release_mosquitto"], e["releases_per_group"], e["lock_wait_samples"],
            e["locks_not_granted_samples"], e["retries"], e["stored"], e["sent"], e["queued_runs"],
            e["publishers_behind_runs"]))
    return "\n".join(lines)


def turns_table(t: dict[str, Any], ks: list[int]) -> str:
    base = t[str(ks[0])]
    lines = ["| writer sessions in turn (groups of %d) | PostgreSQL CPU µs/release | vs %d | writer µs/release | "
             "WAL bytes/release |" % (t["group"], ks[0]), "|---|---|---|---|---|"]
    for k in ks:
        e = t[str(k)]
        lines.append("| %d | %.0f | %.3f | %.0f | %d |" % (
            k, e["postgres_cpu_us_per_release"], e["postgres_cpu_us_per_release"] / max(1e-9, base["postgres_cpu_us_per_release"]),
            e["writer_cpu_us_per_release"], e["wal_bytes_per_release"]))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    import platform
    import shutil
    import tempfile

    from pansketch.host_tools.bench import host
    from pansketch.host_tools.localnet import mosquitto_path
    from pansketch.host_tools.store import pgserver

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=400)
    ap.add_argument("--per-device", type=int, default=12, help="releases per device, one per hourly window")
    ap.add_argument("--workers", type=int, default=4, help="publisher processes (devices are spread over them)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pg-aggregators", default="1,2,4", metavar="N,...")
    ap.add_argument("--pg-warm", action="store_true",
                    help="each database knows every device and each aggregator is warmed up first (a running fleet)")
    ap.add_argument("--pg-sample-ms", type=int, default=50, help="lock-wait sampling interval")
    ap.add_argument("--pace-per-aggregator", type=float, default=None, metavar="R",
                    help="pace the publishers to N x R releases/s in all (each aggregator receives R/s whatever N: "
                         "N aggregators on N hosts) instead of flat out")
    ap.add_argument("--out", default=None,
                    help="bench-results/host-pg-scaleout.json (flat out), host-pg-scaleout-paced.json (paced)")
    args = ap.parse_args(argv)
    if args.pace_per_aggregator is not None and args.pace_per_aggregator <= 0:
        ap.error("--pace-per-aggregator must be a positive rate (releases per second per aggregator)")
    if args.out is None:
        args.out = "bench-results/host-pg-scaleout%s.json" % ("-paced" if args.pace_per_aggregator else "")
    why = host._pg_available() or (None if mosquitto_path() else "mosquitto not installed")
    if why is not None:
        print("skipped:", why)
        return 0
    tmp = tempfile.mkdtemp(prefix="pansketch-bench-")
    msgs = host.make_releases(args.devices, args.per_device)
    res: dict[str, Any] = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                       "platform": platform.platform(), "loadavg_at_start": os.getloadavg()},
                           "command": "python -m pansketch.host_tools.bench.pgscale " + " ".join(
                               argv if argv is not None else sys.argv[1:])}
    srv = pgserver.PgServer.start(fsync=True)
    try:
        res["pg_scaleout"] = run(srv, msgs, args, tmp)
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print("written to", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
