"""Host benchmark: ingest through mosquitto (SQLite and PostgreSQL), release size, queries.

    python -m pansketch.host_tools.bench.host [--devices 50] [--per-device 80] [--rounds 2] [--aggregators 1,2,4]
                                    [--query-devices 50] [--query-windows 168] [--out bench-results/host.json]

* release size: encoded bytes of a release for a few (kind, d, w);
* ingest: ``devices`` concurrent MQTT clients (one per device id, spread
  over publisher processes) publish pre-encoded valid releases at QoS 1 to
  a mosquitto started on a free loopback port; ``pansketch aggregate``
  process(es) validate, store (group commit) and acknowledge them. Rate =
  releases stored / seconds from the first publish to the last commit;
  ``--aggregators 1,2,4`` repeats it with 2 and 4 aggregators on a
  shared subscription writing one SQLite file.
  Peer, measured in the same run with the same publishers, interleaved
  round by round: a bare paho subscriber process that only acknowledges
  (rate = messages received / seconds to the last one). Each run also
  reports the CPU time per release of every process involved (aggregator,
  its MQTT and validation helpers, mosquitto; from /proc). Also in-process
  (no MQTT): ``Aggregator.handle`` one by one vs ``handle_many`` groups;
* PostgreSQL (when its server binaries and psycopg are installed): the
  same ingest with 1, 2 and 4 aggregators (``--pg-aggregators``) on a
  shared subscription writing to one server started for the run (fsync
  on), ``--rounds`` rounds each with its own peer run, the order of the
  aggregator counts alternating; besides the CPU per release of every
  process (the server's as ``postgres``, the publishers') what the server
  did (:class:`PgWatch`: wait events of the aggregators' sessions,
  commits, deadlocks, WAL and database bytes per release);
* (PostgreSQL scale-out told by the cost per stored release rather than by the rate, with its lock
  waits and retries: pansketch.host_tools.bench.pgscale, which runs these publishers;)
* queries over ``query-devices`` x ``query-windows`` hourly releases
  (d=4, w=1024): ``freq`` of one item over everything and ``topk`` over
  100,000 candidates, from roll-ups vs from raw releases (the peer, the
  same query with ``use_rollups=False``), in-process median times, and the
  ``pansketch query`` CLI process (wall time and peak RSS) for both.

The counters are those of a few real releases (the device core with its noise, 30,000
Zipf events per window; :func:`real_counters`), the cells of each release shuffled: the
store compresses payloads, so what they hold matters to its bytes and CPU.
Figures are written as JSON to ``--out``. Needs mosquitto for the ingest
part (skipped with a note otherwise).

Longer than the ~800 lines a module here keeps to: the SQLite, PostgreSQL
and query runs share the publishers, the peer run and the per-process CPU
accounting, and one file reads as the one measurement protocol of ``make bench``.
"""

from __future__ import annotations

import argparse
import array
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

from pansketch.agent import release
from pansketch.agent.params import Params
from pansketch.host_tools.bench.core import process_cpu_s as _cpu_s  # the name soak and benchmarks/rabbitmq import from here
from pansketch.host_tools.localnet import Mosquitto, mosquitto_path, stop_processes

SALT = "bench-fleet-salt"
EPOCH0 = 1_700_000_000 // 3600


def real_counters(d: int, w: int, windows: int = 4, events: int = 30_000) -> list[np.ndarray]:
    """The counters of ``windows`` hourly cs releases of one device made by the device core (real noise,
    ``events`` Zipf events per window: pansketch.host_tools.bench.storage)."""
    from pansketch.host_tools.bench import storage
    from pansketch.host_tools.ingest.decode import decode

    raws = storage.real_releases("cs", windows, events, {"kind": "cs", "d": d, "w": w})
    return [decode(raw).counters().ravel().copy() for raw in raws]


def make_releases(devices: int, per_device: int, d: int = 4, w: int = 1024, seed: int = 1) -> list[tuple[str, bytes]]:
    """Releases whose counters are those of real ones (:func:`real_counters`), the cells of each
    shuffled: the store compresses payloads (pansketch.host_tools.store.payloadcodec), so their bytes
    and CPU depend on the counters' distribution, which a shuffle keeps."""
    rng = np.random.default_rng(seed)
    base = real_counters(d, w)
    out = []
    for dv in range(devices):
        p = Params({"device": "bench-%03d" % dv, "salt": SALT, "kind": "cs", "d": d, "w": w})
        for k in range(per_device):
            ctr = array.array("i")
            ctr.frombytes(rng.permutation(base[(dv + k) % len(base)]).astype("<i4").tobytes())
            out.append(("pansketch/%s/release" % p.device, release.encode(p, k, EPOCH0 + k, EPOCH0 + k + 1, 0, ctr)))
    return out


def release_sizes() -> dict[str, int]:
    out = {}
    for kind, d, w in (("cs", 4, 1024), ("cs", 5, 2048), ("cms", 4, 256), ("cs", 8, 4096)):
        p = Params({"device": "pi-kitchen-01", "salt": SALT, "kind": kind, "d": d, "w": w})
        ctr = array.array("i", [0] * (d * w))
        out["%s d=%d w=%d" % (kind, d, w)] = len(release.encode(p, 123456, EPOCH0, EPOCH0 + 1, 0, ctr))
    return out


def connect_devices(port: int, batches: list[list[tuple[str, bytes]]], tag: str) -> list[tuple[Any, list[tuple[str, bytes]]]]:
    """One connected paho client (MQTT v5, 20 in flight) per device's (topic, payload) list."""
    import paho.mqtt.client as mqtt

    clients = []
    for msgs in batches:
        dev = msgs[0][0].split("/")[1]
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="%s-%s" % (dev, tag), protocol=mqtt.MQTTv5)
        c.max_inflight_messages_set(20)
        c.connect("127.0.0.1", port)
        c.loop_start()
        clients.append((c, msgs))
    return clients


