"""A stolen device against a fleet, over real mosquitto and the real aggregator service and CLI.

Per kind, 10 honest devices (the real device core, deterministic byte source) and one stolen device,
``mal-1``, that publishes well-formed, valid releases with crafted counters -- each row of the table
of forged releases in docs/HOST.md "Bounded influence, flagged devices, removing a device":

* over the bound (``[fleet] max_events_per_window`` = 100,000): quarantined, never merged, in
  ``pansketch status`` with code ``bound``, and refused in mal-1's acknowledgement;
* inside it: stored, flagged in ``status`` for that device and window (dbits too: a shape no distinct
  count gives, and 100,000 distinct items against a fleet of 200 each), and the fleet answer moves by
  at most what a device that saw 100,000 events could move it (the documented bound);
* the honest devices are never refused nor flagged; ``--exclude-device mal-1`` gives the honest answer.
"""

from __future__ import annotations

import array
import json
import os
import threading
import time
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from pansketch.agent import release
from pansketch.agent.pi.batch import add_batch
from pansketch.agent.params import Params
from pansketch.agent.recorders import make
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools import cli
from pansketch.host_tools.store import bounds
from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.store.backend import open_store
from tests.support.broker import mosquitto_path, start_mosquitto
from tests.support.e2e import SALT, AggregatorThread, host_toml
from tests.support.host import T0

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed")

N = bounds.DEFAULT_MAX_EVENTS
HONEST = 10
KINDS: dict[str, dict[str, Any]] = {
    "cs": {"kind": "cs", "d": 4, "w": 512, "mechanism": "dgauss", "budget": "1/2"},
    "dcs": {"kind": "dcs", "b": 12, "map": [10, 1, -40], "d": 3, "w": 64, "mechanism": "dgauss", "budget": "1/2"},
    "strhh": {"kind": "strhh", "len": 6, "d": 3, "w": 256, "mechanism": "dgauss", "budget": "1/2"},
    "dbits": {"kind": "dbits", "d": 10, "w": 256, "mechanism": "dlap", "budget": "1"},
}
WINDOWS = 3
# the stolen device of each kind (a device id keeps the kind of its first release: one id per kind)
MAL = {"cs": "mal-1", "dcs": "mal-1.dcs", "strhh": "mal-1.strhh", "dbits": "mal-1.dbits"}
WORDS = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "sloe"]


def _params(name: str, dev: str) -> Params:
    return Params(dict(KINDS[name], device=dev, salt=SALT, mode="window", window_s=3600))


def _events(name: str, i: int, k: int) -> list[str]:
    rng = np.random.default_rng(100 * i + k)
    if name == "cs":
        p = 1.0 / np.arange(1, 201) ** 1.1
        return ["item-%d" % x for x in rng.choice(200, size=3000, p=p / p.sum())]
    if name == "dcs":  # room temperatures around 20 C, 0.1 C steps
        return ["%.1f" % x for x in rng.normal(20.0, 1.5, size=300)]
    if name == "strhh":
        p = 1.0 / np.arange(1, len(WORDS) + 1) ** 1.2
        return [WORDS[x] for x in rng.choice(len(WORDS), size=400, p=p / p.sum())]
    return ["badge-%d-%d" % (i, x) for x in range(200)]


def _record(name: str, dev: str, windows: list[list[str]], root: str) -> list[bytes]:
    p = _params(name, dev)
    rec = make(p, os.path.join(root, name, dev), T0, rng=Rng(DeterministicSource("stolen-%s-%s" % (name, dev))),
               log=lambda _m: None)
    t = T0
    for ev in windows:
        if name == "cs":
            rec.add_many(ev, None, adder=add_batch)
        else:
            rec.add_many(ev)
        t += 3600
        rec.tick(t)
    return [rec.outbox.read(s) for s in rec.outbox.pending()]


def _scaled(raw: bytes, name: str, factor: float, plus: Any = None) -> bytes:
    """``raw``'s counters times ``factor`` (plus ``plus(counters)``): a forgery with valid parameters."""
    rel = decode(raw)
    c = np.round(rel.counters().astype(np.float64) * factor).astype(np.int64)
    if plus is not None:
        c = plus(c)
    c = np.clip(c, -(1 << 31), (1 << 31) - 1)
    return release.encode(_params(name, rel.dev), rel.seq, rel.elo, rel.ehi, rel.part,
                          array.array("i", [int(x) for x in c.ravel()]), rel.nz)


