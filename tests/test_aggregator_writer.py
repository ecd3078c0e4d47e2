"""The aggregator's writer: a bounded number of bytes of received messages, and groups that wait
for more messages only while messages keep coming.

QoS 0 arrivals have no Receive Maximum: when the store falls behind, the
parent's queues used to grow with every message the MQTT process forwarded.
Now the reader waits once HELD_BYTES_MAX is spent, so the backlog stays in
the MQTT process (whose inbox drops QoS 0 past its bound, test_mqttproc).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from pansketch.host_tools.ingest import pipeline
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.ingest.pipeline import MSG_OVERHEAD, _Held, _Writer
from pansketch.host_tools.ingest.mqttshared import Msg
from pansketch.host_tools.ingest.validproc import verdict
from pansketch.host_tools.store.sqlite import Store
from tests.support.host import T0, encoded, host_cfg, params, topic


def test_held_waits_while_spent_and_lets_one_oversized_message_through():
    h = _Held(100)
    assert h.take(60, lambda: False) and h.take(40, lambda: False) and h.used == 100
    assert h.take(1, lambda: True) is False, "spent: the caller gives up (stopping) instead of waiting"
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(h.take(30, lambda: False)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and h.used == 100, "waits while the budget is spent"
    h.give(60)
    t.join(10)
    assert got == [True] and h.used == 70 and h.waits == 1 and h.peak == 100
    h.give(70)
    assert h.take(500, lambda: False) and h.used == 500, "nothing held: a message over the budget passes alone"


class Acks:
    """Stands in for the MQTT process's acknowledge request (the transport is tested in test_mqttproc)."""

    def __init__(self) -> None:
        self.mids: list[int] = []
        self.at: dict[int, float] = {}

    def acknowledge(self, acks: list[tuple[int, int]], host_acks: Any) -> None:
        self.mids += [mid for mid, _q in acks]
        now = time.monotonic()  # one request per group
        for mid, _q in acks:
            self.at[mid] = now