def interleaved(clients: list[tuple[Any, list[tuple[str, bytes]]]]) -> list[tuple[Any, tuple[str, bytes]]]:
    """(client, message) in the order concurrent agents send: each device's k-th message, then the k+1-th."""
    return [(c, msgs[k]) for k in range(max(len(m) for _c, m in clients)) for c, msgs in clients if k < len(msgs)]


def _publisher(port: int, batches: list[list[tuple[str, bytes]]], start: Any, done: Any, tag: str) -> None:
    publish_interleaved(connect_devices(port, batches, tag), start, done, 120)


def start_publishers(ctx: Any, target: Any, where: Any, msgs: list[tuple[str, bytes]], workers: int,
                     tag: str) -> tuple[list[Any], Any, Any]:
    """``workers`` processes running ``target(where, batches, start, done, tag)``, each device's messages in one
    of them; returns (the processes, the ``start`` event that sets them publishing, the ``done`` queue)."""
    by_dev: dict[str, list[tuple[str, bytes]]] = {}
    for t, p in msgs:
        by_dev.setdefault(t, []).append((t, p))
    groups = list(by_dev.values())
    start = ctx.Event()
    done: Any = ctx.Queue()
    pubs = [ctx.Process(target=target, args=(where, groups[i::workers], start, done, tag)) for i in range(workers)]
    for pub in pubs:
        pub.start()
    return pubs, start, done


def publish_interleaved(clients: list[tuple[Any, list[tuple[str, bytes]]]], start: Any, done: Any,
                        timeout: float) -> None:
    """Once ``start`` is set, publish each connected paho client's (topic, payload) list at QoS 1, the
    devices interleaved like concurrent agents; wait for every PUBACK (``timeout`` s each), disconnect,
    and put the number published on ``done``."""
    start.wait()
    infos = [c.publish(topic, payload, qos=1) for c, (topic, payload) in interleaved(clients)]
    for i in infos:
        i.wait_for_publish(timeout)
    for c, _m in clients:
        c.disconnect()
        c.loop_stop()
    done.put(len(infos))


def _bare_subscriber(port: int, n: int, ready: Any, out: Any) -> None:
    """The peer: a paho subscriber that only acknowledges (QoS 1, MQTT v5)."""
    import threading

    import paho.mqtt.client as mqtt

    got = [0]
    fin = threading.Event()
    t_last = [0.0]

    def on_message(_c: Any, _u: Any, _m: Any) -> None:
        got[0] += 1
        if got[0] >= n:
            t_last[0] = time.time()  # the end of the peer's run: its last message, not its disconnect
            fin.set()

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bare-peer", protocol=mqtt.MQTTv5)
    c.on_message = on_message
    c.on_subscribe = lambda *_a: ready.set()
    c.connect("127.0.0.1", port)
    c.subscribe("pansketch/+/release", qos=1)
    cpu0 = time.process_time()
    c.loop_start()
    fin.wait(600)
    cpu = time.process_time() - cpu0
    c.disconnect()
    c.loop_stop()
    out.put((got[0], t_last[0] or time.time(), cpu))


def _helpers(pid: int) -> dict[int, str]:
    """``pid`` and its child processes, each named by its role (``aggregator`` or the helper's module)."""
    out = {pid: "aggregator"}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open("/proc/%s/stat" % d) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open("/proc/%s/cmdline" % d, "rb") as f:
                    argv = f.read().split(b"\0")
                out[int(d)] = argv[2].decode() if len(argv) > 2 and argv[1] == b"-m" else "child"
        except (OSError, ValueError, IndexError):
            continue
    return out


_PG_COUNTERS: dict[str, Any] = {}  # one polling session per database (a new one every 50 ms cost a fork)
_SQLITE_COUNTERS: dict[str, Any] = {}  # one polling connection per SQLite file (autocommit: no read
                                       # transaction is held between polls, so checkpoints are not held up)
POLL_S = 0.005  # how often a SQLite run polls the store's row count: its end is known to within this
# (it was 50 ms, which added 25 ms on average to a run of about 250 ms, 10%, where the peer's end is
# the time of its last message)


