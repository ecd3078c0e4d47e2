"""The board firmware end to end in the MicroPython VM, on fake hardware.

Each test boots ``pansketch.firmware.app`` from a config file on a fake flash
directory, drives its main loop step by step in fake time (the VM collects
garbage only between steps) and reads what reached the fake broker. With a
huge privacy budget the noise is exactly zero (discrete Gaussian with
sigma^2 = 1/50000), so released counters can be compared with the exact
counts computed by the device core on CPython: "nothing counted is lost"
is checked to the unit. Runs with real noise check that every release is
byte-identical wherever it appears (no noise is ever re-drawn) and that a
board release is byte-identical to the agent core's on CPython and merges
with a Pi agent's.

Lost PUBACKs, connection resets mid-publish and broker outages are tested on
the real MicroPython VM against a real mosquitto and aggregator instead
(tests/test_firmware_unix.py); what stays here needs fake hardware or exact
fault injection (WiFi, CONNACK refusals, power cuts at a given rename, full
flash, unset clock, TLS, the watchdog, umqtt's blocking PUBACK wait on a
board's socket).
"""

from __future__ import annotations

import re
from array import array

import pytest

from pansketch.agent import hashing
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.agent.sketch import Sketch
from tests.support import mpvm
from tests.support import firmware as S
from tests.support.firmware_run import ZERO, expected_ctr, params

pytestmark = pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")

E0 = S.T_START // 600  # first epoch (window_s = 600)


def lines(prefix: str, n: int, distinct: int = 7) -> list[str]:
    return ["%s-%d" % (prefix, i % distinct) for i in range(n)]


def uart(ls: list[str]) -> str:
    return "fwdrive.uart(%r)\n" % (ls,)


def by_seq(rels: list[bytes]) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for r in rels:
        m = S.decode(r)
        if m["seq"] in out:
            assert out[m["seq"]] == r, "release %d re-sent with different bytes (noise re-drawn?)" % m["seq"]
        out[m["seq"]] = r
    return out


# ---------------------------------------------------------------------------
def test_release_is_the_agent_cores_and_merges_with_a_pi(tmp_path):
    """Real noise: the board's release == CPython Recorder's, byte for byte; host decodes and merges."""
    cfg = S.config(sketch={"persist_s": 3600})  # no periodic persist inside the window: easy to replay
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    board = lines("phone", 210, 30) + ["door\t5", "door", "café", "x" * 60]
    r = S.run(["fwdrive.boot()", "fwdrive.run(5)", uart(board) + "fwdrive.run(10)", "fwdrive.run(600)"], flash).check()
    rels = S.releases(r.stdout)
    assert len(rels) == 1
    # the same calls, seed and epoch through the device core on CPython: created with the
    # unset RTC's time, re-dated (and persisted: fresh noise) at the NTP sync, persisted
    # again just before the commit at the epoch end
    p = params(cfg)
    rec = Recorder(p, str(tmp_path / "cpy"), 946684800, rng=Rng(DeterministicSource(cfg["insecure_rng_seed"])),
                   log=lambda m: None)
    rec.redate(E0, E0 + 1, 0, S.T_START + 1)
    for ln in board:
        item, _, w = ln.partition("\t")
        rec.add(item, int(w) if w else 1)
    rec.persist(S.T_START + 600)
    assert rec.tick(S.T_START + 600) == 1
    assert rels[0] == rec.outbox.read(0)
    m = S.decode(rels[0])
    assert (m["elo"], m["ehi"], m["seq"], m["dev"], m["part"]) == (E0, E0 + 1, 0, "esp-1", 0)
    # the aggregator's decoder accepts it on its topic
    from pansketch.host_tools.ingest.decode import decode as host_decode

    host_decode(rels[0], topic="pansketch/esp-1/release")
    # a Pi agent (other device, system RNG) counting the same items in the same window merges
    pcfg = dict(cfg, device="pi-1")
    pi = Recorder(params(pcfg), str(tmp_path / "pi"), S.T_START + 10, rng=Rng(DeterministicSource("pi-seed")),
                  log=lambda m: None)
    pi.add_many(lines("phone", 300, 30))
    pi.tick(S.T_START + 600)
    mp = S.decode(pi.outbox.read(0))
    host_decode(pi.outbox.read(0), topic="pansketch/pi-1/release")
    for k in ("v", "kind", "d", "w", "hv", "salt", "clip", "mech", "nint", "nout", "win_s", "ep_s", "win", "elo", "ehi"):
        assert m[k] == mp[k], k
    merged = array("i", m["ctr"])
    other = array("i", mp["ctr"])
    for i in range(len(merged)):
        merged[i] += other[i]
    sk = Sketch(p.kind, p.d, p.w, hashing.salt_prefix(p.salt), p.clip, merged)
    # phone-0 was seen 7 times on the board and 10 times on the Pi; noise sd per cell = sqrt(4 * 4) = 4
    assert abs(sk.estimate("phone-0") - 17) <= 16
    assert abs(sk.estimate("door") - 2) <= 16


