"""Host benchmark: ingest rate through mosquitto, release size, query latency.

    python -m host_tools.bench_host [--devices 50] [--per-device 40] [--out bench-results/host.json]

* release size: encoded bytes of a release for a few (kind, d, w);
* ingest: ``devices`` concurrent MQTT clients (one per device id, spread
  over worker processes) publish pre-encoded valid releases at QoS 1 to a
  mosquitto started on a free loopback port; one ``pansketch aggregate``
  process validates and stores them. Rate = releases stored / seconds from
  the first publish to the last commit. Baseline in the same run: the same
  releases through ``Aggregator.handle`` in-process (validation + SQLite,
  no MQTT), so the ratio shows what the transport costs;
* query latency: ``freq`` of one item over one window (``devices``
  releases merged) and over everything; ``topk`` over 100,000 candidates
  in one window; baseline: hashing the candidates with the device path
  (agent.hashing) instead of host_tools.fasthash.

The counters are random int32 values, not noise drawn by agent.noise: they
are benchmark payloads of the right size and format, not private data.
Figures are written as JSON to ``--out``. Needs mosquitto for the ingest
part (skipped with a note otherwise).
"""

from __future__ import annotations

import argparse
import array
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

from agent import hashing, release
from agent.params import Params

SALT = "bench-fleet-salt"
EPOCH0 = 1_700_000_000 // 3600


def make_releases(devices: int, per_device: int, d: int = 4, w: int = 1024, seed: int = 1) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(seed)
    out = []
    for dv in range(devices):
        p = Params({"device": "bench-%03d" % dv, "salt": SALT, "kind": "cs", "d": d, "w": w})
        for k in range(per_device):
            ctr = array.array("i")
            ctr.frombytes(rng.integers(-60, 60, d * w, dtype=np.int32).astype("<i4").tobytes())
            out.append(("pansketch/%s/release" % p.device, release.encode(p, k, EPOCH0 + k, EPOCH0 + k + 1, 0, ctr)))
    return out


def release_sizes() -> dict[str, int]:
    out = {}
    for kind, d, w in (("cs", 4, 1024), ("cs", 5, 2048), ("cms", 4, 256), ("cs", 8, 4096)):
        p = Params({"device": "pi-kitchen-01", "salt": SALT, "kind": kind, "d": d, "w": w})
        ctr = array.array("i", [0] * (d * w))
        out["%s d=%d w=%d" % (kind, d, w)] = len(release.encode(p, 123456, EPOCH0, EPOCH0 + 1, 0, ctr))
    return out


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _start_mosquitto(tmp: str) -> Optional[tuple[subprocess.Popen[bytes], int]]:
    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
    if exe is None:
        return None
    port = _free_port()
    conf = os.path.join(tmp, "mosquitto.conf")
    with open(conf, "w") as f:
        f.write("listener %d 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n" % port)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            f.write("user root\n")
    log = open(os.path.join(tmp, "mosquitto.log"), "ab")
    proc = subprocess.Popen([exe, "-c", conf], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.02)
    proc.terminate()
    return None


def _publisher(port: int, batches: list[list[tuple[str, bytes]]], start: Any, done: Any) -> None:
    import paho.mqtt.client as mqtt

    clients = []
    for msgs in batches:
        dev = msgs[0][0].split("/")[1]
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=dev, protocol=mqtt.MQTTv5)
        c.max_inflight_messages_set(20)
        c.connect("127.0.0.1", port)
        c.loop_start()
        clients.append((c, msgs))
    start.wait()
    infos = []
    # interleave the devices like concurrent agents
    for k in range(max(len(m) for _c, m in clients)):
        for c, msgs in clients:
            if k < len(msgs):
                infos.append(c.publish(msgs[k][0], msgs[k][1], qos=1))
    for i in infos:
        i.wait_for_publish(120)
    for c, _m in clients:
        c.disconnect()
        c.loop_stop()
    done.put(len(infos))