def _count(db: str) -> int:
    if db.startswith("postgresql://"):
        try:
            import psycopg

            pcon = _PG_COUNTERS.get(db)
            if pcon is None or pcon.closed:
                pcon = _PG_COUNTERS[db] = psycopg.connect(db, connect_timeout=5, autocommit=True)
            row = pcon.execute("SELECT COUNT(*) FROM releases").fetchone()
            return int(row[0]) if row else 0
        except Exception:
            _PG_COUNTERS.pop(db, None)
            return 0
    import sqlite3

    try:
        con = _SQLITE_COUNTERS.get(db)
        if con is None:
            con = _SQLITE_COUNTERS[db] = sqlite3.connect(db, timeout=5, isolation_level=None)
        return int(con.execute("SELECT COUNT(*) FROM releases").fetchone()[0])
    except sqlite3.Error:
        con = _SQLITE_COUNTERS.pop(db, None)
        if con is not None:
            con.close()
        return 0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def bench_ingest(msgs: list[tuple[str, bytes]], devices: int, workers: int, tmp: str, db: Optional[str] = None,
                 aggregators: int = 1, peer: bool = False, tag: str = "r", pg_pid: Optional[int] = None,
                 already: int = 0, compress: Optional[bool] = None) -> dict[str, Any]:
    """One ingest run: ``aggregators`` aggregate processes into ``db`` (or, ``peer``, the bare subscriber).

    ``compress``: the aggregators' ``[store] compress`` (None: not set, the backend's default).

    ``pg_pid``: the PostgreSQL postmaster's pid; its processes' CPU is reported as ``postgres sessions``
    (the aggregators' connections) and ``postgres background`` (postmaster, WAL writer, checkpointer...;
    autovacuum workers started during the run are not counted)."""
    if mosquitto_path() is None:
        return {"skipped": "mosquitto not installed"}
    broker = Mosquitto(tmp, conf_extra="max_queued_messages 0")
    port = broker.port
    procs_agg: list[subprocess.Popen[bytes]] = []
    ctx = mp.get_context("fork")
    peer_out: Any = ctx.Queue()
    try:
        if peer:
            ready = ctx.Event()
            sub = ctx.Process(target=_bare_subscriber, args=(port, len(msgs), ready, peer_out))
            sub.start()
            ready.wait(30)
        else:
            assert db is not None
            for k in range(aggregators):
                conf = os.path.join(tmp, "host-%s-%d.toml" % (tag, k))
                with open(conf, "w") as f:
                    f.write('[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "agg-%s-%d"\n'
                            '[aggregator]\ndb = "%s"\nmax_bytes = 65536\n%s'
                            '[fleet]\nsalt = "%s"\n%s' % (port, tag, k, db,
                                                          'shared_group = "aggs"\n' if aggregators > 1 else "", SALT,
                                                          "" if compress is None else
                                                          "[store]\ncompress = %s\n" % str(compress).lower()))
                procs_agg.append(subprocess.Popen(
                    [sys.executable, "-m", "pansketch.host_tools.cli", "aggregate", "--config", conf, "--until-idle", "20"],
                    env=_env(), stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "agg-%s-%d.log" % (tag, k)), "w")))
            logs = [os.path.join(tmp, "agg-%s-%d.log" % (tag, k)) for k in range(aggregators)]
            deadline = time.monotonic() + 60
            while not all("subscribed to" in open(lf).read() for lf in logs) and time.monotonic() < deadline:
                time.sleep(0.05)
        pubs, start, done = start_publishers(ctx, _publisher, port, msgs, workers, tag)
        time.sleep(1.5)  # publishers connected
        roles: dict[int, str] = {broker.pid: "mosquitto"}
        for a in procs_agg:
            roles.update(_helpers(a.pid))
        if pg_pid is not None:  # the server and its backends (one per aggregator connection)
            for pid in _helpers(pg_pid):  # sessions: "postgres: <user> <db> <client> ..."; the rest background
                roles[pid] = "postgres sessions" if _pg_session(pid) else "postgres background"
        for pub in pubs if pg_pid is not None else ():  # PostgreSQL runs: the load generators share the
            if pub.pid is not None:                         # cores; counted to show when these are the limit
                roles[pub.pid] = "publishers"
        cpu0 = {pid: _cpu_s(pid) for pid in roles}
        t0 = time.perf_counter()
        t0_wall = time.time()
        start.set()
        published = sum(done.get(timeout=600) for _ in pubs)
        t_pub = time.perf_counter() - t0
        cpu: dict[str, float] = {}
        if peer:
            stored, t_end, cpu["bare subscriber"] = peer_out.get(timeout=600)
            t_all = t_end - t0_wall
            sub.join(30)
        else:
            assert db is not None
            poll = 0.05 if db.startswith("postgresql://") else POLL_S  # a COUNT(*) there scans the table
            while _count(db) < len(msgs) + already and time.perf_counter() - t0 < 600:
                time.sleep(poll)
            t_all = time.perf_counter() - t0
            stored = _count(db) - already  # (already: rows stored before the run, --pg-warm)
        for pid, role in roles.items():  # CPU seconds per role over the run (all aggregators together)
            cpu[role] = cpu.get(role, 0.0) + max(0.0, _cpu_s(pid) - cpu0[pid])  # 0: gone (an autovacuum worker)
        for pub in pubs:
            pub.join(30)
    finally:
        stop_processes(procs_agg, 30)
        broker.stop()
        if db is not None and db in _PG_COUNTERS:  # closed before the next run lists the server's processes
            _PG_COUNTERS.pop(db).close()
        if db is not None and db in _SQLITE_COUNTERS:
            _SQLITE_COUNTERS.pop(db).close()
    busy = sum(cpu.values()) / max(1e-9, t_all)
    logs = [os.path.join(tmp, "agg-%s-%d.log" % (tag, k)) for k in range(len(procs_agg))]
    stages = {role: st for role in ("aggregator", "MQTT", "validation") for st in [_stage_cpu(logs, role)] if st}
    return {"consumer": "bare paho subscriber (acks only)" if peer else "%d x pansketch aggregate" % aggregators,
            "clients": devices, "publisher_processes": workers, "releases": len(msgs), "published": published,
            "received_or_stored": stored, "seconds_to_publish_all": round(t_pub, 3),
            "seconds_to_store_all": round(t_all, 3), "releases_per_second": round(stored / t_all, 1),
            "release_bytes": len(msgs[0][1]),
            "cpu_us_per_release": {k: round(v / max(1, stored) * 1e6) for k, v in sorted(cpu.items())},
            "cpu_cores_busy": round(busy, 2), "cpus": os.cpu_count(),
            **({"stages_cpu_us_per_message": stages} if stages else {}),
            **({"messages_per_group_commit": _per_group(logs)} if not peer else {})}


def _pg_session(pid: int) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            title = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return title.startswith("postgres: ") and "(" in title  # a client session shows its address (host(port))


