"""Soak benchmark: steady ingest with broker and aggregator kills (a benchmark, not a CI test).

    python -m pansketch.host_tools.bench.soak [--devices 200] [--rate 1000] [--duration 180] [--workers 4]
                                    [--kills broker,aggregator] [--option KEY=VALUE ...]
                                    [--out bench-results/soak.json]

``devices`` simulated devices (real paho clients, MQTT 3.1.1 persistent
sessions: clean_session False, client id = device id), spread over
``workers`` processes, publish pre-encoded valid releases (cs d=4 w=256,
4.3 KB; random counters, not private data) at ``rate`` releases/s in all
to a real mosquitto (persistence on, the queue limits of
deploy/mosquitto/pansketch.conf) and one real ``pansketch aggregate``
(persistent session, SQLite). Each device behaves like the agent
(docs/FORMAT.md section 7): it keeps every release until the host's
acknowledgement ``{"dev", "ok": [seq, ...]}`` on ``pansketch/<dev>/ack``
and re-sends it after ``--ack-timeout`` seconds (doubling, up to 16x).

Faults, spread over the run: ``broker`` = mosquitto ``kill -9`` and
restart on the same port and persistence file after 2 s; ``aggregator``
= ``kill -9`` of the aggregator and restart after 2 s. After ``duration``
the devices stop releasing and the run drains until every release is
acknowledged (or ``--drain`` seconds pass).

Reported (JSON to ``--out``, and a summary line): WAL and database size
every second (and their peaks), releases per group commit (the
aggregator's own count, logged at its clean exit), CPU per stored release
of mosquitto and the aggregator's three processes (from /proc), ack
latency percentiles (first send to ack, at the device), ``lost``
(released, never stored: must be 0), ``stored_twice`` (a (device, seq)
stored more than once, or roll-ups summing more releases than are stored:
must be 0), ``unacked`` at the end, the broker's resident memory (idle,
and with every device connected: bytes per device connection, for the
capacity plan), the load average, and the CPU per stored release of each
whole minute (``cpu_by_minute``). ``--option`` adds ``[aggregator]``
keys to the aggregator's host.toml (e.g. ``group_wait_ms=0`` to measure
without group waiting). tests/test_soak.py runs a one-minute version (100 devices, 200/s).
"""

from __future__ import annotations

import argparse
import array
import json
import multiprocessing as mp
import os
import platform
import queue
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import numpy as np

from pansketch.host_tools.bench.host import SALT, _cpu_s, _env, _helpers
from pansketch.host_tools.localnet import Mosquitto, free_port

EPOCH0 = 1_700_000_000 // 3600


# the queue and packet limits of deploy/mosquitto/pansketch.conf, and the log lines the run waits for
BROKER_CONF = ("autosave_on_changes false\nmax_queued_messages 30000\nmax_queued_bytes 134217728\n"
               "max_inflight_messages 20\nmax_packet_size 1100000\n"
               "log_type error\nlog_type warning\nlog_type notice\nlog_type information\nlog_type subscribe\n")


def _start_aggregator(tmp: str, conf: str, n: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "pansketch.host_tools.cli", "aggregate", "-q", "--config", conf],
                            env=_env(), stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(tmp, "agg-%d.log" % n), "w"))