def test_wifi_drops_and_broker_refusals_lose_nothing(tmp_path):
    cfg = S.config(sketch=ZERO)
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    e0, e1, e2 = lines("a", 40), lines("b", 25), lines("c", 33)
    r = S.run([
        "fwdrive.boot()", "fwdrive.run(5)",
        uart(e0[:20]) + "fwdrive.run(5)",
        "fakehw.wifi['ap'] = False\nfwdrive.run(90)",
        uart(e0[20:]) + "fwdrive.run(600)",        # epoch 0 ends without WiFi: release 0 waits in the outbox
        uart(e1) + "fwdrive.run(600)",             # epoch 1 ends: release 1 waits too
        "print('@outbox', fwdrive.app.rec.outbox.pending())",
        "fakehw.wifi['ap'] = True\nfakehw.broker['connack'] = 5\nfwdrive.run(400)",  # WiFi back (<= 300 s), broker: not authorized
        uart(e2) + "fakehw.broker['connack'] = 0\nfwdrive.run(40)",
        "fwdrive.run(600)",
        "print('@outbox', fwdrive.app.rec.outbox.pending())",
    ], flash).check()
    out = r.stdout
    assert "@outbox [0, 1]" in out and out.rstrip().endswith("@outbox []")
    rels = S.releases(out)
    seqs = [S.decode(x)["seq"] for x in rels]
    assert seqs == [0, 1, 2]  # in order, each once (PUBACKs arrived)
    got = by_seq(rels)
    for seq, evs in ((0, e0), (1, e1), (2, e2)):
        m = S.decode(got[seq])
        assert (m["elo"], m["ehi"]) == (E0 + seq, E0 + seq + 1)
        assert m["ctr"] == expected_ctr(cfg, evs), "counts of epoch %d" % seq
    # backoff: WiFi retries grow and are capped; broker refusals are reported with their reason
    waits = [int(x) for x in re.findall(r"wifi: cannot join 'lab' \(no ap found\); next try in (\d+) s", out)]
    assert waits[:5] == [2, 4, 8, 16, 32] and max(waits) <= 300 and waits == sorted(waits)
    refusals = re.findall(r"broker refused the connection: not authorized \(CONNACK 5\); retrying in (\d+) s", out)
    assert len(refusals) >= 3 and [int(x) for x in refusals[:3]] == [1, 2, 4]
    # last will on the drop, retained status at the end
    assert ("pansketch/esp-1/status", True, b'{"state":"offline"}') in S.messages(out, "will")
    st = S.statuses(out)[-1]
    assert st["pending"] == 0 and st["acked_seq"] == 2 and st["state"] == "online" and st["clock"] == "synced"