def _per_group(logs: list[str]) -> Optional[float]:
    """Messages per group commit, from the aggregators' exit summary (mean over aggregators)."""
    vals = []
    for lf in logs:
        try:
            with open(lf) as f:
                for ln in f:
                    if "WAL checkpoints:" in ln and "messages per group" in ln:
                        vals.append(float(ln.rsplit(" messages per group", 1)[0].rsplit(" ", 1)[1]))
        except (OSError, ValueError, IndexError):
            continue
    return round(sum(vals) / len(vals), 1) if vals else None


def _stage_cpu(logs: list[str], role: str) -> dict[str, float]:
    """A process's CPU per message by stage (the summary line each ingest process logs at exit, with
    pansketch.host_tools.ingest.child.log_stage_cpu; mean over aggregators)."""
    from pansketch.host_tools.ingest.child import STAGES_LINE

    line = STAGES_LINE % role
    found: list[dict[str, float]] = []
    for lf in logs:
        try:
            with open(lf) as f:
                for ln in f:
                    if line in ln:
                        found.append(json.loads(ln.split(line, 1)[1]))
        except (OSError, ValueError):
            continue
    if not found:
        return {}
    return {k: round(sum(x.get(k, 0.0) for x in found) / len(found), 1) for k in sorted(found[0])}


def bench_direct(msgs: list[tuple[str, bytes]], tmp: str) -> dict[str, Any]:
    """In-process, no MQTT: one transaction per release vs group commits of 256."""
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator
    from pansketch.host_tools.ingest.decode import decode

    out: dict[str, Any] = {}
    for name, group in (("one_by_one", 1), ("groups_of_256", 256)):
        cfg = hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": os.path.join(tmp, "direct-%s.db" % name)}})
        a = Aggregator(cfg)
        t = time.perf_counter()
        for i in range(0, len(msgs), group):
            a.handle_many(msgs[i:i + group])
        out["%s_per_second" % name] = round(len(msgs) / (time.perf_counter() - t), 1)
        a.close()
    t = time.perf_counter()
    for tp, pl in msgs:
        decode(pl, tp)
    out["validate_only_per_second"] = round(len(msgs) / (time.perf_counter() - t), 1)
    return out


def _timeit(fn: Any, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def build_query_db(path: str, devices: int, windows: int, d: int = 4, w: int = 1024) -> int:
    """``devices`` x ``windows`` hourly window releases stored through the store's group commit."""
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.store.rows import Pending
    from pansketch.host_tools.store.backend import open_store

    rng = np.random.default_rng(7)
    st = open_store(path)
    n = 0
    for k in range(windows):
        group = []
        for dv in range(devices):
            p = Params({"device": "q-%03d" % dv, "salt": SALT, "kind": "cs", "d": d, "w": w})
            ctr = array.array("i")
            ctr.frombytes(rng.integers(-60, 60, d * w, dtype=np.int32).astype("<i4").tobytes())
            rel = decode(release.encode(p, k, EPOCH0 + k, EPOCH0 + k + 1, 0, ctr))
            group.append(Pending(rel.payload, None, time.time(), rel=rel, device=rel.dev))
        st.commit_group(group)
        n += len(group)
    st.close()
    return n


def _cli_run(conf: str, args: list[str]) -> dict[str, Any]:
    """Run ``pansketch query`` as its own process: wall time, peak RSS, the time it reports.

    Peak RSS comes from GNU time (``/usr/bin/time -f %M``) when installed:
    the rusage of a child forked from this (large) benchmark process would
    count the parent's pages it held before exec.
    """
    gtime = "/usr/bin/time" if os.path.exists("/usr/bin/time") else None
    cmd = [sys.executable, "-m", "pansketch.host_tools.cli", "query", "--config", conf] + args
    if gtime:
        cmd = [gtime, "-f", "MAXRSS_KB %M"] + cmd
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError("pansketch query failed: %s" % proc.stderr.decode()[-500:])
    rss = None
    for ln in proc.stderr.decode().splitlines():
        if ln.startswith("MAXRSS_KB "):
            rss = round(int(ln.split()[1]) / 1024, 1)
    answered = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("# answered in")]
    return {"process_wall_s": round(wall, 3), "peak_rss_mb": rss,
            "answered_in": answered[0][len("# answered in "):] if answered else None}