def _device_proc(port: int, devs: list[str], period: float, t_start: float, t_stop: float, t_end: float,
                 ack_timeout: float, out: Any) -> None:
    """Simulated devices of one worker process: release every ``period`` s, keep until acked, re-send."""
    import paho.mqtt.client as mqtt

    from pansketch.agent import release
    from pansketch.agent.params import Params

    rng = np.random.default_rng(abs(hash(devs[0])) % (1 << 32))
    lock = threading.Lock()
    outbox: dict[str, dict[int, list[Any]]] = {d: {} for d in devs}  # seq -> [payload, first, next, tries]
    lat: list[float] = []
    published = [0]
    sends = [0]
    clients: dict[str, Any] = {}
    params = {d: Params({"device": d, "salt": SALT, "kind": "cs", "d": 4, "w": 256}) for d in devs}

    def on_message(_c: Any, dev: str, m: Any) -> None:
        try:
            doc = json.loads(m.payload)
        except ValueError:
            return
        now = time.time()
        with lock:
            box = outbox[dev]
            for s in doc.get("ok", []) + [b[0] for b in doc.get("bad", [])]:
                e = box.pop(s, None)
                if e is not None:
                    lat.append(now - e[1])

    def on_connect(c: Any, dev: str, _f: Any, rc: Any, _p: Any = None) -> None:
        c.subscribe("pansketch/%s/ack" % dev, qos=1)

    for d in devs:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=d, clean_session=False,
                        protocol=mqtt.MQTTv311, userdata=d)
        c.on_message = on_message
        c.on_connect = on_connect
        c.reconnect_delay_set(1, 4)
        c.max_inflight_messages_set(20)
        c.connect_async("127.0.0.1", port, keepalive=30)
        c.loop_start()
        clients[d] = c
    offset = {d: period * i / len(devs) for i, d in enumerate(devs)}
    nxt = {d: 0 for d in devs}
    while time.time() < t_end:
        now = time.time()
        for d in devs:
            # the release schedule: seq k at t_start + k * period (+ the device's offset)
            while now < t_stop and t_start + nxt[d] * period + offset[d] <= now:
                k = nxt[d]
                nxt[d] += 1
                ctr = array.array("i")
                ctr.frombytes(rng.integers(-60, 60, 4 * 256, dtype=np.int32).astype("<i4").tobytes())
                pl = release.encode(params[d], k, EPOCH0 + k, EPOCH0 + k + 1, 0, ctr)
                with lock:
                    outbox[d][k] = [pl, now, now + ack_timeout, 1]
                published[0] += 1
                sends[0] += 1
                clients[d].publish("pansketch/%s/release" % d, pl, qos=1)
            with lock:
                due = [(s, e) for s, e in outbox[d].items() if e[2] <= now]
                for s, e in due:
                    e[3] += 1
                    e[2] = now + ack_timeout * min(16, 2 ** (e[3] - 1))
            for s, e in due:
                sends[0] += 1
                clients[d].publish("pansketch/%s/release" % d, e[0], qos=1)
        with lock:
            if now >= t_stop and not any(outbox.values()):
                break
        time.sleep(0.005)
    for c in clients.values():
        c.disconnect()
        c.loop_stop()
    with lock:
        unacked = {d: sorted(b) for d, b in outbox.items() if b}
    out.put({"published": published[0], "sends": sends[0], "latencies": lat, "unacked": unacked,
             "released": {d: nxt[d] for d in devs}})


def _rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes (0 if unknown)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for ln in f:
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _db_files(db: str) -> tuple[int, int]:
    def size(p: str) -> int:
        try:
            return os.path.getsize(p)
        except OSError:
            return 0

    return size(db), size(db + "-wal")


def _stored_estimate(db: str) -> int:
    try:
        con = sqlite3.connect("file:%s?mode=ro" % db, uri=True, timeout=1)
        try:
            r = con.execute("SELECT MAX(rowid) FROM releases").fetchone()
            return int(r[0] or 0)
        finally:
            con.close()
    except sqlite3.Error:
        return -1