def test_umqtt_publish_trap_is_avoided(tmp_path):
    """umqtt.simple's own QoS 1 publish blocks forever without PUBACK; the firmware's Client times out."""
    flash = tmp_path / "f"
    S.write_config(flash, S.config())
    r = S.run([
        "fwdrive.boot()", "fwdrive.run(5)",
        # plain umqtt on a socket WITH a timeout: the first publish is fine, but its wait_msg switched
        # the socket to blocking mode, so the next publish whose PUBACK is lost waits forever
        "from umqtt import simple\n"
        "c = simple.MQTTClient('t', 'h')\nc.connect(timeout=2)\nprint('@timeout', c.sock.timeout)\n"
        "c.publish(b't', b'1', qos=1)\nprint('@timeout_after', c.sock.timeout)\nfakehw.broker['drop_puback'] = 1\n"
        "try:\n    c.publish(b't', b'2', qos=1)\nexcept fakehw.Hang:\n    print('@plain hangs')\n",
        "cl = fwdrive.app.link.client\nfakehw.broker['drop_puback'] = 1\nt0 = fakehw.ms\n"
        "try:\n    cl.publish(b't', b'x', qos=1)\nexcept OSError as e:\n    print('@fw', e.args[0], fakehw.ms - t0)\n",
    ], flash).check()
    v = r.values()
    assert (v["timeout"], v["timeout_after"], v["plain"]) == ("2", "None", "hangs")
    code, waited = map(int, v["fw"].split())
    assert code == 110 and waited <= 2000  # ETIMEDOUT after mqtt.timeout_s


@pytest.mark.parametrize("budget", ["1/2", "100000"])
def test_power_cuts_lose_nothing_counted_and_redraw_no_noise(tmp_path, budget):
    cfg = S.config(sketch={"budget": budget})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    a, b, c, d = lines("a", 30), lines("b", 20), lines("c", 12), lines("d", 9)
    cut = "import fakefs\nfakefs.cut_on_rename[0] = (%r, 1)\n"
    # 1) cut while committing release 0, after its marker, before .tmp -> .cbor
    r1 = S.run(["fwdrive.boot()", "fwdrive.run(5)", uart(a) + "fwdrive.run(100)", uart(b) + "fwdrive.run(400)",
                cut % ".cbor" + "fwdrive.run(200)"], flash)
    assert not r1.ok and "PowerCut" in r1.error
    assert not S.releases(r1.stdout)
    tmp0 = (flash / "data" / "outbox" / "0000000000.tmp").read_bytes()
    # 2) restart 5 s later: release 0 is finished and sent as written; then a cut before release 1's marker
    boot2 = "fakehw.set_unix(%d)\nfwdrive.boot()" % (S.T_START + 605)
    r2 = S.run([boot2, "fwdrive.run(10)", uart(c) + "fwdrive.run(100)",
                cut % "released" + "fwdrive.run(600)"], flash)
    assert not r2.ok and "PowerCut" in r2.error
    assert S.releases(r2.stdout) == [tmp0]  # the bytes committed before the cut, not re-drawn
    # 3) restart: release 1 was never committed; its events are still in the (persisted) state
    boot3 = "fakehw.set_unix(%d)\nfwdrive.boot()" % (S.T_START + 1215)
    r3 = S.run([boot3, "fwdrive.run(10)", uart(d) + "fwdrive.run(10)",
                    "fakehw.broker['drop_puback'] = 9\nfakehw.broker['host_ack'] = False\nfwdrive.run(600)",
                "raise fakehw.PowerCut('power cut with release 1 sent but not acked')"], flash)
    assert not r3.ok
    sent3 = S.releases(r3.stdout)
    assert sent3 and all(x == sent3[0] for x in sent3)
    # 4) restart: the unacked release 1 goes out again, byte for byte
    r4 = S.run(["fakehw.set_unix(%d)\nfwdrive.boot()" % (S.T_START + 1900), "fwdrive.run(30)"], flash).check()
    sent4 = S.releases(r4.stdout)
    assert sent4[0] == sent3[0]
    m0, m1 = S.decode(tmp0), S.decode(sent3[0])
    assert m0["seq"] == 0 and m1["seq"] == 1
    assert (m0["elo"], m0["ehi"]) == (E0, E0 + 1)
    # release 1 holds the events of epoch 1 and those counted after the restart in epoch 2
    assert (m1["elo"], m1["ehi"]) == (E0 + 1, E0 + 3)
    if budget == "100000":
        assert m0["ctr"] == expected_ctr(cfg, a + b)
        assert m1["ctr"] == expected_ctr(cfg, c + d)
    assert (flash / "data" / "outbox").exists() and not list((flash / "data" / "outbox").glob("*.tmp*"))


