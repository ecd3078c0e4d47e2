"""Faults end to end: nothing released is lost, nothing is stored twice (docs/FORMAT.md section 7).

Real parts only: mosquitto with a persistence directory (tests/support/broker.py),
the real device CLI (``python -m pansketch.agent.pi.daemon feed``) and the real host CLI
(``python -m pansketch.host_tools.cli aggregate`` and ``status --json``), each a
separate process so that ``kill -9`` is a real crash. Devices run on a fast
simulated clock (a 60 s window every real second) and re-send releases the
host has not acknowledged after ``ack_timeout_s = 1``.

Faults, one test each:

a. devices publish while no aggregator has ever subscribed; the aggregator
   starts 5 s later (the issue asks for 30 s; 5 s keeps the suite fast and
   is already five re-send rounds);
b. ``kill -9`` of the broker right after it acknowledged releases (PUBACK)
   that it had not delivered yet, before any autosave, then a restart on the
   same persistence directory;
c. ``kill -9`` of one of two aggregators sharing a subscription, mid-ingest;
   each device's next 3 releases must then be stored within two ack
   timeouts (the dead member must not keep its turn in the group);
d. ``kill -9`` of the agent mid-window (right after a persist), and again
   mid-publish (its PUBLISH sent, the broker frozen before the PUBACK), each
   time restarted on the same state directory;
e. the host down for longer than the outbox holds (``outbox_max = 2``): the
   recorder keeps counting and releases a longer epoch range later.

After each fault every device feeds to the end of its input and must exit 0
(the host stored everything it released), every (device, seq) in
[0, next_seq) is stored exactly once, no release was refused (a re-drawn
release would be a ``conflict``), and ``pansketch status --json`` shows 0
lost and 0 pending. Each test adds a row to the fault table (released,
stored, lost, stored twice, duplicate deliveries ignored, and "at risk":
releases released but not stored when the fault struck), printed at the
end of the module and written to ``$PANSKETCH_FAULT_TABLE`` when set.

The aggregator does not record device status messages yet; a small
subscriber here feeds them to the store through host_tools/ingest/devstatus.py
(what the aggregator will call), so ``status`` classifies with the
devices' own next_seq and oldest_pending.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import cbor2
import pytest

from pansketch.host_tools.store.sqlite import Store
from tests.support.e2e import (needs_mosquitto, wait_for)
from tests.support.e2e_faults import Device, Host, ROWS, Scene

pytestmark = needs_mosquitto


def release_to_store_s(scene: "Scene", devs: list[Device], k: int, limit: float = 20) -> dict[tuple[str, int], float]:
    """Each device's next ``k`` releases from now: seconds from released to stored (inf if never, within ``limit``).

    Polled every 20 ms from the devices' ``released`` files and the store, so
    each figure is exact to about one polling round.
    """
    first = {d.name: d.next_seq() for d in devs}
    want = [(d.name, q) for d in devs for q in range(first[d.name], first[d.name] + k)]
    released: dict[tuple[str, int], float] = {}
    stored: dict[tuple[str, int], float] = {}
    end = time.monotonic() + limit
    while len(stored) < len(want) and time.monotonic() < end:
        nxt = {d.name: d.next_seq() for d in devs}
        have = scene.store_seqs()
        now = time.monotonic()
        for key in want:
            if key not in released and key[1] < nxt[key[0]]:
                released[key] = now
            if key in released and key not in stored and key[1] in have.get(key[0], ()):
                stored[key] = now
        time.sleep(0.02)
    return {key: stored.get(key, float("inf")) - released.get(key, end) for key in want}


@pytest.fixture
def scene(tmp_path: Any) -> Any:
    s = Scene(tmp_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module", autouse=True)
def fault_table() -> Any:
    yield
    if not ROWS:
        return
    cols = ("fault", "at_risk", "released", "stored", "lost", "stored_twice", "duplicates_ignored")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in ROWS]
    print("\n" + "\n".join(lines))
    path = os.environ.get("PANSKETCH_FAULT_TABLE")
    if path:
        with open(path, "a") as f:
            for r in ROWS:
                f.write(json.dumps(r) + "\n")


# -- the faults --------------------------------------------------------------------
def test_a_devices_publish_before_any_aggregator_subscribed(scene):
    devs = [scene.device("pi-a1"), scene.device("pi-a2")]
    # 5 s of releases (5 windows) re-sent every second into a broker with no subscriber
    assert wait_for(lambda: all(len(d.pending()) >= 4 for d in devs), 15), [d.text() for d in devs]
    assert scene.store_seqs() == {}, "nobody stored a release yet"
    at_risk = len(scene.unstored(devs))
    scene.host()
    row = scene.finish_and_check("a. no aggregator for the first 5 s", at_risk=at_risk)
    assert row["released"] >= 10


def test_b_broker_killed_after_its_pubacks_before_any_autosave(tmp_path):
    # autosave only on a clean stop: the kill certainly comes before any save
    s = Scene(tmp_path, autosave_interval=0)
    try:
        host = s.host()
        dev = s.device("pi-b")
        assert wait_for(lambda: host.stored() >= 2, 15), host.text()
        # the aggregator stops reading: the broker PUBACKs the next releases and holds them for it
        host.proc.send_signal(signal.SIGSTOP)
        held = dev.next_seq()
        assert wait_for(lambda: dev.next_seq() >= held + 2, 10)
        time.sleep(0.3)  # their PUBACKs are in
        waiting = [q for q in dev.pending() if q not in s.store_seqs().get("pi-b", [])]
        assert len(waiting) >= 2, waiting
        s.broker.kill()
        host.proc.send_signal(signal.SIGCONT)
        s.broker.start()  # same port, same (never saved) persistence directory
        row = s.finish_and_check("b. broker kill -9 after PUBACK, before autosave", at_risk=len(waiting))
        assert row["released"] >= held + 2
    finally:
        if s.hosts and s.hosts[0].proc.poll() is None:
            s.hosts[0].proc.send_signal(signal.SIGCONT)
        s.close()


def test_c_one_of_two_shared_aggregators_killed_mid_ingest(scene):
    a = scene.host("agg-a", shared_group="aggs")
    b = scene.host("agg-b", shared_group="aggs")
    # ack timeout 3 s: the bound below (two of them, 6 s) leaves a release parked once on the dead
    # member 3 s to be stored after its re-send on a loaded CI machine, while one parked twice
    # (once in 4: each send has a 1 in 2 chance of being parked there) waits for its second
    # re-send (after 3 + 6 s)
    ack_s = 3.0
    devs = [scene.device("pi-c1", ack_timeout_s=ack_s), scene.device("pi-c2", ack_timeout_s=ack_s)]
    assert wait_for(lambda: a.stored() >= 2 and b.stored() >= 1, 15), (a.text(), b.text())
    # a hangs mid-ingest: the broker keeps handing it its share of the releases, then it is killed
    a.proc.send_signal(signal.SIGSTOP)
    time.sleep(2.0)
    held = scene.unstored(devs)
    assert held, "releases were in flight to the frozen aggregator"
    a.kill()  # a group member starts clean: its session (and what was in flight in it) ends with it
    # the dead member must not keep its turn in the group: each device's next releases are stored
    # within two ack timeouts (with a day-long session on a dead member, each send has a 1 in 2
    # chance of being parked there, so 2 sends in a row miss b for about 1 release in 4)
    lat = release_to_store_s(scene, devs, k=3)
    assert all(v <= 2 * ack_s for v in lat.values()), lat
    scene.finish_and_check("c. kill -9 of 1 of 2 shared aggregators", at_risk=len(held))
    assert b.stored() >= 4


def test_d_agent_killed_mid_window_and_mid_publish(scene):
    host = scene.host()
    dev = scene.device("pi-d", persist_s=15)  # the open window is persisted 4 times per window
    assert wait_for(lambda: host.stored() >= 2, 15), host.text()
    # 1. mid-window, right after the open accumulator was persisted
    sb, marker = os.path.join(dev.state, "state.bin"), os.path.join(dev.state, "released")
    # killed right in the check (no store query in between: a release landing there would make
    # the persisted accumulator older than the marker, and the restart would rightly not resume it)
    assert wait_for(lambda: os.path.exists(sb) and os.path.exists(marker)
                    and os.path.getmtime(sb) > os.path.getmtime(marker) and dev.proc.kill() is None, 10)
    dev.kill()
    at_risk = len(scene.unstored([dev]))
    snap = dev.snapshot()
    dev.restart()
    assert wait_for(lambda: "resumed state" in dev.text(), 15), dev.text()
    # 2. mid-publish: once the restarted agent is connected and has released, the broker freezes
    # (TCP up, no PUBACK) and the next release goes out into it
    n = dev.next_seq()
    assert wait_for(lambda: dev.text().count("connected to") >= 2 and host.stored() >= n + 1, 15), dev.text()
    scene.broker.proc.send_signal(signal.SIGSTOP)
    try:
        m = dev.next_seq()
        assert wait_for(lambda: dev.next_seq() > m, 10)
        time.sleep(0.3)  # the publisher has sent it and waits for the PUBACK
        assert dev.pending(), "a release waits for its acknowledgement"
        at_risk += len(scene.unstored([dev]))
        snap.update(dev.snapshot())
        dev.kill()
    finally:
        scene.broker.proc.send_signal(signal.SIGCONT)
    dev.restart()
    scene.finish_and_check("d. agent kill -9 mid-window and mid-publish", at_risk=at_risk)
    # (the second restart resumes a persisted accumulator only if a persist came
    # after the last release before the kill: timing, not correctness; the first
    # restart was asserted to resume above)
    assert dev.text().count("resumed state") >= 1
    # what waited in the outbox at each kill is byte for byte what the host stored (no noise re-drawn)
    assert snap
    st = Store(scene.db, readonly=True)
    try:
        for seq, data in snap.items():
            m = cbor2.loads(data)
            assert m["seq"] == seq and st.payload("pi-d", m["elo"], m["ehi"], m["part"]) == data
    finally:
        st.close()


def test_e_host_down_longer_than_the_outbox_holds(scene):
    host = scene.host()
    dev = scene.device("pi-e", outbox_max=2)
    assert wait_for(lambda: host.stored() >= 1, 15), host.text()
    host.kill()
    n_down = dev.next_seq()
    time.sleep(5)  # 5 windows with the host down: the outbox fills at 2, counting goes on
    assert len(dev.pending()) == 2 and dev.next_seq() <= n_down + 2, (dev.pending(), dev.text()[-2000:])
    at_risk = len(scene.unstored([dev]))
    scene.hosts.append(Host(scene.tmp, scene.port, "agg"))
    # the host catches up, the outbox has room again, and the long range goes out at the next window end
    # (end of input while the outbox is still full would leave the last range for the next run: feed exits 3)
    assert wait_for(lambda: dev.next_seq() > n_down + 2, 15), dev.text()[-2000:]
    scene.finish_and_check("e. host down 5 windows, outbox_max = 2", at_risk=at_risk)
    st = Store(scene.db, readonly=True)
    try:
        rels = sorted(st.releases(devices=["pi-e"]), key=lambda r: r.seq)
    finally:
        st.close()
    # nothing dropped: the epochs of consecutive releases touch, and one covers the backlog's windows
    for x, y in zip(rels, rels[1:]):
        assert y.elo == x.ehi or (y.elo == x.elo and y.part > x.part), [(r.seq, r.elo, r.ehi, r.part) for r in rels]
    assert max(r.ehi - r.elo for r in rels) >= 3, [(r.seq, r.elo, r.ehi) for r in rels]