def cpu_by_window(series: list[dict[str, Any]], step: float, duration: float) -> list[dict[str, Any]]:
    """CPU per stored release in each whole ``step`` seconds of the releasing part of a run, per process
    role (µs), from the per-second samples: where the figure of a long run came from. mosquitto's
    column knows nothing of the database: when it rises with ours, the machine slowed, not the store."""
    pts = [x for x in series if "cpu_s" in x and x.get("stored") is not None and x["t"] >= 0]
    marks = []
    k = 0
    for x in pts:  # the first sample at or after each window boundary
        if x["t"] >= k * step:
            marks.append(x)
            k = int(x["t"] // step) + 1
    out = []
    for a, b in zip(marks, marks[1:]):
        n = b["stored"] - a["stored"]
        if b["t"] > duration + 1.5 or n <= 0:  # a window reaching into the drain, or nothing stored
            continue
        us = {r: round((c - a["cpu_s"].get(r, 0.0)) / n * 1e6, 1) for r, c in sorted(b["cpu_s"].items())}
        out.append({"t": a["t"], "stored": b["stored"], "cpu_us_per_release": us})
    return out


def _pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    return round(float(np.percentile(np.array(xs), q)), 4)


def run(devices: int, rate: float, duration: float, workers: int, kills: list[str], tmp: str,
        options: Optional[dict[str, str]] = None, ack_timeout: float = 10.0, drain: float = 120.0,
        log: Any = print) -> dict[str, Any]:
    """One soak run in directory ``tmp``; returns the figures (see the module docstring)."""
    port = free_port()
    db = os.path.join(tmp, "soak.db")
    conf = os.path.join(tmp, "host.toml")
    extra = "".join("%s = %s\n" % (k, v) for k, v in (options or {}).items())
    with open(conf, "w") as f:
        f.write('[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "soak-agg"\nreconnect_max_s = 2\n'
                '[aggregator]\ndb = "%s"\n%s[fleet]\nsalt = "%s"\n' % (port, db, extra, SALT))
    broker = Mosquitto(tmp, port, BROKER_CONF, persistent=True, autosave_interval=1)
    aggs = [_start_aggregator(tmp, conf, 0)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the aggregator (quiet) has subscribed: the broker logs it
        with open(broker.log_path, "rb") as logf:
            if b"soak-agg 1 pansketch/+/release" in logf.read():
                break
        time.sleep(0.05)
    rss_idle = _rss(broker.pid)  # the broker with only the aggregator connected
    ctx = mp.get_context("fork")
    out: Any = ctx.Queue()
    names = ["soak-%04d" % i for i in range(devices)]
    period = devices / rate
    t_start = time.time() + 3.0  # devices connected
    t_stop = t_start + duration
    t_end = t_stop + drain
    procs = [ctx.Process(target=_device_proc, args=(port, names[i::workers], period, t_start, t_stop, t_end,
                                                    ack_timeout, out)) for i in range(workers)]
    for p in procs:
        p.start()
    # faults at evenly spread times inside the run
    plan = [(t_start + duration * (i + 1) / (len(kills) + 1), k) for i, k in enumerate(kills)]
    events: list[dict[str, Any]] = []
    series: list[dict[str, Any]] = []
    cpu_last: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds last seen)
    cpu_done: dict[str, float] = {}  # CPU of processes that are gone, per role
    cpu_base: dict[int, float] = {}

    def sample_cpu() -> None:
        roles = {broker.pid: "mosquitto"}
        roles.update({pid: r for a in aggs if a.poll() is None for pid, r in _helpers(a.pid).items()})
        for pid, role in roles.items():
            c = _cpu_s(pid)
            if pid not in cpu_base:
                cpu_base[pid] = c if time.time() < t_start else 0.0
            if c > 0:
                cpu_last[pid] = (role, c)

    results: list[dict[str, Any]] = []
    next_sample = time.time()
    while len(results) < workers:
        now = time.time()
        if plan and now >= plan[0][0]:
            _t, what = plan.pop(0)
            if what == "broker":
                sample_cpu()
                broker.kill()
                events.append({"t": round(now - t_start, 1), "event": "broker kill -9"})
                log("broker killed at %.1f s" % (now - t_start))
                time.sleep(2)
                broker.start()
            elif what == "aggregator":
                sample_cpu()
                aggs[-1].send_signal(signal.SIGKILL)
                aggs[-1].wait()
                events.append({"t": round(now - t_start, 1), "event": "aggregator kill -9"})
                log("aggregator killed at %.1f s" % (now - t_start))
                time.sleep(2)
                aggs.append(_start_aggregator(tmp, conf, len(aggs)))
        if now >= next_sample:
            next_sample += 1.0
            sample_cpu()
            size, wal = _db_files(db)
            cpu_s: dict[str, float] = {}
            for pid, (role, c) in cpu_last.items():  # per role, since the run's start
                cpu_s[role] = cpu_s.get(role, 0.0) + c - cpu_base.get(pid, 0.0)
            series.append({"t": round(now - t_start, 1), "db_bytes": size, "wal_bytes": wal,
                           "stored": _stored_estimate(db), "broker_rss_bytes": _rss(broker.pid),
                           "loadavg_1min": round(os.getloadavg()[0], 2), "cpu_s": cpu_s})
        try:
            results.append(out.get(timeout=0.2))
        except queue.Empty:
            continue
    for p in procs:
        p.join(30)
    t_done = time.time()
    sample_cpu()
    aggs[-1].send_signal(signal.SIGTERM)  # a clean exit logs its group commits
    aggs[-1].wait(60)
    broker.stop()
    for pid, (role, c) in cpu_last.items():
        cpu_done[role] = cpu_done.get(role, 0.0) + c - cpu_base.get(pid, 0.0)
    # ground truth from the database
    con = sqlite3.connect(db)
    try:
        stored_rows = {(d, s) for d, s in con.execute("SELECT device, seq FROM releases")}
        twice = con.execute("SELECT COUNT(*) FROM (SELECT device, seq FROM releases GROUP BY device, seq "
                            "HAVING COUNT(*) > 1)").fetchone()[0]
        n_rows = con.execute("SELECT COUNT(*) FROM releases").fetchone()[0]
        rolled = con.execute("SELECT COALESCE(SUM(releases), 0) FROM rollups").fetchone()[0]
        dups = con.execute("SELECT COUNT(*) FROM duplicates").fetchone()[0]
    finally:
        con.close()
    released: dict[str, int] = {}
    lat: list[float] = []
    unacked = 0
    published = sends = 0
    for r in results:
        released.update(r["released"])
        lat += r["latencies"]
        unacked += sum(len(v) for v in r["unacked"].values())
        published += r["published"]
        sends += r["sends"]
    lost = sum(1 for d, n in released.items() for s in range(n) if (d, s) not in stored_rows)
    groups = None
    text = open(os.path.join(tmp, "agg-%d.log" % (len(aggs) - 1))).read()
    m = re.search(r"(\d+) group commit\(s\), ([0-9.]+) messages per group", text)
    if m:
        groups = {"group_commits": int(m.group(1)), "releases_per_commit": float(m.group(2)),
                  "of": "the last aggregator incarnation (from its restart to the end)"}
    ck = re.findall(r"WAL checkpoints: (\d+) completed, (\d+) gave up", text)
    pruned = re.findall(r"(\d+) pruned \(retention\)", text)
    stored = len(stored_rows)
    cpu_us = {k: round(v / max(1, stored) * 1e6) for k, v in sorted(cpu_done.items())}
    cpu_us["total"] = sum(cpu_us.values())
    wal_peak = max([x["wal_bytes"] for x in series] or [0])
    # broker memory with every device connected (the releasing part of the run, the broker not restarting)
    rss = sorted(x["broker_rss_bytes"] for x in series if 0 <= x["t"] <= duration and x["broker_rss_bytes"])
    rss_run = rss[len(rss) // 2] if rss else 0
    return {"devices": devices, "rate_target": rate, "duration_s": duration, "workers": workers,
            "ack_timeout_s": ack_timeout, "options": options or {}, "events": events,
            "released": published, "sends_incl_resends": sends, "stored": stored, "rows": n_rows,
            "rollup_releases": int(rolled), "duplicates_logged": int(dups),
            "lost": lost, "stored_twice": int(twice) + max(0, int(rolled) - n_rows), "unacked_at_end": unacked,
            "seconds_to_drain": round(t_done - t_stop, 1),
            "achieved_rate": round(published / duration, 1),
            "wal_peak_mb": round(wal_peak / 2**20, 1),
            "db_final_mb": round(_db_files(db)[0] / 2**20, 1),
            "group_commit": groups,
            "wal_checkpoints": {"completed": int(ck[-1][0]), "gave_up": int(ck[-1][1])} if ck else None,
            "pruned_by_last_aggregator": int(pruned[-1]) if pruned else None,
            "cpu_us_per_release": cpu_us,
            "cpu_by_minute": cpu_by_window(series, 60.0, duration),
            "broker_rss_mb": {"idle": round(rss_idle / 2**20, 1), "median_while_releasing": round(rss_run / 2**20, 1),
                              "bytes_per_device_connection": round((rss_run - rss_idle) / max(1, devices))
                              if rss_run and rss_idle else None},
            "loadavg_1min": {"median": _pct([x["loadavg_1min"] for x in series], 50),
                             "max": _pct([x["loadavg_1min"] for x in series], 100)},
            "ack_latency_s": {"p50": _pct(lat, 50), "p90": _pct(lat, 90), "p99": _pct(lat, 99),
                              "max": _pct(lat, 100), "n": len(lat)},
            "series": series}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1000.0, help="releases per second, all devices together")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of releasing")
    ap.add_argument("--workers", type=int, default=4, help="device processes")
    ap.add_argument("--kills", default="broker,aggregator", help="comma list of faults in order (broker, aggregator)")
    ap.add_argument("--ack-timeout", type=float, default=10.0)
    ap.add_argument("--drain", type=float, default=120.0, help="seconds to wait for the last acks")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an [aggregator] key for the aggregator's host.toml (repeatable)")
    ap.add_argument("--out", default="bench-results/soak.json")
    args = ap.parse_args(argv)
    opts = dict(o.split("=", 1) for o in args.option)
    tmp = tempfile.mkdtemp(prefix="pansketch-soak-")
    try:
        res = run(args.devices, args.rate, args.duration, args.workers,
                  [k for k in args.kills.split(",") if k], tmp, opts, args.ack_timeout, args.drain)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()}
    res["command"] = "python -m pansketch.host_tools.bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("series", "cpu_by_minute")}))
    for w in res["cpu_by_minute"]:
        print("minute from %5.0f s, %7d stored: %s" % (w["t"], w["stored"], ", ".join(
            "%s %.0f" % (r, v) for r, v in w["cpu_us_per_release"].items())))
    print("written to", args.out)
    return 0 if res["lost"] == 0 and res["stored_twice"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
