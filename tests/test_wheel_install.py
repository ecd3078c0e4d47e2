"""The built wheel, installed into a fresh virtual environment outside the checkout: a user of the
package has `pansketch --version`, gets the README's files with `pansketch init DIR`, runs the Quick
start and the board fit check (and flash.sh --dry-run) from DIR with no checkout anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import quickstart_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(d / "dist"), str(REPO)],
                       capture_output=True, text=True, timeout=600, cwd=str(d))
    assert r.returncode == 0, r.stderr
    (wheel,) = (d / "dist").glob("pansketch-*.whl")
    r = subprocess.run([sys.executable, "-m", "venv", str(d / "venv")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(d / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "%s[web]" % wheel],
                       capture_output=True, text=True, timeout=900, cwd=str(d))
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "venv" / "bin"


def user_session(bindir: Path, home: Path) -> None:
    """What a user of the package does in ``home``: init, the Quick start, the board recipe's checks."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(bindir) + os.pathsep + env["PATH"]

    def sh(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=str(home), env=env, capture_output=True, text=True, timeout=300)

    r = sh("pansketch", "--version")
    assert r.returncode == 0 and r.stdout.startswith("pansketch 0."), r.stdout + r.stderr
    r = sh("pansketch", "init", ".")
    assert r.returncode == 0, r.stderr
    for f in ("examples/host.toml", "examples/agent.toml", "deploy/board/picow.example.json",
              "deploy/systemd/pansketch-aggregator.service", "deploy/flash.sh"):
        assert (home / f).is_file(), f
    assert os.access(home / "deploy" / "flash.sh", os.X_OK)

    out = quickstart_run.run(home, bindir)
    assert "all releases stored by the host" in out["feed"], out["feed"]
    assert "aa:bb:cc:01" in out["freq"] and "1 release(s) from 1 device(s)" in out["freq"], out["freq"]

    board = home / "my-board.json"
    d = json.loads((home / "deploy" / "board" / "picow.example.json").read_text())
    d.update(salt="lobby-fleet-7f3a", wifi=dict(d["wifi"], ssid="office", password="correct horse"),
             mqtt=dict(d["mqtt"], host="mqtt.office.lan", password="pw"))
    board.write_text(json.dumps(d))
    r = sh("pansketch", "fit", "my-board.json", "--board", "picow", "--code", "mpy")
    assert r.returncode == 0 and "picow with .mpy" in r.stdout and ": fits" in r.stdout, r.stdout + r.stderr
    env["PYTHON"] = str(bindir / "python")
    env["MPREMOTE"] = "true"
    r = sh("deploy/flash.sh", "-b", "picow", "-c", "my-board.json", "--mpy", "--dry-run")
    assert r.returncode == 0 and "dry run: nothing was written" in r.stdout, r.stdout + r.stderr
    assert "+ stage" in r.stdout and not (home / "build").exists()


@pytest.mark.slow
def test_wheel_quickstart_and_fit_check_outside_the_checkout(venv_bin, tmp_path):
    home = tmp_path / "user"
    home.mkdir()
    user_session(venv_bin, home)


@pytest.mark.slow
def test_wheel_quickstart_from_a_directory_with_agent_and_firmware_folders(venv_bin, tmp_path):
    home = tmp_path / "user"
    for pkg in ("agent", "firmware"):
        (home / pkg).mkdir(parents=True)
        (home / pkg / "__init__.py").write_text("# the user's own %s package\n" % pkg)
    user_session(venv_bin, home)
