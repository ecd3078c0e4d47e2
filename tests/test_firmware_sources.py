"""The three example event sources in the VM: GPIO edges, BLE advertisements, UART lines.

Each run uses a zero-noise budget, so the released counters must equal the
exact counters of the events the source is documented to produce
(computed by the device core on CPython).
"""

from __future__ import annotations

import pytest

from tests.support import mpvm
from tests.support import firmware as S
from tests.support.firmware_run import ZERO, expected_ctr

pytestmark = pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")


def _release(r: mpvm.MPResult) -> dict:
    rels = S.releases(r.stdout)
    assert len(rels) == 1, r.stdout[-2000:]
    return S.decode(rels[0])


def test_gpio_edges_counted_without_allocation_and_debounced(tmp_path):
    cfg = S.config(sketch=ZERO, source={"type": "gpio", "pins": [
        {"pin": 4, "label": "door", "trigger": "rising", "pull": "up"},
        {"pin": "GP15", "label": "bell", "trigger": "both", "debounce_ms": 50}]})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    r = S.run([
        "fwdrive.boot()\nimport machine\nd, b = machine.pins[4], machine.pins['GP15']\n"
        "print('@pins', d.pull, d.trigger, d.hard, b.trigger)",
        "fwdrive.run(5)",
        "d.fire(37)\nb.fire(5)\nfwdrive.run(1)\nfakehw.advance(100)\nb.fire(3)\nfwdrive.run(1)",
        "fwdrive.run(600)",
    ], flash).check()
    assert r.values()["pins"] == "1 1 True 3"  # PULL_UP, IRQ_RISING, hard IRQ, rising|falling
    m = _release(r)
    assert m["ctr"] == expected_ctr(cfg, ["door"] * 37 + ["bell"] * 2)  # 5 edges within 50 ms count once


def test_ble_addresses_deduplicated_per_burst(tmp_path):
    cfg = S.config(sketch=ZERO, source={"type": "ble", "every_s": 60, "scan_ms": 2000, "slots": 4, "random": False})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    A, B, C, D, E, F = [bytes([0xAA, 0xBB, 0xCC, 0x00, 0x10, i]) for i in range(6)]
    r = S.run([
        "fwdrive.boot()\nimport bluetooth", "fwdrive.run(3)",
        "print('@scan', fakehw.scans[-1][1:])\n"
        "bluetooth.burst([%r, %r, %r], end=False)\nbluetooth.burst([%r], addr_type=1)\nfwdrive.run(60)" % (A, B, A, C),
        "bluetooth.burst([%r, %r, %r, %r, %r, %r])\nfwdrive.run(60)" % (A, B, C, D, E, F),
        "fwdrive.run(600)\nprint('@scans', len(fakehw.scans))\n"
        "print('@clean', fwdrive.app.source.n, bytes(fwdrive.app.source.table) == bytes(24))",
    ], flash).check()
    v = r.values()
    assert v["scan"] == "(2000, 30000, 30000, False)"
    assert v["clean"] == "0 True"  # nothing of a burst stays in memory
    assert int(v["scans"]) >= 11  # one burst per every_s
    assert "source buffer overflowed" in r.stdout
    names = ["AA:BB:CC:00:10:%02X" % i for i in range(6)]
    # burst 1: A, B (random-address C ignored); burst 2: the first 4 slots A, B, C, D (E, F dropped)
    expect = [names[0], names[1]] + names[:4]
    assert _release(r)["ctr"] == expected_ctr(cfg, expect)


def test_uart_lines_like_the_pi_agent(tmp_path):
    cfg = S.config(sketch=dict(ZERO, clip=3), source={"type": "uart", "id": 2, "baudrate": 9600, "max_line": 16})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    data = (b"apple\r\n" b"w\t3\n" b"w\t-2\n" b"w\t9\n" b"q\tabc\n" b"\n" b"caf\xc3\xa9\n"
            b"this line is much too long\n" b"bad\xff\n" b"tab\tin\t2\n" b"pear")
    r = S.run([
        "fwdrive.boot()\nimport machine\nu = machine.uarts[2]", "fwdrive.run(3)",
        "u.feed(%r)\nfwdrive.run(2)\nu.feed(b'\\n')\nfwdrive.run(2)" % (data,),
        "fwdrive.run(600)",
    ], flash).check()
    assert r.stdout.count("source buffer overflowed") == 1  # rate-limited warning for the dropped lines
    expect = [("apple", 1), ("w", 3), ("w", -2), ("w", 9), ("café", 1), ("tab\tin", 2), ("pear", 1)]
    assert _release(r)["ctr"] == expected_ctr(cfg, expect)


def test_uart_bytes_items(tmp_path):
    cfg = S.config(sketch=ZERO, source={"type": "uart", "items": "bytes"})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    r = S.run(["fwdrive.boot()", "fwdrive.run(3)", "fwdrive.uart([b'\\x00\\x01', b'abc'])\nfwdrive.run(600)"],
              flash).check()
    assert _release(r)["ctr"] == expected_ctr(cfg, [b"\x00\x01", b"abc"])


def test_pulse_widths_feed_a_dcs_sketch(tmp_path):
    """Pulse widths (ms) are numeric readings for kind dcs; nothing of a pulse stays after a poll."""
    from pansketch.agent import hashing
    from pansketch.agent.dcs import DyadicSketch
    from pansketch.agent.sketch import new_counters

    sketch = dict(ZERO, kind="dcs", b=8, map=[1, 1, 0], d=2, w=16)
    cfg = S.config(sketch=sketch, source={"type": "pulse", "pin": 5, "level": "high", "unit": "ms", "slots": 4})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    widths = [120, 35, 35, 250, 7, 300]  # 300 ms clips to 255 (b = 8); 6 pulses through a 4-slot ring
    steps = ["fwdrive.boot()\nimport machine\np = machine.pins[5]", "fwdrive.run(3)"]
    for k, wd in enumerate(widths):
        steps.append("p.fire(value=1)\nfakehw.advance(%d)\np.fire(value=0)\nfakehw.advance(5)\n%s" % (
            wd, "fwdrive.run(1)" if k % 2 else ""))
    steps.append("p.fire(value=0)\nfwdrive.run(1)")  # a falling edge without a pulse start counts nothing
    steps.append("print('@clean', fwdrive.app.source.n, fwdrive.app.source.t0, list(fwdrive.app.source.ring), "
                 "list(fwdrive.app.source.out))\nfwdrive.run(600)")
    r = S.run(steps, flash).check()
    assert r.values()["clean"] == "0 -1 [0, 0, 0, 0] [0, 0, 0, 0]"
    m = _release(r)
    sk = DyadicSketch(8, 2, 16, hashing.salt_prefix(cfg["salt"]), 1, (1, 1, 0), new_counters(9 * 2 * 16))
    for wd in widths:
        sk.update(wd)
    assert m["kind"] == "dcs" and m["ctr"] == sk.counters.tobytes()