def test_power_cut_mid_epoch_loses_at_most_the_unpersisted_events(tmp_path):
    """The documented bound: events after the last state persist (persist_s) are lost in a power cut."""
    cfg = S.config(sketch=dict(ZERO, persist_s=60))
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    kept, lost, later = lines("k", 25), lines("l", 11), lines("m", 6)
    r1 = S.run(["fwdrive.boot()", "fwdrive.run(5)", uart(kept) + "fwdrive.run(70)",  # persisted at ~t=65
                uart(lost) + "fwdrive.run(20)", "raise fakehw.PowerCut()"], flash)
    assert not r1.ok
    r2 = S.run(["fakehw.set_unix(%d)\nfwdrive.boot()" % (S.T_START + 200), "fwdrive.run(5)",
                uart(later) + "fwdrive.run(500)"], flash).check()
    rels = S.releases(r2.stdout)
    assert len(rels) == 1
    m = S.decode(rels[0])
    assert (m["elo"], m["ehi"]) == (E0, E0 + 1)
    assert m["ctr"] == expected_ctr(cfg, kept + later)


def test_full_flash_keeps_counting_and_releases_later(tmp_path):
    cfg = S.config(sketch=ZERO)
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    # measure the footprint first: config + state + marker + one release
    e0, e1, e2 = lines("a", 20), lines("b", 15), lines("c", 9)
    steps = [
        "fwdrive.boot()\nimport fakefs\nfakehw.broker['up'] = False\nfwdrive.run(5)",
        uart(e0) + "fwdrive.run(600)",  # release 0 fits (nothing can be sent: broker down)
        "print('@usage', fakefs.usage())\nfakefs.quota[0] = fakefs.usage() + 64\n" + uart(e1) + "fwdrive.run(600)",
        "print('@pending', fwdrive.app.rec.outbox.pending(), fwdrive.app.rec.elo, fwdrive.app.rec.ehi)",
        uart(e2) + "fakehw.broker['up'] = True\nfwdrive.run(60)",  # release 0 drains -> space again
        "fwdrive.run(600)",
        "print('@pending', fwdrive.app.rec.outbox.pending())",
    ]
    r = S.run(steps, flash).check()
    out = r.stdout
    assert re.search(r"cannot write release 1 \((\[Errno 28\] ENOSPC|28)\)", out)  # core's message, errno 28
    assert "could not commit the release of epochs" in out
    assert "@pending [0] %d %d" % (E0 + 1, E0 + 3) in out  # the failed release's range grew
    assert out.rstrip().endswith("@pending []")
    got = by_seq(S.releases(out))
    assert sorted(got) == [0, 1]
    m0, m1 = S.decode(got[0]), S.decode(got[1])
    assert (m1["elo"], m1["ehi"]) == (E0 + 1, E0 + 3)
    assert m0["ctr"] == expected_ctr(cfg, e0)
    assert m1["ctr"] == expected_ctr(cfg, e1 + e2)


def test_unsynced_clock_counts_but_does_not_release(tmp_path):
    cfg = S.config(sketch=ZERO)
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    a, b, c = lines("a", 10), lines("b", 8), lines("c", 5)
    r = S.run([
        "fakehw.ntp['ok'] = False\nfwdrive.boot()", "fwdrive.run(5)",
        uart(a) + "fwdrive.run(700)",    # past the first epoch end: no clock, no release
        "print('@pending', fwdrive.app.rec.outbox.pending())",
        uart(b) + "fakehw.ntp['ok'] = True\nfwdrive.run(400)",  # synced at ~1100 s (epoch 1)
        uart(c) + "fwdrive.run(200)",    # epoch 1 ends at 1200 s
    ], flash).check()
    out = r.stdout
    assert "@pending []" in out
    assert "clock not synced yet (NTP ntp.lan): counting, but no release until it is" in out
    assert any(s["clock"] == "unsynced" for s in S.statuses(out))
    rels = S.releases(out)
    assert len(rels) == 1
    m = S.decode(rels[0])
    # dated from this boot (epoch 0) to the epoch in which the clock was set (1)
    assert (m["elo"], m["ehi"]) == (E0, E0 + 2)
    assert m["ctr"] == expected_ctr(cfg, a + b + c)
    # a restart long after: the persisted (valid) accumulator is extended to cover the events since boot
    r2 = S.run(["fakehw.set_unix(%d)\nfwdrive.boot()" % (S.T_START + 1900), uart(lines("d", 4)) + "fwdrive.steps(3)",
                "fwdrive.run(600)"], flash).check()
    assert "also holds events counted since boot" in r2.stdout
    m2 = S.decode(S.releases(r2.stdout)[0])
    assert (m2["elo"], m2["ehi"]) == (E0 + 2, E0 + 4) and m2["ctr"] == expected_ctr(cfg, lines("d", 4))


