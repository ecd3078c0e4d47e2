"""Hostile-input benchmark: every class of bad message, in process and live through mosquitto.

``python -m pansketch.host_tools.bench.hostile`` (needs mosquitto) prints and writes
bench-results/hostile.md and hostile.json: for each input class (docs/HOST.md
"Hostile input"), the class is published through a real mosquitto into a
running aggregator (``pansketch.host_tools.ingest.service.run``, its MQTT and validation
helper processes); then one real agent (``python -m pansketch.agent.pi.daemon feed``,
a new device each time) publishes a valid release and waits for the host's
acknowledgement. Columns:

* in-process: the slowest single input of the class through the whole
  validation step (:func:`pansketch.host_tools.ingest.validproc.verdict`), ms of CPU time;
* time to reject: from the first publish until the aggregator has stored
  the outcome of every message of the class (or of the last one, when the
  broker dropped some because its queue for the aggregator was full: shown
  with the messages), s;
* alive: the aggregator thread still runs after the class;
* next valid: from the agent's start until it exits with its release stored
  and acknowledged, s (the agent exits 0 only then);
* rows / bytes stored: rejection + quarantine rows and the bytes they keep,
  after the class (caps: ``rejections_max_rows`` etc.).

The input classes come from :func:`hostile_inputs`, shared with
tests/test_hostile.py (the CI versions: in-process fuzz and a short live run).
"""

from __future__ import annotations

import argparse
import array
import json
import os
import random
import sys
import tempfile
import threading
import time
from fractions import Fraction
from typing import Any, Iterator, Optional

import cbor2

from pansketch.agent import cbor, release
from pansketch.agent.params import Params
from pansketch.host_tools.bench.localfleet import SALT  # the real agents' fleet salt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = 1_700_000_000 - 1_700_000_000 % 3600


def params(device: str, **kw: Any) -> Params:
    cfg = {"device": device, "salt": SALT, "kind": "cs", "d": 4, "w": 64, "window_s": 3600}
    cfg.update(kw)
    return Params(cfg)


def valid(device: str = "fuzz-dev", seq: int = 0, elo: Optional[int] = None, fill: int = 0, **kw: Any) -> bytes:
    """A valid release (hand-made counters) of ``device`` for the fleet salt."""
    p = params(device, **kw)
    e = T0 // p.epoch_s if elo is None else elo
    return release.encode(p, seq, e, e + 1, 0, array.array("i", [fill] * (p.d * p.w)), 2)


def release_map(device: str = "fuzz-dev", **over: Any) -> dict[str, Any]:
    p = params(device)
    e = T0 // p.epoch_s
    m = release.release_map(p, 0, e, e + 1, 0, array.array("i", [0] * (p.d * p.w)))
    m["ctr"] = bytes(m["ctr"])
    m.update(over)
    return m


def topic(dev: str) -> str:
    return "pansketch/%s/release" % dev


def _head(major: int, n: int) -> bytes:
    return cbor._head(major, n)


def billion_laughs(levels: int = 7, fan: int = 100) -> bytes:
    """Value sharing (tags 28/29): each level an array of ``fan`` references to the one below (~1.8 KB)."""
    out = bytearray(b"\xd8\x1c" + _head(4, 1) + b"\x00")  # shared #0: [0]
    for i in range(1, levels + 1):
        out = bytearray(b"\xd8\x1c" + _head(4, fan)) + out + (b"\xd8\x1d" + _head(0, i - 1)) * (fan - 1)
    return bytes(out)


def nested_rationals(size: int = 900_000) -> bytes:
    """Tag 30 (rational) of two huge bignums (tag 2): quadratic gcd in a CBOR object decoder."""
    half = size // 2
    big = b"\xd8\x1e" + _head(4, 2) + b"\xc2" + _head(2, half) + b"\xff" * half + b"\xc2" + _head(2, half - 8) + \
        b"\xfd" * (half - 8)
    return _head(5, 1) + cbor.dumps("budget") + big