def releases(agg: Aggregator, n: int, dev: str = "held-dev") -> list[Msg]:
    p = params(dev, w=64)
    out = []
    for k in range(n):
        payload = encoded(p, seq=k, elo=T0 // 3600 + k)
        out.append(Msg(topic(dev), payload, k + 1, 1, verdict(agg.validation, topic(dev), payload)))
    return out


def slow_writer(tmp_path: Any, n: int) -> tuple[Aggregator, list[Msg], Acks, _Writer]:
    """An aggregator with ``n`` releases to put and a writer (not started) whose group_wait_ms is 3 s:
    past the config limit, so the timing checks keep their meaning with a margin for a loaded CI core."""
    cfg = host_cfg(tmp_path)
    cfg.aggregator.group_wait_ms = 3000
    agg = Aggregator(cfg)
    acks = Acks()
    return agg, releases(agg, n), acks, _Writer(agg, None, acks, threading.Event(), {})  # type: ignore[arg-type]


def test_a_lone_release_is_committed_at_once_and_a_stream_is_gathered(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "IDLE_GAP_S", 1.0)  # arrivals 0.3 s apart still "keep coming"
    cfg = host_cfg(tmp_path, aggregator={"group_wait_ms": 1000})
    # 3 s, past the config limit: the timing checks keep their meaning with a margin for a
    # loaded CI core, which stalls for 0.3 s and more
    cfg.aggregator.group_wait_ms = 3000
    agg = Aggregator(cfg)
    msgs = releases(agg, 3)
    acks = Acks()
    w = _Writer(agg, None, acks, threading.Event(), {})  # type: ignore[arg-type]
    w.start()
    t0 = time.monotonic()
    w.put([msgs[0]])  # after a quiet spell: nothing else is coming
    w.drain(10)
    assert acks.mids == [1] and acks.at[1] - t0 < 1.5, "a lone release does not wait group_wait_ms (3 s)"
    assert w.groups == 1
    # two arrivals close together: messages keep coming, so the group waits for more (up to 3 s)
    w.put([msgs[1]])
    t1 = time.monotonic()
    time.sleep(0.3)
    w.put([msgs[2]])
    w.drain(10)
    w.close()
    assert sorted(acks.mids) == [1, 2, 3]
    assert w.groups == 2, "the third release joined the second's group"
    assert acks.at[2] - t1 >= 0.3 and acks.at[2] == acks.at[3]
    agg.close()


@pytest.mark.slow
def test_a_group_of_group_enough_is_committed_without_waiting(tmp_path, monkeypatch):
    """Messages keep coming, but a group of GROUP_ENOUGH does not wait group_wait_ms for more: in a
    burst the writer would only idle with a backlog behind it. A smaller one still waits."""
    monkeypatch.setattr(pipeline, "GROUP_ENOUGH", 4)
    monkeypatch.setattr(pipeline, "IDLE_GAP_S", 5.0)  # no lull ends the wait here: only its length does
    agg, msgs, acks, w = slow_writer(tmp_path, 6)
    w.start()
    w.put([msgs[0]])
    w.drain(10)
    # two arrivals close together (messages keep coming), four messages in all: exactly GROUP_ENOUGH
    t0 = time.monotonic()
    w.put([msgs[1]])
    w.put(msgs[2:5])
    w.drain(10)
    assert sorted(acks.mids) == [1, 2, 3, 4, 5]
    assert max(acks.at[k] for k in range(2, 6)) - t0 < 1.5, "a group of GROUP_ENOUGH committed at once"
    assert w.groups == 2
    # a group of one while messages keep coming still waits for more
    t1 = time.monotonic()
    w.put([msgs[5]])
    w.drain(10)
    w.close()
    assert acks.at[6] - t1 >= 2.5, "a small group waits group_wait_ms (3 s) while messages keep coming"
    agg.close()


def test_a_group_stops_waiting_when_the_inflow_stops(tmp_path, monkeypatch):
    """group_wait_ms 3 s: arrivals 0.1 s apart (closer than the idle gap, 0.4 s) join one group; once
    nothing arrives for the idle gap, the group is committed then, not at the end of the 3 s (the last
    group of a burst waited the whole group_wait_ms)."""
    monkeypatch.setattr(pipeline, "IDLE_GAP_S", 0.4)
    agg, msgs, acks, w = slow_writer(tmp_path, 5)
    w.start()
    w.put([msgs[0]])
    w.put([msgs[1]])  # two close arrivals: messages keep coming
    for m in msgs[2:]:
        time.sleep(0.1)
        w.put([m])
    t_last = time.monotonic()
    w.drain(10)
    w.close()
    assert sorted(acks.mids) == [1, 2, 3, 4, 5]
    assert w.groups <= 2, "arrivals closer than the idle gap joined the group"
    assert acks.at[5] - t_last >= 0.3, "the group waited for the idle gap after the last arrival"
    assert acks.at[5] - t_last < 2.0, "and not for the rest of group_wait_ms (3 s)"
    agg.close()


def test_clumped_arrivals_lengthen_the_idle_gap(tmp_path, monkeypatch):
    """Releases that arrive in clumps 0.2 s apart (a fleet on a shared schedule) with an idle gap of
    0.1 s: a fixed gap would commit every clump alone; the writer measures the gaps between arrivals
    and waits IDLE_GAP_CLUMPS x their upper quartile, so the clumps after the first join one group.
    Gaps longer than group_wait_ms are lulls and do not count."""
    monkeypatch.setattr(pipeline, "IDLE_GAP_S", 0.1)
    monkeypatch.setattr(pipeline, "IDLE_GAP_CLUMPS", 3.0)  # 0.6 s: a margin for a loaded CI core
    agg, msgs, acks, w = slow_writer(tmp_path, 8)
    assert w.idle_gap(3.0) == 0.1, "no arrivals yet: the fixed gap"
    w._arrivals = [(g, 10) for g in (0.01, 0.01, 0.3, 0.3)]
    assert abs(w.idle_gap(3.0) - 0.9) < 1e-9, "3 x the upper quartile of the gaps"
    w._arrivals = [(0.01, 10)] * 7 + [(2.0, 10)]
    assert w.idle_gap(3.0) == 0.1, "one stall in a burst is not a rhythm"
    w._arrivals = [(5.0, 100)] * 4
    assert w.idle_gap(3.0) == 3.0, "never past the group wait"
    w._arrivals = [(0.3, 1)] * 4
    assert w.idle_gap(3.0) == 0.1, "one message every 0.3 s: a 0.9 s wait would gather 3, under CLUMP_MIN"
    monkeypatch.setattr(pipeline, "CLUMP_MIN", 2)  # below: clumps of two, a 0.6 s wait gathers about 6
    w._arrivals = []
    w.start()
    for i in range(0, 8, 2):
        if i:
            time.sleep(0.2)
        w.put([msgs[i]])
        w.put([msgs[i + 1]])
    t_last = time.monotonic()
    w.drain(10)
    w.close()
    assert sorted(acks.mids) == list(range(1, 9))
    assert w.groups == 2, "the first clump alone (the idle gap was 0.1 s then), the other three together"
    assert 0.45 <= w.idle_gap(3.0) <= 3.0
    assert acks.at[8] - t_last >= 0.4, "the last group waited the longer idle gap after the last arrival"
    assert acks.at[8] - t_last < 2.5, "and not for the rest of group_wait_ms"
    agg.close()

    w2 = _Writer(agg, None, acks, threading.Event(), {})  # type: ignore[arg-type]
    w2.put([])
    w2._put_at = (0.0, time.monotonic() - 10.0)  # the last arrival 10 s ago: a lull
    w2.put([])
    assert w2._arrivals == [], "a gap longer than group_wait_ms is not part of the inflow's rhythm"


def test_after_a_backlog_group_the_idle_gap_is_the_short_one(tmp_path, monkeypatch):
    """A burst: the writer's last group was GROUP_ENOUGH messages already waiting. The group after it
    (a burst's tail) ends its wait on IDLE_GAP_S, not on the clump rhythm measured before: a rhythm
    of 0.3 s gaps would otherwise hold the tail for 0.9 s (make bench's ingest: about 35 ms a round)."""
    monkeypatch.setattr(pipeline, "GROUP_ENOUGH", 4)
    monkeypatch.setattr(pipeline, "IDLE_GAP_S", 0.1)
    monkeypatch.setattr(pipeline, "IDLE_GAP_CLUMPS", 3.0)
    agg, msgs, acks, w = slow_writer(tmp_path, 6)
    w.put(msgs[:4])  # queued before the threads start: the first group is all backlog
    w._arrivals = [(0.3, 100)] * 8
    w.start()
    w.drain(10)
    assert w.groups == 1 and w._behind
    assert w.idle_gap(3.0) >= 0.8, "the rhythm alone would wait 0.9 s"
    w.put([msgs[4]])
    w.put([msgs[5]])  # close together: not a lone release
    t_last = time.monotonic()
    w.drain(10)
    w.close()
    assert sorted(acks.mids) == list(range(1, 7)) and w.groups == 2
    assert acks.at[6] - t_last < 0.6, "the tail waited IDLE_GAP_S (0.1 s), not the rhythm's 0.9 s"
    agg.close()


def test_writer_blocks_the_reader_when_the_store_falls_behind(tmp_path, monkeypatch):
    cfg = host_cfg(tmp_path)
    agg = Aggregator(cfg)
    msgs = releases(agg, 12)
    one = len(msgs[0].payload) + MSG_OVERHEAD
    gate = threading.Event()
    commit = agg.store.commit_group

    def slow_commit(pend: Any, **kw: Any) -> Any:  # the store falls behind until the gate opens
        gate.wait(20)
        return commit(pend, **kw)

    monkeypatch.setattr(agg.store, "commit_group", slow_commit)
    monkeypatch.setattr(pipeline, "GROUP_MAX", 2)  # small groups: the reader hands them over one by one
    stop = threading.Event()
    acks = Acks()
    w = _Writer(agg, None, acks, stop, {})  # type: ignore[arg-type]
    w.held = _Held(3 * one)  # three releases' worth
    w.start()
    reader = threading.Thread(target=lambda: [w.put([m]) for m in msgs])
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive(), "the reader waits: the store is behind and the budget is spent"
    assert w.held.used <= 3 * one and w.q.qsize() + w.valid.qsize() <= 3
    gate.set()
    reader.join(20)
    assert not reader.is_alive()
    w.drain(20)
    w.close()
    assert sorted(acks.mids) == list(range(1, 13)), "every message stored and acknowledged, none dropped"
    assert w.held.used == 0 and w.held.peak <= 3 * one and w.held.waits >= 1
    assert Store(cfg.aggregator.db, readonly=True).release_count() == 12
    agg.close()


def test_deferred_sync_acknowledges_only_after_the_fsync_and_the_writer_goes_on(tmp_path, monkeypatch):
    """SQLite with deferred syncs (what `pansketch aggregate` runs): a group's commit returns before its
    fsync, the syncer thread runs Store.sync_committed and only then acknowledges. While the fsync is
    held back nothing is acknowledged, yet the writer commits the next group; once it completes, every
    message is acknowledged in order, and drain() waited for that (idle covers the syncer)."""
    import os
    import sqlite3

    cfg = host_cfg(tmp_path, aggregator={"group_wait_ms": 0})
    agg = Aggregator(cfg)
    assert agg.store.defer_sync() is True
    level = agg.store.db.execute("PRAGMA synchronous").fetchone()[0]
    assert level == 1, "NORMAL on the writer's connection: no fsync inside COMMIT"
    synced: list[int] = []
    fsynced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    gate = threading.Event()
    real_sync = agg.store.sync_committed

    def held_sync() -> None:
        gate.wait(20)
        real_sync()
        synced.append(agg.store.release_count())

    monkeypatch.setattr(agg.store, "sync_committed", held_sync)
    msgs = releases(agg, 6)
    acks = Acks()
    w = _Writer(agg, None, acks, threading.Event(), {}, deferred=True)  # type: ignore[arg-type]
    w.start()
    w.put(msgs[:3])
    deadline = time.monotonic() + 10
    while agg.store.release_count() < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    w.put(msgs[3:])
    while agg.store.release_count() < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert agg.store.release_count() == 6, "the writer committed the second group while the first waited"
    time.sleep(0.3)
    assert acks.mids == [] and not w.idle(), "nothing acknowledged before its fsync"
    gate.set()
    w.drain(10)
    assert w.idle()
    assert acks.mids == [1, 2, 3, 4, 5, 6]
    assert synced and synced[0] >= 3
    wal_ino = os.stat(cfg.aggregator.db + "-wal").st_ino
    assert wal_ino in fsynced, "the fsync was of the WAL file"
    w.close()
    agg.close()
    con = sqlite3.connect(cfg.aggregator.db)
    assert con.execute("SELECT COUNT(*) FROM releases").fetchone()[0] == 6
    con.close()


def test_deferred_sync_failure_stops_without_acknowledging(tmp_path, monkeypatch):
    """An fsync that fails (EIO; and a WAL that is not the file opened for it any more, which
    sync_committed refuses as ESTALE) stops the aggregator: the committed group is not acknowledged
    (the broker redelivers it; storing again is a duplicate) and the reason is the fatal state."""
    import errno
    import os

    for kind in ("eio", "estale"):
        sub = tmp_path / kind
        sub.mkdir()
        cfg = host_cfg(sub, aggregator={"group_wait_ms": 0})
        agg = Aggregator(cfg)
        agg.store.defer_sync()
        if kind == "eio":
            def bad(fd: int) -> None:
                raise OSError(errno.EIO, "Input/output error")

            monkeypatch.setattr(os, "fsync", bad)
        else:
            real_stat = os.stat
            monkeypatch.setattr(os, "stat", lambda p, *a, **k: os.stat_result(
                (0, 1 << 40) + tuple(real_stat(p, *a, **k))[2:]) if str(p).endswith("-wal") else real_stat(p, *a, **k))
        stop = threading.Event()
        state: dict[str, Any] = {}
        acks = Acks()
        w = _Writer(agg, None, acks, stop, state, deferred=True)  # type: ignore[arg-type]
        queued: list[Any] = []
        put = w.synced.put
        w.synced.put = lambda item, *a, **k: (queued.append(item), put(item, *a, **k))[1]  # type: ignore
        w.start()
        w.put(releases(agg, 2))
        assert stop.wait(10), "the aggregator stops"
        w.drain(5)
        monkeypatch.undo()  # fsync works again: what was committed after the failure stays unacknowledged
        assert len(queued) == 1 and len(queued[0][1]) == 2
        w.synced.put(queued[0])  # the same committed group once more: a fsync that works now
        w.drain(5)
        w.close()
        assert acks.mids == [] and "fsync failed" in state["fatal"], state
        assert ("Input/output" if kind == "eio" else "not the file opened") in state["fatal"]
        assert agg.store.release_count() == 2, "committed: a redelivery is a duplicate, nothing lost"
        agg.close()
