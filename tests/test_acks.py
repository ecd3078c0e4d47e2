"""Host acknowledgements (docs/FORMAT.md section 7): the one ack path of the
Pi agent and the firmware (agent/acks.py), the outbox limit, and the case
that broke "delivered": a device publishing before any aggregator exists."""

from __future__ import annotations

import os

import pytest

from pansketch.agent import acks, storage
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools.store.sqlite import Store
from tests.support import mpvm
from tests.support.e2e import (agent_toml, needs_mosquitto, run_agent, start_host, start_mosquitto,
                                    wait_for)

T0 = 1_700_000_000 - 1_700_000_000 % 3600  # in the past: the host quarantines windows from the future
FROZEN = ("--clock-start", str(T0 + 10), "--clock-speed", "0")


def outbox_with(tmp_path, seqs):
    ob = storage.Outbox(str(tmp_path))
    for s in seqs:
        with open(ob.path(s), "wb") as f:
            f.write(b"release-%d" % s)
    return ob


def test_parse_accepts_the_spec_and_refuses_the_rest():
    assert acks.parse(b'{"dev":"pi-1","ok":[3,4],"bad":[[5,"conflict"]]}', "pi-1") == ([3, 4], [(5, "conflict")])
    assert acks.parse('{"dev":"pi-1"}', "pi-1") == ([], [])
    for bad in (b"\xff", b"[1]", b'{"dev":"pi-2","ok":[1]}', b'{"dev":"pi-1","ok":["1"]}',
                b'{"dev":"pi-1","ok":[-1]}', b'{"dev":"pi-1","ok":[true]}', b'{"dev":"pi-1","bad":[[1]]}',
                b"not json"):
        with pytest.raises(acks.AckError):
            acks.parse(bad, "pi-1")


def test_apply_deletes_stored_sets_aside_rejected_ignores_unknown(tmp_path):
    ob = outbox_with(tmp_path, [0, 1, 2])
    said = []
    top = acks.apply(ob, [0, 7], [(2, "conflict")], said.append)
    assert top == 7 and ob.pending() == [1]
    assert ob.rejected() == 1 and os.path.exists(os.path.join(ob.dir, "rejected", "0000000002.cbor"))
    assert "conflict" in said[0]
    assert acks.apply(ob, [0], [], said.append) == 0 and ob.pending() == [1]  # a repeated ack is harmless


def test_resend_schedule():
    r = acks.Resend(1000)
    assert r.due(5, 0)
    r.mark(5, 0)
    assert not r.due(5, 999) and r.due(5, 1000)
    assert r.next_due([5, 6], 200) == 0  # 6 was never sent
    assert r.next_due([5], 200) == 800
    r.mark(5, 1000)  # second send: the next wait doubles
    assert not r.due(5, 2999) and r.due(5, 3000)
    for k in range(20):
        r.mark(5, 0)
    assert not r.due(5, 64000 - 1) and r.due(5, 64000)  # capped at 64x
    r.reset()
    assert r.due(5, 1)  # a reconnect makes everything due


def test_resend_jitter_adds_up_to_a_quarter_and_desynchronises():
    """The random extra lies in [0, wait/4) and is spread out; without ``rand`` the schedule is exact."""
    import random

    g = random.Random(7)
    r = acks.Resend(1000, rand=lambda n: bytes(g.getrandbits(8) for _ in range(n)))
    waits = []
    for k in range(400):
        r.mark(k, 0)
        waits.append(r.next_due([k], 0))
    assert all(1000 <= w < 1250 for w in waits), (min(waits), max(waits))
    # uniform on [1000, 1250): 400 draws fill both halves and the extremes (fails for a constant extra)
    assert sum(w < 1125 for w in waits) in range(160, 241) and min(waits) < 1010 and max(waits) > 1240
    for _ in range(20):
        r.mark(0, 0)
    assert 64000 <= r.next_due([0], 0) < 80000  # the cap is on the doubling; the extra comes on top
    zero = acks.Resend(1000, rand=lambda n: b"\x00" * n)
    zero.mark(1, 0)
    assert zero.due(1, 1000) and not zero.due(1, 999)
    top = acks.Resend(1000, rand=lambda n: b"\xff" * n)
    top.mark(1, 0)
    assert top.due(1, 1249) and not top.due(1, 1248)  # 0xffff * 250 >> 16 = 249
    assert acks.system_rand() is not None  # CPython: os.urandom


