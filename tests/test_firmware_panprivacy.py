"""Pan-privacy of the board's RAM and release timing, in the MicroPython VM.

docs/ARCHITECTURE.md: an intruder who reads the board's memory must learn nothing
beyond the noisy sketch (and the few events still waiting in a source
buffer), and when a release goes out must depend on the clock only.
"""

from __future__ import annotations

import ast

import pytest

from tests.support import mpvm
from tests.support import firmware as S
from tests.support.firmware_run import ZERO

pytestmark = pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")

SECRET = b"badge-00042-alice"


def test_uart_buffers_hold_no_counted_line(tmp_path):
    cfg = S.config(sketch=ZERO, source={"type": "uart", "id": 1, "max_line": 24})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    data = SECRET + b"\n" + b"bob-secret\tx\n" + b"carol-" * 8 + b"\n" + b"dave\t2\r\n"
    r = S.run([
        "fwdrive.boot()\nimport machine", "fwdrive.run(3)",
        "machine.uarts[1].feed(%r)\nfwdrive.steps(2)\ns = fwdrive.app.source\n"
        "print('@line', bytes(s.line).hex(), s.len)\nprint('@chunk', bytes(s.chunk).hex())\n"
        "machine.uarts[1].feed(b'eve-partial')\nfwdrive.steps(1)\nprint('@partial', bytes(s.line[:s.len]))" % (data,),
    ], flash).check()
    v = r.values()
    line, n = v["line"].split()
    assert n == "0" and bytes.fromhex(line) == bytes(24), "a counted/skipped line stayed in the line buffer"
    assert bytes.fromhex(v["chunk"]) == bytes(64), "read bytes stayed in the chunk buffer"
    assert v["partial"] == "b'eve-partial'"  # a line still arriving is kept, of course


def test_gpio_keeps_no_edge_timestamp_after_the_debounce_window(tmp_path):
    cfg = S.config(sketch=ZERO, source={"type": "gpio", "pins": [
        {"pin": 4, "label": "door", "trigger": "rising", "debounce_ms": 50}]})
    flash = tmp_path / "f"
    S.write_config(flash, cfg)
    out = {}
    for fire in (True, False):
        r = S.run([
            "fwdrive.boot()\nimport machine\nc = fwdrive.app.source.counters[0]", "fwdrive.run(2)",
            "fakehw.advance(137)\nt = fakehw.ms\n%s\nfwdrive.run(2)\n"
            "print('@t', t)\nprint('@c', fwdrive.scalars(c))" % ("machine.pins[4].fire(1)" if fire else "pass"),
        ], flash).check()
        out[fire] = r.values()
    t = int(out[True]["t"])
    fired = ast.literal_eval(out[True]["c"])
    vals = [v for _, v in fired]
    assert t not in vals and t + 50 not in vals, fired
    # after the window the pin's state is the same whether an edge happened or not
    assert fired == ast.literal_eval(out[False]["c"])


def test_wifi_is_active_before_any_noise_is_drawn(tmp_path):
    flash = tmp_path / "f"
    S.write_config(flash, S.config())
    r = S.run([
        "fakehw.install()\nimport fakefs\nfakefs.install('/flash')\n"
        "from pansketch.agent.rng import Rng, DeterministicSource\nfrom pansketch.firmware import app as fwapp\n"
        "class Src:\n"
        "    def __init__(self):\n        self.s = DeterministicSource('t')\n"
        "    def read(self, n):\n        fakehw.order.append('noise')\n        return self.s.read(n)\n"
        "a = fwapp.boot('/flash/pansketch.json', rng=Rng(Src()))\n"
        "print('@app', type(a).__name__)\nprint('@order', fakehw.order[:3], 'noise' in fakehw.order)",
    ], flash).check()
    v = r.values()
    assert v["app"] == "App"
    assert v["order"] == "['wlan_active', 'noise', 'noise'] True"


def _timing_run(tmp_path, name, events):
    cfg = S.config(source={"type": "uart", "id": 1, "baudrate": 115200}, max_events_per_step=8)
    flash = tmp_path / name
    S.write_config(flash, cfg)
    feed = ("fakehw.uart_read_ms = 7\nfwdrive.uart(['item-%d' % (i % 5) for i in range(300)])" if events
            else "pass")
    r = S.run([
        "fwdrive.boot()\nimport fakebroker", "fwdrive.loop(20)",
        feed + "\nfwdrive.loop(30)",
        "fwdrive.loop(600)",
        "print('@rel', [d[4] for d in fakebroker.delivered if d[1].endswith('/release')])\n"
        "print('@app', fwdrive.scalars(fwdrive.app))",
    ], flash).check()
    v = r.values()
    return ast.literal_eval(v["rel"]), ast.literal_eval(v["app"])


def test_release_time_and_app_state_do_not_depend_on_events(tmp_path):
    rel_ev, app_ev = _timing_run(tmp_path, "ev", True)
    rel_no, app_no = _timing_run(tmp_path, "no", False)
    assert len(rel_ev) == 1 and len(rel_no) == 1
    # 300 lines took 38 reads of 7 ms plus busy steps, shifting the loop's phase;
    # the release still reaches the broker at the same millisecond
    assert rel_ev == rel_no
    # nothing in the app's own state tells the two runs apart (no step or event counters)
    assert app_ev == app_no