def hostile_inputs(rng: random.Random, mutations: int = 200) -> Iterator[tuple[str, str, bytes]]:
    """(class, topic, payload) for every hostile input class."""
    good = valid()
    t = topic("fuzz-dev")
    m = release_map()
    yield "billion laughs (tags 28/29)", t, billion_laughs()
    yield "rationals 900 KB (tag 30)", t, nested_rationals()
    for tag in (0, 1, 2, 3, 24, 28, 29, 30, 55799, 0xFFFFFFFF):
        yield "tags", t, _head(5, 1) + cbor.dumps("v") + _head(6, tag) + b"\x02"
    yield "tags", t, cbor2.dumps(dict(m, seq=2 ** 70))
    yield "tags", t, cbor2.dumps(dict(m, budget=Fraction(1, 3)))
    for f in (b"\xf9\x3c\x00", b"\xfa\x3f\x80\x00\x00", b"\xfb" + b"\x3f\xf0" + b"\x00" * 6, b"\xf7", b"\xf0",
              b"\xf8\x20"):
        yield "floats / simple values", t, _head(5, 1) + cbor.dumps("clip") + f
    for depth in (9, 100, 10_000, 500_000):
        yield "deep nesting", t, b"\x81" * depth + b"\x00"
        yield "deep nesting", t, b"\xa1\x61a" * depth + b"\x00"
    for major in (2, 3, 4, 5):
        for n in (1 << 31, (1 << 64) - 1, 1 << 20):
            yield "huge lengths", t, _head(major, n) + b"\x00" * 16
    yield "huge lengths", t, _head(4, 100_000) + b"\x00" * 100_000  # 100k items, each one byte
    yield "huge lengths", t, _head(5, 50_000) + b"".join(cbor.dumps("k%d" % i) + b"\x00" for i in range(50_000))
    for ib in (b"\x5f", b"\x7f", b"\x9f", b"\xbf", b"\xff", b"\x1c", b"\x3f"):
        yield "indefinite / reserved", t, ib + b"\x41a\xff"
    for k, v in (("budget", [2, 4]), ("nout", [10 ** 18, 2 * 10 ** 18]), ("budget", [(1 << 63) - 1, (1 << 63) - 2]),
                 ("nint", [(1 << 62) + 1, 3]), ("budget", [1, (1 << 63) - 1])):
        yield "fractions", t, cbor.dumps(dict(m, **{k: v}))
    for cut in sorted(set(rng.randrange(1, len(good)) for _ in range(40))):
        yield "truncations", t, good[:cut]
    for _ in range(mutations):
        b = bytearray(good)
        for _k in range(rng.randint(1, 8)):
            op = rng.random()
            i = rng.randrange(len(b))
            if op < 0.6:
                b[i] = rng.randrange(256)
            elif op < 0.8:
                b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
            else:
                del b[i:i + rng.randint(1, 9)]
        yield "mutations of a valid release", t, bytes(b)
    for _ in range(20):
        yield "random bytes", t, bytes(rng.randrange(256) for _ in range(rng.randint(1, 4000)))
    yield "oversized", t, b"\x5a" + (2 << 20).to_bytes(4, "big") + b"\x00" * (2 << 20)
    yield "bad identifiers / topics", "x/y/z/fuzz-dev/release", good
    yield "bad identifiers / topics", topic("fuzz-d\u0435v"), good  # Cyrillic e in the topic
    yield "bad identifiers / topics", topic("fuzz-d\u0435v"), cbor.dumps(dict(m, dev="fuzz-d\u0435v"))
    yield "bad identifiers / topics", topic("fuzz-dev\uff11"), cbor.dumps(dict(m, dev="fuzz-dev\uff11"))
    yield "bad identifiers / topics", topic("other-dev"), good