def bench_query(db: str, tmp: str, n_cand: int = 100_000) -> dict[str, Any]:
    """Roll-ups vs raw releases (the peer), interleaved, in-process and as CLI processes."""
    from pansketch.host_tools import fasthash
    from pansketch.host_tools.query import core as query
    from pansketch.host_tools.store.backend import open_store

    st = open_store(db, readonly=True)
    cands = ["cand-%d" % i for i in range(n_cand)]
    out: dict[str, Any] = {"releases_in_db": st.release_count()}
    a = query.freq(st, ["cand-1"], salt=SALT)[0].to_dict()
    b = query.freq(st, ["cand-1"], salt=SALT, use_rollups=False)[0].to_dict()
    out["freq_answers_equal"] = a == b
    for name, fn in (
            ("freq_1_item_all", lambda ru: query.freq(st, ["cand-1"], salt=SALT, use_rollups=ru)),
            ("freq_1_item_one_window", lambda ru: query.freq(st, ["cand-1"], salt=SALT, window=EPOCH0, use_rollups=ru)),
            ("topk_10_of_%d_all" % n_cand, lambda ru: query.topk(st, cands, 10, salt=SALT, use_rollups=ru))):
        reps = 5 if name.startswith("freq") else 3
        tr, tw = [], []
        for _ in range(2):  # interleaved rounds
            tr.append(_timeit(lambda: fn(True), reps))
            tw.append(_timeit(lambda: fn(False), max(1, reps // 2)))
        out[name] = {"rollups_s": round(min(tr), 4), "raw_releases_s (peer)": round(min(tw), 4),
                     "speedup": round(min(tw) / min(tr), 1)}
    t_fast = _timeit(lambda: fasthash.cols_signs(fasthash.streams(cands, SALT, 4), 4, 1024), 3)
    out["hash_%d_candidates_fasthash_s" % n_cand] = round(t_fast, 4)
    st.close()
    if not db.startswith("postgresql://"):
        conf = os.path.join(tmp, "query.toml")
        with open(conf, "w") as f:
            f.write('[aggregator]\ndb = "%s"\n[fleet]\nsalt = "%s"\n' % (db, SALT))
        cfile = os.path.join(tmp, "cands.txt")
        with open(cfile, "w") as f:
            f.write("\n".join(cands) + "\n")
        cli: dict[str, Any] = {}
        for rnd in range(2):
            for name, args in (("freq_all", ["freq", "cand-1"]),
                               ("freq_all_raw_releases (peer)", ["freq", "cand-1", "--no-rollups"]),
                               ("topk_all", ["topk", "-k", "10", "--candidates", cfile]),
                               ("topk_all_raw_releases (peer)", ["topk", "-k", "10", "--candidates", cfile,
                                                                 "--no-rollups"])):
                r = _cli_run(conf, args)
                if rnd == 0 or r["process_wall_s"] < cli[name]["process_wall_s"]:
                    cli[name] = r
        out["cli"] = cli
        out["cli_peak_rss_note"] = "RSS of the whole pansketch query process (python + numpy + answer)"
    return out


class PgWatch:
    """What a PostgreSQL server did during one ingest run, read from the server itself.

    A thread samples ``pg_stat_activity`` every 10 ms: per session of the
    aggregators (``application_name`` pansketch) in a transaction, its wait
    event, or ``CPU`` when it waits for nothing: lock waits (``Lock:*``,
    ``LWLock:*``) are the contention between aggregators, ``Client:ClientRead``
    and ``idle in transaction`` the server waiting for an aggregator. Around
    the run: commits, rollbacks and deadlocks of the database
    (``pg_stat_database``), WAL bytes (``pg_current_wal_lsn``) and the
    database's size.
    """

    def __init__(self, admin_dsn: str, dbname: str, interval: float = 0.01) -> None:
        import psycopg

        self.con = psycopg.connect(admin_dsn, autocommit=True)
        self.dbname = dbname
        self.interval = interval
        self.samples: dict[str, int] = {}
        self.polls = 0
        self._stop = False
        self._thread: Any = None
        self.before: tuple[Any, ...] = ()

    def _stats(self) -> tuple[Any, ...]:
        self.con.execute("SELECT pg_stat_clear_snapshot()")
        row = self.con.execute("SELECT xact_commit, xact_rollback, deadlocks, pg_current_wal_lsn()::text, "
                               "pg_database_size(datname) FROM pg_stat_database WHERE datname = %s",
                               (self.dbname,)).fetchone()
        return tuple(row) if row else (0, 0, 0, "0/0", 0)

    def _poll(self) -> None:
        import psycopg

        con = psycopg.connect(self.con.info.dsn, autocommit=True)
        try:
            while not self._stop:
                for state, wtype, wev in con.execute(
                        "SELECT state, wait_event_type, wait_event FROM pg_stat_activity WHERE datname = %s "
                        "AND application_name = 'pansketch' AND state IS DISTINCT FROM 'idle'", (self.dbname,)):
                    k = ("aggregator's turn (idle in transaction)" if state == "idle in transaction"
                         else "CPU" if wtype is None else "%s:%s" % (wtype, wev))
                    self.samples[k] = self.samples.get(k, 0) + 1
                self.polls += 1
                time.sleep(self.interval)
        finally:
            con.close()

    def __enter__(self) -> "PgWatch":
        import threading

        self.before = self._stats()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop = True
        self._thread.join(5)

    def result(self, stored: int) -> dict[str, Any]:
        time.sleep(0.6)  # exited sessions have flushed their statistics
        after = self._stats()
        self.con.close()
        n = max(1, stored)
        wal = _lsn(after[3]) - _lsn(self.before[3])
        total = max(1, sum(self.samples.values()))
        # (the commits of pg_stat_database include the benchmark's polling; the aggregators' exit lines
        # give their group commits, _groups)
        return {"rollbacks": after[1] - self.before[1],
                "deadlocks": after[2] - self.before[2], "wal_bytes_per_release": round(wal / n),
                "db_bytes_per_release": round((after[4] - self.before[4]) / n),
                "session_samples_in_transaction": total, "polls": self.polls,
                "wait_events_share": {k: round(v / total, 3) for k, v in
                                      sorted(self.samples.items(), key=lambda kv: -kv[1])}}


def _lsn(s: str) -> int:
    hi, lo = s.split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def _groups(tmp: str, tag: str, k: int) -> dict[str, Any]:
    """Group commits and releases per group, from the aggregators' exit lines."""
    import re

    g = m = 0.0
    for i in range(k):
        try:
            text = open(os.path.join(tmp, "agg-%s-%d.log" % (tag, i))).read()
        except OSError:
            continue
        for n, per in re.findall(r"(\d+) group commit\(s\), ([0-9.]+) messages per group", text)[:1]:
            g += int(n)
            m += int(n) * float(per)
    return {"group_commits": int(g), "releases_per_group": round(m / g, 1) if g else None}


def _warm(dsn: str, msgs: list[tuple[str, bytes]]) -> int:
    """``--pg-warm``: the database already knows every device (one earlier release each, stored before
    the timed run), as in a running fleet; a fresh database makes the first release of each device
    wait for whichever aggregator inserted its ``devices`` row first."""
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.store.rows import Pending
    from pansketch.host_tools.store.backend import open_store

    seen: dict[str, Any] = {}
    for t, p in msgs:
        r = decode(p, t)
        if r.dev not in seen:
            seen[r.dev] = r
    st = open_store(dsn)
    group = []
    for dev, r in seen.items():  # the same parameters, one window before the benchmark's first
        prm = Params({"device": dev, "salt": SALT, "kind": r.kind, "d": r.d, "w": r.w})
        ctr = array.array("i", [0] * (r.d * r.w))
        rel = decode(release.encode(prm, 0, EPOCH0 - 1, EPOCH0, 0, ctr), "pansketch/%s/release" % dev)
        group.append(Pending(rel.payload, "pansketch/%s/release" % dev, time.time(), rel=rel, device=dev))
    st.commit_group(group)
    st.close()
    return len(group)


def _checkpoint(dsn: str) -> None:
    """A CHECKPOINT before each timed PostgreSQL run: otherwise the checkpoint the previous runs' WAL
    (about 250 MB each) triggered ran in the background of whichever run came next (the middle run of
    a round, 2 aggregators, more often than the others: 'postgres background' 8-10 us per release there
    against 1-3), flushing and fsyncing their pages beside it."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CHECKPOINT")


def bench_pg(srv: Any, msgs: list[tuple[str, bytes]], args: Any, tmp: str) -> dict[str, Any]:
    """PostgreSQL ingest with each number of aggregators in ``--pg-aggregators``, ``--rounds`` rounds,
    interleaved with the bare subscriber (the peer) in every round; a fresh database per run."""
    ks = [int(k) for k in args.pg_aggregators.split(",")]
    pg: dict[str, Any] = {"server": "PostgreSQL from %s, fsync on, synchronous_commit on" % srv.bindir,
                          "warm": bool(args.pg_warm), "rounds": []}
    for r in range(args.rounds):
        rnd: dict[str, Any] = {"loadavg_at_start": os.getloadavg()}
        rnd["peer"] = bench_ingest(msgs, args.devices, args.workers, tmp, peer=True, tag="pp%d" % r)
        print("PostgreSQL round %d, peer (bare subscriber): %s/s" % (r, rnd["peer"].get("releases_per_second")),
              flush=True)
        order = ks if r % 2 == 0 else ks[::-1]  # alternate the order: no k always runs first or last
        for k in order:
            name = "bench_r%d_k%d" % (r, k)
            dsn = srv.create_database(name)
            already = _warm(dsn, msgs) if args.pg_warm else 0
            with open(os.path.join(srv.data, "postmaster.pid")) as f:
                pg_pid = int(f.readline())
            _checkpoint(srv.dsn())
            load = os.getloadavg()[0]
            with PgWatch(srv.dsn(), name) as watch:
                ours = bench_ingest(msgs, args.devices, args.workers, tmp, db=dsn, aggregators=k,
                                    tag="pg%d-%d" % (r, k), pg_pid=pg_pid, already=already)
            ours["server"] = watch.result(ours.get("received_or_stored", 0))
            ours["server"].update(_groups(tmp, "pg%d-%d" % (r, k), k))
            ours["loadavg_1min_at_start"] = round(load, 2)
            rnd["%d_aggregators" % k] = ours
            print("PostgreSQL round %d, %d aggregator(s): %s/s, CPU us/release %s, server %s" % (
                r, k, ours.get("releases_per_second"), ours.get("cpu_us_per_release"),
                json.dumps(ours["server"])), flush=True)
        pg["rounds"].append(rnd)
    ok = all("releases_per_second" in x["%d_aggregators" % k] for x in pg["rounds"] for k in ks)
    if ok:
        summ: dict[str, Any] = {"peer_per_second": [x["peer"].get("releases_per_second") for x in pg["rounds"]],
                                "loadavg_1min_per_round": [round(x["loadavg_at_start"][0], 2) for x in pg["rounds"]]}
        for k in ks:
            runs = [x["%d_aggregators" % k] for x in pg["rounds"]]
            rates = [x["releases_per_second"] for x in runs]
            e: dict[str, Any] = {"per_second": rates, "median": statistics.median(rates),
                                 "ratio_to_peer": [round(a["releases_per_second"] / x["peer"]["releases_per_second"], 3)
                                                   for a, x in zip(runs, pg["rounds"])],
                                 "deadlocks": sum(a["server"]["deadlocks"] for a in runs),
                                 "cpu_cores_busy": [a["cpu_cores_busy"] for a in runs]}
            if k != ks[0]:
                ratios = [round(a["releases_per_second"] / x["%d_aggregators" % ks[0]]["releases_per_second"], 3)
                          for a, x in zip(runs, pg["rounds"])]
                e["ratio_to_%d_aggregator(s)_same_round" % ks[0]] = ratios
                e["ratio_to_%d_median" % ks[0]] = statistics.median(ratios)
                e["ratio_to_%d_min" % ks[0]] = min(ratios)
                e["rounds_slower_than_%d" % ks[0]] = sum(1 for r in ratios if r < 1.0)
            # CPU per release of each process role, median over the rounds (the steadier figure on a shared
            # machine: the rates swing with what else runs, the work per release much less)
            roles = sorted({role for a in runs for role in a["cpu_us_per_release"]})
            e["cpu_us_per_release_median"] = {role: statistics.median(a["cpu_us_per_release"].get(role, 0)
                                                                      for a in runs) for role in roles}
            e["releases_per_group_median"] = statistics.median(a["server"]["releases_per_group"] or 0 for a in runs)
            summ["%d_aggregators" % k] = e
        pg["summary"] = summ
        print("PostgreSQL summary:", json.dumps(summ), flush=True)
    return pg


def bench_pg_rows(srv: Any, msgs: list[tuple[str, bytes]]) -> dict[str, Any]:
    """Bytes on disk per stored release in PostgreSQL, measured: the releases table (heap, TOAST,
    indexes), the roll-up tables, WAL; then every payload pruned (retention) and the table rewritten
    (VACUUM FULL): the bytes a pruned release keeps. For the capacity plan (bench/capacity.py)."""
    import psycopg

    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.store.rows import Pending
    from pansketch.host_tools.store.pg import PgStore

    dsn = srv.create_database("rows")
    st = PgStore(dsn)
    rels = [decode(p, t) for t, p in msgs]
    rels.sort(key=lambda r: (r.elo, r.dev))  # a fleet: every device's release of a window, window by window
    with psycopg.connect(dsn, autocommit=True) as conn:
        def one(sql: str, args: tuple[Any, ...] = ()) -> Any:
            row = conn.execute(sql, args).fetchone()
            assert row is not None
            return row[0]

        lsn0 = _lsn(one("SELECT pg_current_wal_lsn()::text"))
        now = time.time()
        for i in range(0, len(rels), 256):
            st.commit_group([Pending(r.payload, "pansketch/%s/release" % r.dev, now, rel=r, device=r.dev)
                             for r in rels[i:i + 256]])
        wal = _lsn(one("SELECT pg_current_wal_lsn()::text")) - lsn0
        conn.execute("VACUUM ANALYZE")

        def size(tables: tuple[str, ...]) -> int:
            return sum(int(one("SELECT pg_total_relation_size(%s)", (t,))) for t in tables)

        n = len(rels)
        rtabs = ("releases", "devices")
        utabs = ("rollups", "rollup_noise", "rollup_devices")
        windows = len({r.win for r in rels})
        out = {"releases": n, "devices": len({r.dev for r in rels}), "windows": windows,
               "release_bytes": len(rels[0].payload),
               "releases_table_bytes_per_release": round(size(rtabs) / n),
               "rollup_bytes_per_window": round(size(utabs) / windows),
               "rollup_bytes_per_release": round(size(utabs) / n),
               "wal_bytes_per_release_groups_of_256": round(wal / n)}
        for t in utabs:  # per row: a window's sums (8 d w bytes) once per writer shard; a row per device
            rows = int(one("SELECT count(*) FROM %s" % t))
            out["%s_bytes_per_row" % t] = round(size((t,)) / max(1, rows))
        while st.prune(time.time() + 1, limit=5000):
            pass
        conn.execute("VACUUM FULL releases")
        out["pruned_releases_table_bytes_per_release"] = round(size(rtabs) / n)
    st.close()
    return out


PROCESS_KEYS = {"aggregator": "aggregator", "pansketch.host_tools.ingest.mqttproc": "mqtt_helper",
                "pansketch.host_tools.ingest.validproc": "validation_helper"}


def flat_ingest(rounds: list[dict[str, Any]], key: str = "aggregator_sqlite") -> dict[str, Any]:
    """The headline ingest figures as flat keys (the ``make bench`` report reads them): 1 aggregator on
    SQLite (the runs under ``key``) vs the bare paho subscriber of the same round (medians over the
    interleaved rounds); CPU microseconds per stored release of each pansketch process and their total
    (mosquitto apart)."""
    ours = [x[key] for x in rounds]
    peers = [x["peer"] for x in rounds]
    ratios = [o["releases_per_second"] / p["releases_per_second"] for o, p in zip(ours, peers)]
    out: dict[str, Any] = {
        "ingest_ratio_vs_paho": round(statistics.median(ratios), 3),
        "ingest_ratio_vs_paho_rounds": [round(r, 3) for r in ratios],
        "ingest_releases_per_second": statistics.median(o["releases_per_second"] for o in ours),
        "paho_releases_per_second": statistics.median(p["releases_per_second"] for p in peers),
        "ingest_loadavg_1min_rounds": [round(x["loadavg_at_start"][0], 2) for x in rounds],
        "ingest_release_bytes": ours[0]["release_bytes"],
        "ingest_releases_per_round": ours[0]["releases"],
    }
    totals = []
    per: dict[str, list[float]] = {v: [] for v in PROCESS_KEYS.values()}
    for o in ours:
        cpu = o["cpu_us_per_release"]
        totals.append(sum(cpu.get(k, 0) for k in PROCESS_KEYS))
        for k, v in PROCESS_KEYS.items():
            per[v].append(cpu.get(k, 0))
    out["cpu_us_per_release_total"] = statistics.median(totals)
    for v, xs in per.items():
        out["cpu_us_per_release_%s" % v] = statistics.median(xs)
    out["cpu_us_per_release_mosquitto"] = statistics.median(o["cpu_us_per_release"].get("mosquitto", 0) for o in ours)
    out["cpu_us_per_release_paho_peer"] = statistics.median(p["cpu_us_per_release"].get("bare subscriber", 0)
                                                            for p in peers)
    for o in ours[:1]:
        for role, st in sorted(o.get("stages_cpu_us_per_message", {}).items()):
            for k, v in st.items():  # first round's stage split (per message, thread CPU time)
                out["cpu_us_stage_%s_%s" % (role.lower(), k)] = v
    return out


def _sqlite_key(k: int) -> str:
    return "aggregator_sqlite" if k == 1 else "%d_aggregators_sqlite" % k


def _pg_available() -> Optional[str]:
    from pansketch.host_tools.store import pgserver

    if pgserver.binaries() is None:
        return pgserver.MISSING
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 not installed"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=50)
    ap.add_argument("--per-device", type=int, default=80)
    ap.add_argument("--workers", type=int, default=4, help="publisher processes (devices are spread over them)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of peer / aggregator ingest")
    ap.add_argument("--aggregators", default="1", metavar="N,...",
                    help="SQLite ingest with each of these numbers of aggregators on a shared subscription (1)")
    ap.add_argument("--query-devices", type=int, default=50)
    ap.add_argument("--query-windows", type=int, default=168)
    ap.add_argument("--pg-aggregators", default="1,2,4", metavar="N,...",
                    help="PostgreSQL ingest with each of these numbers of aggregators (1,2,4), --rounds rounds")
    ap.add_argument("--pg-warm", action="store_true",
                    help="PostgreSQL: each database knows every device before the timed run (a running fleet)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: ingest,pg,pg-bytes,query")
    ap.add_argument("--store-compress", choices=("default", "both"), default="default",
                    help="SQLite ingest: the aggregators' [store] compress unset (default), or 'both': the runs "
                         "with compress = false, and in each round 1 aggregator again with compress = true "
                         "(keys *_compressed; docs/HOST.md \"Stored encoding\")")
    ap.add_argument("--out", default="bench-results/host.json")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    tmp = tempfile.mkdtemp(prefix="pansketch-bench-")
    msgs = make_releases(args.devices, args.per_device)
    res: dict[str, Any] = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                       "platform": platform.platform(), "loadavg_at_start": os.getloadavg()},
                           "command": "python -m pansketch.host_tools.bench.host " + " ".join(argv if argv is not None else sys.argv[1:])}
    res["release_bytes"] = release_sizes()
    print("release sizes:", res["release_bytes"], flush=True)
    if "ingest" not in skip:
        res["ingest_direct"] = bench_direct(msgs, tmp)
        print("direct (no MQTT):", res["ingest_direct"], flush=True)
        rounds = []
        ks = [int(k) for k in args.aggregators.split(",")]
        for r in range(args.rounds):
            rnd: dict[str, Any] = {"loadavg_at_start": os.getloadavg()}
            rnd["peer"] = bench_ingest(msgs, args.devices, args.workers, tmp, peer=True, tag="p%d" % r)
            print("peer (bare subscriber):", rnd["peer"], flush=True)
            for k in ks:
                ours = bench_ingest(msgs, args.devices, args.workers, tmp, db=os.path.join(tmp, "ingest-%d-%d.db" % (r, k)),
                                    aggregators=k, tag="s%d-%d" % (r, k),
                                    compress=False if args.store_compress == "both" else None)
                print("%d aggregator(s), SQLite:" % k, ours, flush=True)
                rnd[_sqlite_key(k)] = ours
                if k == 1 and args.store_compress == "both":  # the same round, payloads compressed
                    rnd[_sqlite_key(k) + "_compressed"] = bench_ingest(
                        msgs, args.devices, args.workers, tmp, db=os.path.join(tmp, "ingest-%d-%dz.db" % (r, k)),
                        aggregators=k, tag="z%d-%d" % (r, k), compress=True)
                    print("%d aggregator(s), SQLite, compressed:" % k, rnd[_sqlite_key(k) + "_compressed"], flush=True)
            rounds.append(rnd)
        res["ingest_mqtt_rounds"] = rounds
        if all("releases_per_second" in x[key] for x in rounds for key in x if key != "loadavg_at_start"):
            summary: dict[str, Any] = {"peer_per_second": [x["peer"]["releases_per_second"] for x in rounds],
                                       "loadavg_1min_per_round": [round(x["loadavg_at_start"][0], 2) for x in rounds]}
            summary["peer_median"] = statistics.median(summary["peer_per_second"])
            for k in ks:
                key = _sqlite_key(k)
                rates = [x[key]["releases_per_second"] for x in rounds]
                ratios = [round(x[key]["releases_per_second"] / x["peer"]["releases_per_second"], 3) for x in rounds]
                summary[key] = {"per_second": rates, "median": statistics.median(rates), "ratio_to_peer": ratios,
                                "median_ratio": statistics.median(ratios)}
            res["ingest_mqtt_summary"] = summary
            print("ingest summary:", summary, flush=True)
            if 1 in ks:
                flat = flat_ingest(rounds)
                res.update(flat)
                print("ingest (flat keys):", json.dumps(flat), flush=True)
                if args.store_compress == "both":
                    flat = {k + "_compressed": v for k, v in flat_ingest(rounds, _sqlite_key(1) + "_compressed").items()}
                    res.update(flat)
                    print("ingest, compressed (flat keys):", json.dumps(flat), flush=True)
    if "pg" not in skip:
        why = _pg_available()
        if why is not None:
            res["ingest_postgresql"] = {"skipped": why}
        else:
            from pansketch.host_tools.store import pgserver

            srv = pgserver.PgServer.start(fsync=True)
            try:
                res["ingest_postgresql"] = bench_pg(srv, msgs, args, tmp)
                if "pg-bytes" not in skip:
                    res["ingest_postgresql"]["bytes"] = bench_pg_rows(srv, msgs)
                    print("PostgreSQL bytes:", json.dumps(res["ingest_postgresql"]["bytes"]), flush=True)
            finally:
                srv.stop()
    if "query" not in skip:
        qdb = os.path.join(tmp, "query.db")
        t = time.perf_counter()
        n = build_query_db(qdb, args.query_devices, args.query_windows)
        print("query db: %d releases in %.1f s" % (n, time.perf_counter() - t), flush=True)
        res["query"] = {"devices": args.query_devices, "windows": args.query_windows, "d": 4, "w": 1024}
        res["query"].update(bench_query(qdb, tmp))
        print("query:", json.dumps(res["query"]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print("written to", args.out)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
