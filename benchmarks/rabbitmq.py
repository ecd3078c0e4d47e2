"""Ingest benchmark on a three-node RabbitMQ cluster (a benchmark, not a CI test).

    PYTHONPATH=. python benchmarks/rabbitmq.py [--devices 30] [--per-device 40] [--rounds 2] [--aggregators 1,2]
                                                [--out bench-results/rabbitmq.json]

A cluster from tests/support/rabbit.py (three nodes on loopback, one user per
device); ``devices`` MQTT 3.1.1 clients (paho, QoS 1, their own accounts,
spread over the three nodes' MQTT listeners and over publisher processes)
subscribed to their acks like agents, publish pre-encoded valid releases (pansketch.host_tools.bench.host.make_releases) to
``amq.topic`` via the MQTT plugin; the release queue is a quorum queue on all
three nodes. Consumers, interleaved round by round with the same
publishers:

* the peer: a bare pika consumer that only acknowledges (prefetch 1024,
  one ``basic.ack`` per message), rate = messages / seconds to the last one;
* ``pansketch aggregate`` x N (``[broker] kind = "rabbitmq"``) into one
  SQLite file: validate, group commit, ``basic.ack`` and host acks
  (publisher confirms, ``mandatory``) to every device's MQTT session; rate =
  releases stored / seconds from the first publish to the last commit.

Each run reports CPU time per release of the aggregators and of the three
broker nodes (from /proc). Figures go to ``--out`` as JSON and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pansketch.host_tools.bench.host import (SALT, _count, _cpu_s, _env, _helpers, make_releases,  # noqa: E402
                                   publish_interleaved, start_publishers)
from tests.support.rabbit import AGG_PASSWORD, AGG_USER, Cluster, device_password  # noqa: E402

QUEUE = "pansketch.releases"


def _publisher(ports: list[int], batches: list[list[tuple[str, bytes]]], start: Any, done: Any, tag: str) -> None:
    import paho.mqtt.client as mqtt

    clients = []
    for i, msgs in enumerate(batches):
        dev = msgs[0][0].split("/")[1]
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=dev, protocol=mqtt.MQTTv311, clean_session=True)
        c.username_pw_set(dev, device_password(dev))
        c.max_inflight_messages_set(20)
        c.connect("127.0.0.1", ports[hash(dev) % len(ports)])
        c.loop_start()
        c.subscribe("pansketch/%s/ack" % dev, qos=1)  # like an agent: the host's acks reach a session
        clients.append((c, msgs))
    publish_interleaved(clients, start, done, 300)


def _bare_consumer(amqp_port: int, n: int, ready: Any, out: Any) -> None:
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", amqp_port, credentials=pika.PlainCredentials(AGG_USER, AGG_PASSWORD)))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1024)
    got = [0]
    t_last = [0.0]
    cpu0 = time.process_time()

    def on_msg(c: Any, m: Any, _p: Any, _b: bytes) -> None:
        c.basic_ack(m.delivery_tag)
        got[0] += 1
        if got[0] >= n:
            t_last[0] = time.time()
            c.stop_consuming()

    ch.basic_consume(QUEUE, on_msg)
    ready.set()
    ch.start_consuming()
    out.put((got[0], t_last[0], time.process_time() - cpu0))
    conn.close()


def _declare(c: Cluster) -> None:
    import pika

    from pansketch.host_tools.ingest.amqp import QUEUE_ARGS

    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", c.nodes[0].amqp_port, credentials=pika.PlainCredentials(AGG_USER, AGG_PASSWORD)))
    ch = conn.channel()
    ch.queue_declare(QUEUE, durable=True, arguments=dict(QUEUE_ARGS))
    ch.queue_bind(QUEUE, "amq.topic", routing_key="pansketch.*.release")
    ch.queue_bind(QUEUE, "amq.topic", routing_key="pansketch.*.status")
    conn.close()


def run(c: Cluster, msgs: list[tuple[str, bytes]], workers: int, tmp: str, aggregators: int, tag: str) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    procs: list[subprocess.Popen[bytes]] = []
    out: Any = ctx.Queue()
    db = os.path.join(tmp, "bench-%s.db" % tag)
    sub = None
    if aggregators == 0:
        ready = ctx.Event()
        sub = ctx.Process(target=_bare_consumer, args=(c.nodes[0].amqp_port, len(msgs), ready, out))
        sub.start()
        ready.wait(60)
    else:
        nodes = ", ".join('"127.0.0.1:%d"' % n.amqp_port for n in c.nodes)
        for k in range(aggregators):
            conf = os.path.join(tmp, "host-%s-%d.toml" % (tag, k))
            with open(conf, "w") as f:
                f.write('[broker]\nkind = "rabbitmq"\namqp_nodes = [%s]\nusername = "%s"\npassword = "%s"\n'
                        'client_id = "agg-%s-%d"\n[aggregator]\ndb = "%s"\nmax_bytes = 65536\n[fleet]\nsalt = "%s"\n'
                        % (nodes, AGG_USER, AGG_PASSWORD, tag, k, db, SALT))
            log = os.path.join(tmp, "agg-%s-%d.log" % (tag, k))
            procs.append(subprocess.Popen([sys.executable, "-m", "pansketch.host_tools.cli", "aggregate", "--config", conf, "-q",
                                           "--until-idle", "30"], env=_env(), stdout=subprocess.DEVNULL,
                                          stderr=open(log, "w")))
        time.sleep(3)
    pubs, start, done = start_publishers(ctx, _publisher, [n.mqtt_port for n in c.nodes], msgs, workers, tag)
    time.sleep(2)
    roles: dict[int, str] = {}
    for n in c.nodes:  # the server script and its children (the Erlang VM)
        assert n.proc is not None
        roles.update(dict.fromkeys(_helpers(n.proc.pid), "rabbitmq nodes (3)"))
    for a in procs:
        roles[a.pid] = "aggregators"
    cpu0 = {pid: _cpu_s(pid) for pid in roles}
    t0 = time.perf_counter()
    t0_wall = time.time()
    start.set()
    published = sum(done.get(timeout=900) for _ in pubs)
    t_pub = time.perf_counter() - t0
    cpu: dict[str, float] = {}
    if sub is not None:
        stored, t_end, cpu["bare pika consumer"] = out.get(timeout=900)
        t_all = t_end - t0_wall
        sub.join(30)
    else:
        while _count(db) < len(msgs) and time.perf_counter() - t0 < 900:
            time.sleep(0.05)
        t_all = time.perf_counter() - t0
        stored = _count(db)
    for pid, role in roles.items():
        cpu[role] = cpu.get(role, 0.0) + _cpu_s(pid) - cpu0[pid]
    for pub in pubs:
        pub.join(30)
    for a in procs:
        a.terminate()
    for a in procs:
        a.wait(60)
    return {"consumer": "bare pika consumer (acks only)" if sub is not None else "%d x pansketch aggregate" % aggregators,
            "releases": len(msgs), "published": published, "received_or_stored": stored,
            "seconds_to_publish_all": round(t_pub, 3), "seconds_to_store_all": round(t_all, 3),
            "releases_per_second": round(stored / t_all, 1), "release_bytes": len(msgs[0][1]),
            "cpu_us_per_release": {k: round(v / max(1, stored) * 1e6) for k, v in sorted(cpu.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=30)
    ap.add_argument("--per-device", type=int, default=40)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--aggregators", default="1,2")
    ap.add_argument("--out", default="bench-results/rabbitmq.json")
    a = ap.parse_args(argv)
    msgs = make_releases(a.devices, a.per_device)
    devs = sorted({t.split("/")[1] for t, _p in msgs})
    counts = [0] + [int(x) for x in a.aggregators.split(",")]
    with tempfile.TemporaryDirectory(prefix="pansketch-bench-rabbit-") as tmp:
        t = time.monotonic()
        c = Cluster(os.path.join(tmp, "cluster"), devs)
        print("cluster up in %.1f s" % (time.monotonic() - t), flush=True)
        try:
            _declare(c)
            runs: dict[int, list[dict[str, Any]]] = {k: [] for k in counts}
            for r in range(a.rounds):
                for k in counts:
                    res = run(c, msgs, a.workers, tmp, k, "r%d-a%d" % (r, k))
                    print(json.dumps(res), flush=True)
                    runs[k].append(res)
        finally:
            c.stop()
    rows = []
    for k in counts:
        rates = [x["releases_per_second"] for x in runs[k]]
        rows.append({"consumer": runs[k][0]["consumer"], "releases_per_second_median": statistics.median(rates),
                     "rates": rates, "cpu_us_per_release": runs[k][-1]["cpu_us_per_release"]})
    peer = rows[0]["releases_per_second_median"]
    print("| consumer | releases/s (median) | runs | vs bare pika consumer | CPU µs/release (last run) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| %s | %.0f | %s | %.2fx | %s |" % (row["consumer"], row["releases_per_second_median"], row["rates"],
                                                 row["releases_per_second_median"] / peer, row["cpu_us_per_release"]))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"devices": a.devices, "per_device": a.per_device, "release_bytes": len(msgs[0][1]), "rows": rows,
                   "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