def _cli(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(list(argv))
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("stolen")
    root = str(tmp)
    msgs: list[tuple[str, bytes]] = []
    for name in KINDS:
        for i in range(HONEST):
            dev = "%s-h%d" % (name, i)
            msgs += [("pansketch/%s/release" % dev, r)
                     for r in _record(name, dev, [_events(name, i, k) for k in range(WINDOWS)], root)]
    mal: dict[str, list[bytes]] = {}
    # cs: w0 +10^6 on an unseen item (over), w1 the top item's cells minus its fleet count (inside), w2 +10^9
    # everywhere (over); mal-1 sees the fleet's items otherwise (its honest counters underneath)
    from pansketch.host_tools.query.core import _hash

    base = _record("cs", MAL["cs"], [_events("cs", 99, k) for k in range(WINDOWS)], root)
    cp, sp = _hash(["planted-item"], SALT, 4, 512)
    ct, stt = _hash(["item-0"], SALT, 4, 512)

    def cells(c: np.ndarray, cols: Any, signs: Any, v: int) -> np.ndarray:
        c = c.reshape(4, 512)
        for r in range(4):
            c[r, cols[0, r]] += v * int(signs[0, r])
        return c

    top = 2600 * HONEST  # about the fleet's count of item-0 per window (Zipf 1.1 over 200 items, 3000 events each)
    mal["cs"] = [_scaled(base[0], "cs", 1, lambda c: cells(c, cp, sp, 10 ** 6)),
                 _scaled(base[1], "cs", 1, lambda c: cells(c, ct, stt, -top // 4)),
                 _scaled(base[2], "cs", 1, lambda c: c + 10 ** 9)]
    # dcs: 10^6 readings at 100 C (over), 20,000 at 60 C (inside), a negative mass (over)
    # (10^6 and the negative mass: a real release of 1,000 readings, scaled; 20,000: really recorded)
    hot = _record("dcs", MAL["dcs"], [["100.0"] * 1000, ["60.0"] * 20000, ["100.0"] * 1000], root)
    mal["dcs"] = [_scaled(hot[0], "dcs", 1000), hot[1], _scaled(hot[2], "dcs", -1000)]
    # strhh: four planted strings, 2,500 each (inside), -2,500 on each real one (inside: the negated
    # release of 2,500 of each), honest
    st0 = _record("strhh", MAL["strhh"], [["zzzz%02d" % (j % 4) for j in range(10000)], list(WORDS) * 2500,
                                          _events("strhh", 99, 2)], root)
    mal["strhh"] = [st0[0], _scaled(st0[1], "strhh", -1), st0[2]]
    # dbits: every bit set (over); the deepest three levels at 190 of 256 one-bits over an honest release
    # (inside: a shape no distinct count gives); 100,000 really recorded distinct badges (inside: the limit)
    db0 = _record("dbits", MAL["dbits"], [_events("dbits", 99, 0), _events("dbits", 99, 1),
                                          ["mal-badge-%d" % x for x in range(N)]], root)

    def deep(c: np.ndarray) -> np.ndarray:
        c = c.reshape(-1)
        c[7:] = 190
        return c

    mal["dbits"] = [_scaled(db0[0], "dbits", 0, lambda c: c + 256), _scaled(db0[1], "dbits", 1, deep), db0[2]]
    b = start_mosquitto(tmp)
    conf = host_toml(str(tmp / "host.toml"), b.port, str(tmp / "host.db"), client_id="stolen-host")
    agg = AggregatorThread(conf)
    acks: list[Any] = []
    got = threading.Event()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="mal-1", protocol=mqtt.MQTTv5)
    c.on_message = lambda _c, _u, m: (acks.append(json.loads(m.payload)), got.set())
    c.connect("127.0.0.1", b.port)
    c.loop_start()
    for dev in MAL.values():
        c.subscribe("pansketch/%s/ack" % dev, qos=1)
    time.sleep(0.5)
    for t, p in msgs:
        c.publish(t, p, qos=1).wait_for_publish(10)
    # one kind at a time, so that each of mal-1's releases is stored or refused before the next kind
    forged = [(name, k, raw) for name in KINDS for k, raw in enumerate(mal[name])]
    for name, _k, raw in forged:
        c.publish("pansketch/%s/release" % MAL[name], raw, qos=1).wait_for_publish(10)
    want = len(msgs) + len(forged)
    deadline = time.time() + 120
    while time.time() < deadline:
        with open_store(str(tmp / "host.db"), readonly=True) as st:
            n = st.release_count() + len(st.quarantined())
        if n >= want:
            break
        time.sleep(0.5)
    time.sleep(1.0)  # the last acknowledgements
    c.loop_stop()
    c.disconnect()
    agg.stop()
    b.stop()
    return {"conf": conf, "db": str(tmp / "host.db"), "acks": acks, "forged": forged, "tmp": tmp}


def _status(conf: str) -> dict[str, Any]:
    code, text = _cli("status", "--config", conf, "--json")
    assert code == 0
    return json.loads(text)


OVER = {("cs", 0), ("cs", 2), ("dcs", 0), ("dcs", 2), ("dbits", 0)}
INSIDE = {("cs", 1), ("dcs", 1), ("strhh", 0), ("strhh", 1), ("dbits", 1), ("dbits", 2)}


def test_over_the_bound_is_quarantined_and_refused_in_the_ack(fleet):
    rep = _status(fleet["conf"])
    q = {(r["device"], r["seq"]): r for r in rep["quarantined"]}
    seqs = {(name, k): decode(raw).seq for name, k, raw in fleet["forged"]}
    for key in OVER:
        assert (MAL[key[0]], seqs[key]) in q, key
        assert q[(MAL[key[0]], seqs[key])]["code"] == "bound"
    assert all(dev in MAL.values() for dev, _s in q), "an honest device was refused"
    assert len(q) == len(OVER), q  # the forgeries inside the bound were stored
    bad = {(a["dev"],) + tuple(e) for a in fleet["acks"] for e in a.get("bad", [])}
    for key in OVER:
        assert (MAL[key[0]], seqs[key], "bound") in bad, (key, fleet["acks"])
    with open_store(fleet["db"], readonly=True) as st:
        stored = {(r.device, r.seq) for r in st.releases(devices=list(MAL.values()))}
        rejected = st.rejections()
    assert not any((MAL[k[0]], seqs[k]) in stored for k in OVER)
    assert not rejected, rejected  # every honest release and every forgery inside the bound was stored


def test_inside_the_bound_is_flagged_in_its_window_and_honest_devices_never(fleet):
    rep = _status(fleet["conf"])
    flagged = {(f["device"], f["window"], f["kind"]) for f in rep["flags"]}
    w0 = T0 // 3600
    for name, k in INSIDE:
        assert (MAL[name], w0 + k, name) in flagged, (name, k, rep["flags"])
    assert not [f for f in rep["flags"] if f["device"] not in MAL.values()], rep["flags"]


def _freq(conf: str, window: int, *extra: str) -> dict[str, Any]:
    code, text = _cli("query", "--config", conf, "freq", "item-0", "planted-item", "--window", str(window), "--json",
                      *extra)
    assert code == 0, text
    return {d["item"]: d for d in map(json.loads, text.splitlines())}


def test_answers_move_at_most_the_bound_and_exclusion_restores_them(fleet, capsys):
    conf = fleet["conf"]
    w0 = T0 // 3600
    rows = []
    allow = bounds.influence(decode(fleet["forged"][0][2]), N)["cell"]
    for k in range(WINDOWS):
        after = _freq(conf, w0 + k)
        before = _freq(conf, w0 + k, "--exclude-device", "mal-1")
        for item in ("item-0", "planted-item"):
            moved = abs(after[item]["estimate"] - before[item]["estimate"])
            assert moved <= allow, (k, item, moved, allow)
            rows.append("cs window %d %s: %s -> %s" % (k, item, before[item]["estimate"], after[item]["estimate"]))
    code, text = _cli("query", "--config", conf, "quantile", "--q", "0.5", "--window", str(w0 + 1), "--json")
    assert code == 0
    med = json.loads(text.splitlines()[0])
    code, text = _cli("query", "--config", conf, "quantile", "--q", "0.5", "--window", str(w0 + 1), "--json",
                      "--exclude-device", MAL["dcs"])
    clean = json.loads(text.splitlines()[0])
    rows.append("dcs window 1 median: %s -> %s" % (clean["reading"], med["reading"]))
    for k in (1, 2):  # inside the bound: the distinct answer moves by at most the forged release's estimate
        code, text = _cli("query", "--config", conf, "distinct", "--window", str(w0 + k), "--json")
        assert code == 0, text
        after = json.loads(text.splitlines()[0])
        code, text = _cli("query", "--config", conf, "distinct", "--window", str(w0 + k), "--json",
                          "--exclude-device", MAL["dbits"])
        assert code == 0, text
        before = json.loads(text.splitlines()[0])
        rows.append("dbits window %d distinct: %s -> %s" % (k, before["estimate"], after["estimate"]))
        assert before["estimate"] < 2 * 200 * HONEST  # the honest fleet: 2,000 badges (sd ~220)
        assert after["estimate"] > before["estimate"]
    with capsys.disabled():
        print("\n" + "\n".join(rows))