def _count(db: str) -> int:
    import sqlite3

    try:
        con = sqlite3.connect(db, timeout=5)
        try:
            return int(con.execute("SELECT COUNT(*) FROM releases").fetchone()[0])
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def bench_ingest(msgs: list[tuple[str, bytes]], devices: int, workers: int, tmp: str) -> dict[str, Any]:
    started = _start_mosquitto(tmp)
    if started is None:
        return {"skipped": "mosquitto not installed"}
    broker, port = started
    db = os.path.join(tmp, "ingest.db")
    conf = os.path.join(tmp, "host.toml")
    with open(conf, "w") as f:
        f.write('[broker]\nhost = "127.0.0.1"\nport = %d\n[aggregator]\ndb = "%s"\nmax_bytes = 65536\n'
                '[fleet]\nsalt = "%s"\n' % (port, db, SALT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + env.get("PYTHONPATH", "")
    agg = subprocess.Popen([sys.executable, "-m", "host_tools.cli", "aggregate", "--config", conf, "--until-idle", "5"],
                           env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "agg.log"), "w"))
    try:
        by_dev: dict[str, list[tuple[str, bytes]]] = {}
        for t, p in msgs:
            by_dev.setdefault(t, []).append((t, p))
        groups = list(by_dev.values())
        ctx = mp.get_context("fork")
        start = ctx.Event()
        done: Any = ctx.Queue()
        procs = [ctx.Process(target=_publisher, args=(port, groups[i::workers], start, done)) for i in range(workers)]
        for p in procs:
            p.start()
        time.sleep(2.0)  # aggregator subscribed, publishers connected
        t0 = time.perf_counter()
        start.set()
        published = sum(done.get(timeout=600) for _ in procs)
        t_pub = time.perf_counter() - t0
        while _count(db) < len(msgs) and time.perf_counter() - t0 < 600:
            time.sleep(0.02)
        t_all = time.perf_counter() - t0
        stored = _count(db)
        for p in procs:
            p.join(30)
    finally:
        agg.terminate()
        agg.wait(30)
        broker.terminate()
        broker.wait(10)
    return {"clients": devices, "publisher_processes": workers, "releases": len(msgs), "published": published,
            "stored": stored, "seconds_to_publish_all": round(t_pub, 3), "seconds_to_store_all": round(t_all, 3),
            "releases_per_second": round(stored / t_all, 1), "release_bytes": len(msgs[0][1]),
            "megabytes_per_second": round(stored * len(msgs[0][1]) / t_all / 1e6, 2)}


def bench_direct(msgs: list[tuple[str, bytes]], tmp: str) -> dict[str, Any]:
    from host_tools import hostconfig
    from host_tools.aggregator import Aggregator
    from host_tools.decode import decode

    cfg = hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": os.path.join(tmp, "direct.db")}})
    a = Aggregator(cfg)
    t = time.perf_counter()
    for tp, pl in msgs:
        a.handle(tp, pl)
    dt = time.perf_counter() - t
    a.close()
    t = time.perf_counter()
    for tp, pl in msgs:
        decode(pl, tp)
    dv = time.perf_counter() - t
    return {"releases_per_second": round(len(msgs) / dt, 1), "validate_only_per_second": round(len(msgs) / dv, 1)}


def _timeit(fn: Any, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_query(db: str, n_cand: int = 100_000) -> dict[str, Any]:
    from host_tools import fasthash, query
    from host_tools.store import Store

    st = Store(db, readonly=True)
    cands = ["cand-%d" % i for i in range(n_cand)]
    out: dict[str, Any] = {"releases_in_db": st.release_count()}
    out["freq_1_item_one_window_s"] = round(_timeit(lambda: query.freq(st, ["cand-1"], salt=SALT, window=EPOCH0)), 4)
    out["freq_1_item_all_releases_s"] = round(_timeit(lambda: query.freq(st, ["cand-1"], salt=SALT), 3), 4)
    out["topk_10_of_%d_one_window_s" % n_cand] = round(
        _timeit(lambda: query.topk(st, cands, 10, salt=SALT, window=EPOCH0), 3), 4)
    t_fast = _timeit(lambda: fasthash.cols_signs(fasthash.streams(cands, SALT, 4), 4, 1024), 3)
    prefix = hashing.salt_prefix(SALT)
    t_dev = _timeit(lambda: [hashing.columns(prefix, x, 4, 1024) for x in cands], 1)
    out["hash_%d_candidates_fasthash_s" % n_cand] = round(t_fast, 4)
    out["hash_%d_candidates_device_path_s" % n_cand] = round(t_dev, 4)
    out["fasthash_speedup"] = round(t_dev / t_fast, 1)
    st.close()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=50)
    ap.add_argument("--per-device", type=int, default=40)
    ap.add_argument("--workers", type=int, default=5, help="publisher processes (devices are spread over them)")
    ap.add_argument("--out", default="bench-results/host.json")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="pansketch-bench-")
    msgs = make_releases(args.devices, args.per_device)
    res: dict[str, Any] = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                       "platform": platform.platform()},
                           "command": "python -m host_tools.bench_host " + " ".join(argv if argv is not None else sys.argv[1:])}
    res["release_bytes"] = release_sizes()
    print("release sizes:", res["release_bytes"])
    res["ingest_direct_baseline"] = bench_direct(msgs, tmp)
    print("direct (no MQTT):", res["ingest_direct_baseline"])
    res["ingest_mqtt"] = bench_ingest(msgs, args.devices, args.workers, tmp)
    print("through mosquitto:", res["ingest_mqtt"])
    if "releases_per_second" in res["ingest_mqtt"]:
        res["ingest_mqtt_vs_direct"] = round(res["ingest_mqtt"]["releases_per_second"]
                                             / res["ingest_direct_baseline"]["releases_per_second"], 3)
    res["query"] = bench_query(os.path.join(tmp, "direct.db"))
    print("query:", res["query"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print("written to", args.out)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