def test_tls_settings_and_low_memory(tmp_path):
    cfg = S.config(sketch=ZERO, mqtt={"tls": {"ca": "/flash/ca.der", "server_hostname": "mqtt.example.org"}})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    (flash / "ca.der").write_bytes(b"\x30\x82fake-ca")
    a, b = lines("a", 12), lines("b", 7)
    r = S.run([
        "fakehw.broker['oom_connect'] = True\nfwdrive.boot()", uart(a) + "fwdrive.run(20)",
        "import machine\nu = machine.uarts[1]\n_ri = u.readinto\n"
        "def boom(*x):\n    u.readinto = _ri\n    raise MemoryError('injected')\nu.readinto = boom\n" + uart(b) + "fwdrive.run(5)",
        "fakehw.broker['oom_connect'] = False\nfwdrive.run(700)",
        "import ssl, usocket\nc = ssl.contexts[-1]\nprint('@tls', c.verify_mode, c.ca == b'\\x30\\x82fake-ca', c.wrapped[-1], usocket.created[-1].timeout)",
    ], flash).check()
    out = r.stdout
    assert "cannot connect to broker.lan:8883: out of memory" in out
    assert "low memory: dropped the broker connection" in out
    assert r.values()["tls"] == "2 True mqtt.example.org 2"  # CERT_REQUIRED, the CA file's bytes as cadata, SNI, timeout
    assert "mqtt: connected to broker.lan:8883 (TLS)" in out
    rels = S.releases(out)
    assert len(rels) == 1 and S.decode(rels[0])["ctr"] == expected_ctr(cfg, a + b)


def test_watchdog_fed_through_noise_and_backoff(tmp_path):
    """Armed after boot; fed while a release's noise is drawn and while main() backs off after errors."""
    cfg = S.config(sketch={"w": 512}, source={"type": "flakysrc"}, watchdog_s=8)
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    (flash / "flakysrc.py").write_text(
        "def check(cfg):\n    return {}\n"
        "class Source:\n    dropped = False\n    calls = 0\n"
        "    def __init__(self, cfg, log):\n        pass\n"
        "    def start(self, sink):\n        pass\n"
        "    def poll(self, sink, budget):\n"
        "        Source.calls += 1\n"
        "        if 20 <= Source.calls < 26:\n            raise RuntimeError('sensor glitch')\n"
        "        sink.add('tick')\n        return 1\n"
        "    def stop(self):\n        pass\n")
    r = S.run([
        "sys.path.append('/flash')\nfakehw.install()\nimport fakefs\nfakefs.install('/flash')\n"
        "from pansketch.firmware import app\na = app.main('/flash/pansketch.json', max_steps=10)\n"
        "print('@wdt', fakehw.wdt['armed'], fakehw.wdt['timeout'])",
        "fwdrive.app = a\nfwdrive.run(5)\nf0 = fakehw.wdt['feeds']\na.step()\nprint('@noop_feeds', fakehw.wdt['feeds'] - f0)",
        "for _ in range(100):\n    fakehw.advance(6000)\n    a.wdt.feed()\n"
        "f0 = fakehw.wdt['feeds']\nn0 = a.rec.seq\na.step()\nprint('@release_feeds', a.rec.seq - n0, fakehw.wdt['feeds'] - f0)",
        "a = app.main('/flash/pansketch.json', max_steps=30)\nprint('@survived', fakehw.ms)",
    ], flash).check()
    v = r.values()
    assert v["wdt"] == "True 8000"
    assert int(v["noop_feeds"]) == 1
    nrel, feeds = map(int, v["release_feeds"].split())
    assert nrel == 1 and feeds > 50  # 2 * 2048 noise draws: the RNG feeds the watchdog as it reads bytes
    assert r.stdout.count("unexpected error in the main loop") == 6
    assert "(6 in a row)" in r.stdout and "sensor glitch" in r.stdout