def forgeries(now: float) -> Iterator[tuple[str, str, bytes]]:
    """Valid releases the host must quarantine: a window a day ahead, in 2038, and seq 2^32 - 1."""
    ep = 3600
    yield "forged future window", topic("fuzz-fut"), valid("fuzz-fut", elo=int(now) // ep + 24)
    yield "forged future window", topic("fuzz-fut"), valid("fuzz-fut", seq=1, elo=2_145_916_800 // ep)
    yield "forged seq jump", topic("fuzz-seq"), valid("fuzz-seq", seq=0xFFFFFFFF)


def in_process(cls_inputs: list[tuple[str, str, bytes]]) -> dict[str, tuple[int, float, dict[str, int]]]:
    """Per class: (inputs, slowest verdict in ms, codes) through pansketch.host_tools.ingest.validproc.verdict."""
    from pansketch.host_tools.ingest.validproc import Settings, verdict

    s = Settings(None, 1 << 20)  # fleet checks are a few comparisons
    out: dict[str, tuple[int, float, dict[str, int]]] = {}
    for cls, t, p in cls_inputs:
        t0 = time.thread_time()  # CPU time: the machine's other load does not count
        v = verdict(s, t, p)
        dt = (time.thread_time() - t0) * 1000
        n, worst, codes = out.get(cls, (0, 0.0, {}))
        code = v[1] if v[0] == "rejected" else "ok"
        codes[code] = codes.get(code, 0) + 1
        out[cls] = (n + 1, max(worst, dt), codes)
    return out


def _agent_release(port: int, root: str, device: str, timeout: float = 60) -> tuple[bool, float]:
    """A real agent (new device) publishes one release; (stored and acknowledged, seconds)."""
    import subprocess

    from pansketch.host_tools.bench.localfleet import agent_cmd, agent_env, agent_toml

    cfg = agent_toml(os.path.join(root, device + ".toml"), device, port, os.path.join(root, device))
    t0 = time.monotonic()
    r = subprocess.run(agent_cmd("feed", cfg, "--timeout", str(int(timeout)), "--insecure-seed", device,
                                 "--clock-start", str(T0 + 5), "--clock-speed", "0"),
                       input=b"apple\n" * 10, capture_output=True, env=agent_env(), timeout=timeout + 30,
                       cwd=REPO)
    return r.returncode == 0, time.monotonic() - t0


SHIPPED_CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "deploy", "mosquitto", "pansketch.conf")


def shipped_queue_limits() -> str:
    """The ``max_queued_*`` lines of the shipped broker config, so a test broker queues what ours would.

    mosquitto's own default (1,000 messages per client) drops part of a
    10^4-message flood whenever the aggregator falls that far behind, which
    depends on the machine's load; the shipped 30,000 holds all of it.
    """
    with open(SHIPPED_CONF) as f:
        lines = [ln.strip() for ln in f if ln.startswith("max_queued_")]
    if len(lines) != 2:
        raise RuntimeError("%s: expected max_queued_messages and max_queued_bytes, found %r" % (SHIPPED_CONF, lines))
    return "\n".join(lines) + "\n"


def live(classes: list[tuple[str, list[tuple[str, bytes]]]], root: str, agent_timeout: float = 30,
         limits: str = "", stall_s: float = 10.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each class through mosquitto (with the shipped queue limits) into a running aggregator, then one real
    agent's release. A class ends when every message is handled, or when nothing more was handled for
    ``stall_s`` seconds (``dropped_by_broker`` then says how many never came)."""
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest import service
    from pansketch.host_tools.store.sqlite import Store
    from pansketch.host_tools import localnet
    from pansketch.host_tools.localnet import Mosquitto
    from pansketch.host_tools.bench.localfleet import host_toml

    b = Mosquitto(root, conf_extra=shipped_queue_limits())
    db = os.path.join(root, "host.db")
    conf = host_toml(os.path.join(root, "host.toml"), b.port, db, client_id="hostile-host")
    with open(conf) as f:
        text = f.read()
    with open(conf, "w") as f:
        f.write(text.replace("[aggregator]\n", "[aggregator]\nreject_log_interval_s = 5\n" + limits))
    cfg = hostconfig.load(conf)
    stop, ready = threading.Event(), threading.Event()
    counts: dict[str, int] = {}
    rc: list[int] = []
    th = threading.Thread(target=lambda: rc.append(service.run(cfg, stop=stop, ready=ready, counts=counts)),
                         daemon=True)
    th.start()
    assert ready.wait(20), "aggregator did not subscribe"
    ro = Store(db, readonly=True)
    rows: list[dict[str, Any]] = []

    def handled() -> int:
        r = ro._q("SELECT (SELECT COALESCE(SUM(count), 0) FROM rejection_totals) + (SELECT COALESCE(SUM(count), 0) "
                  "FROM quarantine) + (SELECT COUNT(*) FROM releases)")
        return int(r[0][0])

    try:
        for i, (cls, msgs) in enumerate(classes):
            from paho.mqtt.client import topic_matches_sub

            expect = sum(1 for t, _p in msgs if topic_matches_sub(cfg.aggregator.topic, t))  # others never arrive
            before = handled()
            t0 = time.monotonic()
            localnet.publish(b.port, msgs, "hostile-%d" % i)
            # until every message is handled, or nothing more comes for stall_s (the broker dropped the rest:
            # its queue for us was full; a device re-sends what the host did not acknowledge)
            last, last_t = -1, time.monotonic()
            while True:
                n = handled()
                if n >= before + expect:
                    break
                if n != last:
                    last, last_t = n, time.monotonic()
                elif time.monotonic() - last_t > stall_s:
                    break
                time.sleep(0.01)
            t_rej = (time.monotonic() if n >= before + expect else last_t) - t0
            n_done = handled() - before
            ok, t_valid = _agent_release(b.port, root, "pi-after-%d" % i, agent_timeout)
            nrows = int(ro._q("SELECT (SELECT COUNT(*) FROM rejections) + (SELECT COUNT(*) FROM quarantine)")[0][0])
            rows.append({"class": cls, "messages": len(msgs), "subscribed": expect, "handled": n_done,
                         "dropped_by_broker": max(0, expect - n_done), "time_to_reject_s": round(t_rej, 3),
                         "alive": th.is_alive(), "next_valid_stored": ok, "next_valid_s": round(t_valid, 2),
                         "rows_stored": nrows, "bytes_stored": ro.rejection_bytes()})
        t_stop = time.monotonic()
        stop.set()
        th.join(60)
        summary = {"stop_s": round(time.monotonic() - t_stop, 2), "exit_code": rc[0] if rc else None,
                   "counts": counts, "rejection_rows": ro.rejection_count(),
                   "rejection_totals": ro.rejection_counts(), "bytes_stored": ro.rejection_bytes()}
    finally:
        stop.set()
        ro.close()
        b.stop()
    return rows, summary


def drop_scenario(root: str, flood: int = 10_000, queue: int = 200) -> dict[str, Any]:
    """The broker drops releases: the aggregator is down while poison, a flood and a real release arrive.

    mosquitto keeps at most ``queue`` messages for the stopped aggregator's
    session (``max_queued_messages``), so most of the flood and the agent's
    first publish are dropped. The aggregator comes back: the poison among
    the queued messages is refused again at once, and the agent's re-send
    (after its ``ack_timeout_s``, 2 s here, 60 s by default) is stored and
    acknowledged. Returns the seconds from the restart until the agent has
    its acknowledgement.
    """
    import subprocess

    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest import service
    from pansketch.host_tools.store.sqlite import Store
    from pansketch.host_tools import localnet
    from pansketch.host_tools.localnet import Mosquitto
    from pansketch.host_tools.bench.localfleet import agent_cmd, agent_env, agent_toml, host_toml

    b = Mosquitto(root, conf_extra="max_queued_messages %d\n" % queue)
    db = os.path.join(root, "drop.db")
    cfg = hostconfig.load(host_toml(os.path.join(root, "drop.toml"), b.port, db, client_id="drop-host"))

    def start() -> tuple[threading.Thread, threading.Event]:
        stop, ready = threading.Event(), threading.Event()
        th = threading.Thread(target=service.run, args=(cfg,), kwargs={"stop": stop, "ready": ready}, daemon=True)
        th.start()
        assert ready.wait(20), "aggregator did not subscribe"
        return th, stop

    rng = random.Random(5)
    th, stop = start()
    stop.set()
    th.join(30)
    poison = [(topic("fuzz-dev"), billion_laughs()), (topic("fuzz-dev"), nested_rationals())]
    garbage = [(topic("flood-%d" % (i % 50)), bytes(rng.randrange(256) for _ in range(rng.randint(1, 1024))))
               for i in range(flood)]
    localnet.publish(b.port, poison + garbage, "drop-flood")
    acfg = agent_toml(os.path.join(root, "pi-drop.toml"), "pi-drop", b.port, os.path.join(root, "pi-drop"))
    agent = subprocess.Popen(agent_cmd("feed", acfg, "--timeout", "60", "--insecure-seed", "pi-drop", "--clock-start",
                                       str(T0 + 5), "--clock-speed", "0"), stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=agent_env(),
                             cwd=REPO)
    assert agent.stdin is not None
    agent.stdin.write(b"apple\n" * 10)
    agent.stdin.close()
    time.sleep(3.0)  # its first publish went into the full queue
    t0 = time.monotonic()
    th, stop = start()
    try:
        rc = agent.wait(90)
        t_stored = time.monotonic() - t0
    finally:
        stop.set()
        th.join(30)
        b.stop()
    ro = Store(db, readonly=True)
    try:
        totals = {c: n for c, n, _t in ro.rejection_counts()}
        stored = ro.release_count()
    finally:
        ro.close()
    return {"queue": queue, "flood": flood, "agent_rc": rc, "stored_after_restart_s": round(t_stored, 2),
            "releases": stored, "refused_after_restart": totals}


def table(rows: list[dict[str, Any]], inproc: dict[str, tuple[int, float, dict[str, int]]]) -> str:
    out = ["| input class | messages | slowest in process (ms) | time to reject all (s) | aggregator alive | "
           "next valid release stored after (s) | rows kept | bytes kept |",
           "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        ip = inproc.get(r["class"])
        out.append("| %s | %d%s | %s | %.2f | %s | %s | %d | %d |" % (
            r["class"], r["messages"], " (%d dropped by the broker)" % r["dropped_by_broker"]
            if r["dropped_by_broker"] else "", "%.2f" % ip[1] if ip else "-", r["time_to_reject_s"],
            "yes" if r["alive"] else "NO", "%.1f" % r["next_valid_s"] if r["next_valid_stored"] else "NOT STORED",
            r["rows_stored"], r["bytes_stored"]))
    return "\n".join(out)


def build_classes(rng: random.Random, flood: int, mutations: int) -> list[tuple[str, list[tuple[str, bytes]]]]:
    by: dict[str, list[tuple[str, bytes]]] = {}
    for cls, t, p in hostile_inputs(rng, mutations):
        by.setdefault(cls, []).append((t, p))
    for cls, t, p in forgeries(time.time()):
        by.setdefault(cls, []).append((t, p))
    garbage = [(topic("flood-%d" % (i % 50)), bytes(rng.randrange(256) for _ in range(rng.randint(1, 1024))))
               for i in range(flood)]
    return list(by.items()) + [("flood of %d garbage messages (1 B - 1 KB)" % flood, garbage)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flood", type=int, default=10_000, help="garbage messages in the flood class")
    ap.add_argument("--mutations", type=int, default=2000, help="random mutations of a valid release")
    ap.add_argument("--out", default="bench-results", help="output directory")
    ap.add_argument("--seed", type=int, default=19)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    classes = build_classes(rng, a.flood, a.mutations)
    inproc = in_process([(c, t, p) for c, ms in classes for t, p in ms])
    with tempfile.TemporaryDirectory() as root:
        rows, summary = live(classes, root, limits="rejections_max_rows = 2000\n")
    with tempfile.TemporaryDirectory() as root:
        drop = drop_scenario(root)
    md = table(rows, inproc)
    md += ("\n\nstop after the run: %.2f s (exit code %s); rejection rows kept %d (cap 2000), bytes kept %d; "
           "totals per code: %s\n" % (summary["stop_s"], summary["exit_code"], summary["rejection_rows"],
                                     summary["bytes_stored"],
                                     ", ".join("%s %d" % (c, n) for c, n, _t in summary["rejection_totals"])))
    md += ("\nbroker drops (aggregator stopped, max_queued_messages %d, poison + %d garbage + one real release "
           "published meanwhile): after the restart the queued poison is refused again (%s) and the agent's re-send "
           "(ack_timeout_s = 2) is stored and acknowledged %.1f s after the restart (agent exit %s)\n"
           % (drop["queue"], drop["flood"], ", ".join("%s %d" % kv for kv in sorted(drop["refused_after_restart"].items())),
              drop["stored_after_restart_s"], drop["agent_rc"]))
    summary["drop"] = drop
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "hostile.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "hostile.json"), "w") as f:
        json.dump({"rows": rows, "summary": summary,
                   "in_process": {k: {"inputs": v[0], "slowest_ms": v[1], "codes": v[2]} for k, v in inproc.items()}},
                  f, indent=1, default=str)
    bad = [r for r in rows if not (r["alive"] and r["next_valid_stored"] and r["next_valid_s"] <= 10)]
    slow = [k for k, v in inproc.items() if v[1] > 50]
    return 1 if bad or slow or drop["agent_rc"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
