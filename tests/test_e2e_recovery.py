"""Broker restarts and a SIGKILLed agent: nothing lost, nothing counted twice, no noise re-drawn.

A real ``pansketch-agent run`` follows an event file on a fast simulated
clock (one 60 s window every 2 s), a real aggregator stores into SQLite, a
raw subscriber records every delivery. The broker is stopped twice (the
second time the agent is killed with SIGKILL while releases wait in its
outbox) and the agent is restarted on the same state directory.

The agent persists its state every 5 simulated seconds (12 times per
window): each persist adds a fresh internal noise draw (agent/recorder.py),
so its releases carry nz > 2 draws per cell and the host must accept and
count them.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import cbor2

from pansketch.host_tools.query import core as query
from pansketch.host_tools.store.sqlite import Store
from tests.support.e2e import (SALT, AggregatorThread, Capture, agent_toml, host_toml, needs_mosquitto,
                                    spawn_agent, start_mosquitto, stop_process, wait_for)

pytestmark = needs_mosquitto

T0 = 1_700_000_000 - 1_700_000_000 % 3600  # in the past: the host quarantines windows from the future
SPEED = 30.0


def pending(state: str) -> dict[int, bytes]:
    d = os.path.join(state, "outbox")
    out = {}
    for n in os.listdir(d):
        if n.endswith(".cbor"):
            try:
                with open(os.path.join(d, n), "rb") as f:
                    out[int(n[:10])] = f.read()
            except FileNotFoundError:  # acked meanwhile
                pass
    return out


def test_broker_restart_and_agent_kill_lose_nothing_and_count_nothing_twice(tmp_path):
    broker = start_mosquitto(tmp_path, persistent=True)
    port = broker.port
    agg = AggregatorThread(host_toml(str(tmp_path / "host.toml"), port, "rec.db"))
    cap = Capture(port, ["pansketch/+/release"], client_id="capture-rec", persistent=True)
    events = tmp_path / "events.log"
    events.write_text("")
    state = str(tmp_path / "state")
    src = 'type = "file"\npath = "%s"\nfollow = true' % events
    cfg = agent_toml(str(tmp_path / "a.toml"), "pi-r", port, state, window_s=60, w=128, source=src, persist_s=5)

    writing = threading.Event()
    writing.set()

    def writer() -> None:
        i = 0
        with open(events, "a") as f:
            while writing.is_set():
                f.write("item-%d\n" % (i % 7))
                f.flush()
                i += 1
                time.sleep(0.005)

    wt = threading.Thread(target=writer, daemon=True)
    wt.start()
    t_launch = time.time()
    agent = spawn_agent("run", cfg, "--clock-start", str(T0), "--clock-speed", str(SPEED), log=str(tmp_path / "agent.log"))
    snapshots: dict[int, bytes] = {}
    db = str(tmp_path / "rec.db")
    st = Store(db, readonly=True)
    try:
        assert wait_for(lambda: st.release_count() >= 2, 20), open(tmp_path / "agent.log").read()

        # 1. broker down for a while: releases pile up in the outbox, on disk
        broker.stop()
        assert wait_for(lambda: len(pending(state)) >= 2, 20)
        snapshots.update(pending(state))
        broker.start()
        assert wait_for(lambda: not pending(state), 20), "the outbox drains after the broker is back"

        # 2. broker down again, and the agent is killed with releases waiting
        assert wait_for(lambda: st.release_count() >= max(snapshots) + 2, 20)
        broker.stop()
        assert wait_for(lambda: len(pending(state)) >= 2, 20)
        time.sleep(0.3)  # not inside a commit (that crash point is tests/test_recorder.py's)
        # kill once the open accumulator has been persisted since the last release (a release no
        # longer persists the next accumulator right away; it is written at the next persist)
        state_bin, marker = os.path.join(state, "state.bin"), os.path.join(state, "released")
        assert wait_for(lambda: os.path.getmtime(state_bin) > os.path.getmtime(marker), 10)
        agent.kill()
        agent.wait()
        at_kill = pending(state)
        snapshots.update(at_kill)
        broker.start()
        time.sleep(0.5)
        # restarted on the same state dir, its clock continuing where it was
        now_sim = T0 + (time.time() - t_launch) * SPEED
        agent = spawn_agent("run", cfg, "--clock-start", "%.0f" % now_sim, "--clock-speed", str(SPEED),
                            log=str(tmp_path / "agent.log"))
        assert wait_for(lambda: st.release_count() >= max(at_kill) + 3, 30), open(tmp_path / "agent.log").read()
        assert stop_process(agent) == 0
        assert "resumed state seq %d" % (max(at_kill) + 1) in open(tmp_path / "agent.log").read()
        writing.clear()
        wt.join()

        with open(os.path.join(state, "released")) as f:
            last_seq = int(f.read().split()[0])
        assert wait_for(lambda: st.release_count() == last_seq + 1, 20)
        rels = st.releases(devices=["pi-r"])
        # nothing lost, nothing twice: every committed sequence number exactly once
        assert sorted(r.seq for r in rels) == list(range(last_seq + 1))
        assert st.rejection_count() == 0, st.rejections()  # a re-drawn release would be a 'conflict'
        # mid-window persists re-noise the state: the releases say so, and the host keeps it
        assert all(r.nz >= 2 for r in rels) and max(r.nz for r in rels) > 2, [r.nz for r in rels]
        # epochs move forward with the sequence number: no epoch released twice
        keys = [(r.elo, r.part) for r in sorted(rels, key=lambda r: r.seq)]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        # no noise re-drawn: what waited on disk is byte-for-byte what was stored
        assert len(snapshots) >= 4
        for seq, data in snapshots.items():
            m = cbor2.loads(data)
            assert m["seq"] == seq
            assert st.payload("pi-r", m["elo"], m["ehi"], m["part"]) == data
        # every delivery the broker made (including QoS 1 redeliveries) carried identical bytes, in order
        assert wait_for(lambda: len({cbor2.loads(p)["seq"] for p in cap.on("/release")}) == last_seq + 1, 20)
        by_seq: dict[int, set[bytes]] = {}
        first: list[int] = []
        for p in cap.on("/release"):
            s = cbor2.loads(p)["seq"]
            if s not in by_seq:
                first.append(s)
            by_seq.setdefault(s, set()).add(p)
        assert all(len(v) == 1 for v in by_seq.values())
        assert first == sorted(first), "releases went out in sequence order"
        # a query merges each release once
        ans = query.freq(st, ["item-1"], salt=SALT)[0]
        assert ans.releases == last_seq + 1 and ans.devices == ["pi-r"]
    finally:
        writing.clear()
        if agent.poll() is None:
            agent.kill()
        st.close()
        cap.close()
        agg.stop()
        broker.stop()


def test_lost_puback_means_resend_never_loss(tmp_path):
    """The broker freezes after receiving a release (no PUBACK): the agent must keep it and re-send it
    byte for byte; the aggregator stores it once whatever the broker delivered."""
    broker = start_mosquitto(tmp_path)
    agg = AggregatorThread(host_toml(str(tmp_path / "host.toml"), broker.port, "lost.db"))
    cap = Capture(broker.port, ["pansketch/+/release"], client_id="capture-lost")
    state = str(tmp_path / "state")
    cfg = agent_toml(str(tmp_path / "a.toml"), "pi-l", broker.port, state, w=128)
    frozen = ("--clock-start", str(T0 + 7), "--clock-speed", "0")
    log = str(tmp_path / "agent.log")
    st = Store(str(tmp_path / "lost.db"), readonly=True)
    try:
        agent = spawn_agent("feed", cfg, "--timeout", "2", *frozen, log=log)
        assert wait_for(lambda: b"connected to" in open(log, "rb").read(), 20)
        broker.proc.send_signal(signal.SIGSTOP)  # TCP stays up, nothing is acknowledged
        agent.stdin.write(b"x\n" * 10)
        agent.stdin.close()
        assert agent.wait(30) == 1, open(log).read()
        assert b"1 of 1 release(s) not stored by the host" in open(log, "rb").read()
        kept = pending(state)
        assert sorted(kept) == [0], "a release without PUBACK stays in the outbox"
        broker.proc.send_signal(signal.SIGCONT)
        r = spawn_agent("feed", cfg, "--timeout", "20", *frozen, log=log)
        r.stdin.close()
        assert r.wait(40) == 0, open(log).read()
        assert wait_for(lambda: st.release_count() == 2, 20)
        m = cbor2.loads(kept[0])
        assert st.payload("pi-l", m["elo"], m["ehi"], m["part"]) == kept[0]
        assert st.rejection_count() == 0
        # whatever reached the broker twice was the same bytes, and counted once
        assert cap.wait(lambda msgs: len(msgs) >= 2, 20)
        assert {p for p in cap.on("/release") if cbor2.loads(p)["seq"] == 0} == {kept[0]}
        assert query.freq(st, ["x"], salt=SALT)[0].releases == 2
    finally:
        if broker.proc is not None:
            broker.proc.send_signal(signal.SIGCONT)
        st.close()
        cap.close()
        agg.stop()
        broker.stop()