def test_full_outbox_keeps_counting_into_a_longer_range(tmp_path):
    """With outbox_max releases unacknowledged, the next epoch end commits
    nothing: the accumulator keeps counting and its range grows; once the
    host acknowledges, one release covers the whole span (nothing dropped,
    no noise re-drawn for released data)."""
    p = Params({"device": "d", "salt": "fleet-salt-1", "kind": "cms", "d": 2, "w": 16, "mode": "keep",
                "window_s": 600, "epoch_s": 60, "mechanism": "dlap", "budget": "1"})
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("o")), log=lambda m: None, outbox_max=1)
    assert rec.tick(T0 + 60) == 1
    assert rec.tick(T0 + 120) == 0 and rec.tick(T0 + 180) == 0  # full: counting goes on
    assert (rec.elo, rec.ehi) == (T0 // 60 + 1, T0 // 60 + 4)
    rec.outbox.ack(0)  # the host caught up
    assert rec.tick(T0 + 240) == 1
    import cbor2

    m = cbor2.loads(rec.outbox.read(1))
    assert (m["elo"], m["ehi"]) == (T0 // 60 + 1, T0 // 60 + 4)


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed")
def test_ack_path_is_the_same_on_micropython(tmp_path):
    flash = tmp_path / "flash"
    flash.mkdir()
    code = """
from pansketch.agent import acks, storage
ob = storage.Outbox('/flash/dev')
for s in (0, 1, 2):
    f = open(ob.path(s), 'wb'); f.write(b'r'); f.close()
ok, bad = acks.parse(b'{"dev":"pico-1","ok":[0],"bad":[[1,"schema"]]}', 'pico-1')
print('@top', acks.apply(ob, ok, bad))
print('@left', ob.pending(), ob.rejected())
try:
    acks.parse(b'{"dev":"other","ok":[2]}', 'pico-1')
except acks.AckError:
    print('@refused', 1)
"""
    v = mpvm.run(code, flash=flash).check().values()
    assert v == {"top": "0", "left": "[2] 1", "refused": "1"}


@needs_mosquitto
def test_publishing_before_any_aggregator_exists_loses_nothing(tmp_path):
    """The bug behind end-to-end acks: the broker accepts (PUBACKs) a QoS 1
    release that no subscription waits for and drops it. Now the device
    keeps it until the host has stored it."""
    broker = start_mosquitto(tmp_path)
    try:
        state = str(tmp_path / "state")
        cfg = agent_toml(str(tmp_path / "a.toml"), "pi-9", broker.port, state)
        r = run_agent("feed", cfg, "--timeout", "3", *FROZEN, input=b"a\nb\n")
        assert r.returncode == 1, r.stderr
        assert b"not stored by the host" in r.stderr and b"is an aggregator subscribed?" in r.stderr
        assert storage.Outbox(state).pending() == [0]
        host = start_host(tmp_path, broker.port)  # the aggregator arrives later
        r = run_agent("feed", cfg, "--timeout", "20", *FROZEN, input=b"")
        assert r.returncode == 0, r.stderr
        assert host.stop() == 0
        st = Store(str(tmp_path / "host.db"), readonly=True)
        rows = st.db.execute("SELECT seq, count(*) FROM releases WHERE device = 'pi-9' GROUP BY seq").fetchall()
        assert sorted(rows) == [(0, 1), (1, 1)]  # every release stored exactly once
        assert storage.Outbox(state).pending() == []
    finally:
        broker.stop()


@needs_mosquitto
def test_a_release_the_host_refuses_is_kept_aside_and_feed_says_so(tmp_path):
    """A host with another fleet salt rejects the release (code 'fleet'):
    the device sets it aside in outbox/rejected/ and feed exits 1."""
    broker = start_mosquitto(tmp_path)
    try:
        state = str(tmp_path / "state")
        cfg = agent_toml(str(tmp_path / "a.toml"), "pi-8", broker.port, state)
        hconf = tmp_path / "h.toml"
        hconf.write_text('[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "other"\n[aggregator]\ndb = "%s"\n'
                         '[fleet]\nsalt = "another-fleet-salt-1"\n' % (broker.port, tmp_path / "h.db"))
        from tests.support.e2e import AggregatorThread

        host = AggregatorThread(str(hconf))
        r = run_agent("feed", cfg, "--timeout", "20", *FROZEN, input=b"a\n")
        assert host.stop() == 0
        assert r.returncode == 1, r.stderr
        assert b"host rejected release 0" in r.stderr and b"refused 1 release(s) for good" in r.stderr
        ob = storage.Outbox(state)
        assert ob.pending() == [] and ob.rejected() == 1
    finally:
        broker.stop()


@needs_mosquitto
def test_feed_with_a_full_outbox_waits_for_room_then_commits(tmp_path):
    """outbox_max = 1 and one release already waiting: at end of input feed
    waits for the host to acknowledge it, then commits and delivers the last."""
    broker = start_mosquitto(tmp_path)
    try:
        state = str(tmp_path / "state")
        cfg = agent_toml(str(tmp_path / "a.toml"), "pi-7", broker.port, state)
        text = open(cfg).read().replace("[storage]\n", "[storage]\noutbox_max = 1\n")
        open(cfg, "w").write(text)
        r = run_agent("feed", cfg, "--timeout", "2", *FROZEN, input=b"a\n")
        assert r.returncode == 1 and storage.Outbox(state).pending() == [0]
        from tests.support.e2e import spawn_agent

        log = str(tmp_path / "feed.log")
        p = spawn_agent("feed", cfg, "--timeout", "30", *FROZEN, log=log)
        p.stdin.write(b"b\n")
        p.stdin.close()
        assert wait_for(lambda: b"waiting for the host" in open(log, "rb").read(), 15), open(log).read()
        host = start_host(tmp_path, broker.port)  # the host comes back: room, commit, delivery
        assert p.wait(40) == 0, open(log).read()
        assert host.stop() == 0
        st = Store(str(tmp_path / "host.db"), readonly=True)
        rows = st.db.execute("SELECT seq FROM releases WHERE device = 'pi-7' ORDER BY seq").fetchall()
        assert [s for (s,) in rows] == [0, 1]
    finally:
        broker.stop()
