"""The README's board recipe, run as written (with --dry-run added, and a stand-in for mpremote that
records what it would have been asked to do): the example it copies fits the board and code form the
recipe flashes; a config that does not fit that board as flashed is refused with the smallest change
that fits; a missing --put file is refused; a refusal writes nothing (no staging, no board command).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def recipe() -> list[list[str]]:
    """The shell lines of the README's board recipe (the sh block that flashes), comments dropped."""
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        if "deploy/flash.sh" in block:
            return [shlex.split(line.split("  #")[0]) for line in block.splitlines()
                    if line.strip() and not line.startswith("#")]
    raise AssertionError("no sh block with deploy/flash.sh in README.md")


def step(lines: list[list[str]], head: str) -> list[str]:
    for argv in lines:
        if argv[0] == head or " ".join(argv[:2]) == head:
            return argv
    raise AssertionError("the README's board recipe has no %r line: %s" % (head, lines))


def user_edits(path: Path, **sketch: object) -> None:
    """What the recipe's comment tells the user to set: WiFi, broker, passwords, salt."""
    d = json.loads(path.read_text())
    d.update(salt="lobby-fleet-7f3a", wifi=dict(d["wifi"], ssid="office", password="correct horse"),
             mqtt=dict(d["mqtt"], host="mqtt.office.lan", password="pw-from-credentials"))
    d["sketch"].update(sketch)
    path.write_text(json.dumps(d))


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    log = cwd / "mpremote-calls.log"
    tool = cwd / "mpremote"
    tool.write_text("#!/bin/sh\necho \"$*\" >> %s\n" % log)
    tool.chmod(0o755)
    bindir = Path(sys.executable).parent  # the venv's pansketch, as after the recipe's activate line
    env = dict(os.environ, MPREMOTE=str(tool), PYTHON=sys.executable,
               PATH=str(bindir) + os.pathsep + os.environ.get("PATH", ""))
    if argv[0] == "deploy/flash.sh":
        argv = [str(REPO / argv[0])] + argv[1:]
    return subprocess.run(argv, capture_output=True, text=True, cwd=str(cwd), env=env, timeout=120)


@pytest.fixture
def stage_marker():
    """A file in flash.sh's staging directory: gone or joined by .mpy files if anything was staged."""
    stage = REPO / "build" / "board"
    marker = stage / "agent" / ("marker-board-recipe-%d" % os.getpid())
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("x")
    yield marker
    marker.unlink(missing_ok=True)


def assert_nothing_written(tmp: Path, marker: Path) -> None:
    assert not (tmp / "mpremote-calls.log").exists(), "the board was touched"
    assert marker.exists(), "the staging directory was wiped"


@pytest.mark.slow
def test_readme_recipe_accepts_its_example_and_refuses_what_does_not_fit(tmp_path, stage_marker):
    lines = recipe()
    cp = step(lines, "cp")
    example, mine = REPO / cp[1], tmp_path / cp[2]
    mine.write_bytes(example.read_bytes())
    user_edits(mine)
    flash = step(lines, "deploy/flash.sh")
    assert "-b" in flash or "--board" in flash, "the recipe must name its board: %s" % flash
    board = flash[flash.index("-b" if "-b" in flash else "--board") + 1]
    for spec in [flash[i + 1] for i, a in enumerate(flash) if a == "--put"]:
        (tmp_path / spec.split(":")[0]).write_bytes(b"\x30\x00")  # the user's CA (make-device-credentials.sh)

    fit = step(lines, "pansketch fit")
    r = run(fit, tmp_path)
    assert r.returncode == 0 and ": fits" in r.stdout, r.stdout + r.stderr

    r = run(flash + ["--dry-run"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    code = "mpy" if "--mpy" in flash else "frozen" if "--frozen" in flash else "py"
    words = {"mpy": ".mpy", "frozen": "frozen", "py": ".py"}[code]
    assert re.search(r"^%s with [^:]*%s[^:]*: needs \d+ of \d+ bytes .*: fits$" % (board, re.escape(words)),
                     r.stdout, re.M), r.stdout
    assert "dry run: nothing was written" in r.stdout
    assert_nothing_written(tmp_path, stage_marker)

    # twice the columns: the same recipe refuses it, naming the change that fits, dry run or not
    user_edits(mine, w=json.loads(mine.read_text())["sketch"]["w"] * 2)
    for extra in (["--dry-run"], []):
        r = run(flash + extra, tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "DOES NOT FIT" in r.stdout and "smallest change that fits:" in r.stdout, r.stdout
        assert re.search(r"w = \d+ fits the %s with" % board, r.stdout), r.stdout
        assert "nothing was written" in r.stderr
        assert_nothing_written(tmp_path, stage_marker)


@pytest.mark.slow
def test_the_esp32_example_is_refused_with_mpy_and_told_what_fits(tmp_path, stage_marker):
    """The ESP32 example (w = 1024, shadow) needs the frozen image: with .mpy flash.sh says so before
    anything is written; with --frozen it goes on."""
    mine = tmp_path / "esp32.json"
    mine.write_bytes((REPO / "deploy" / "board" / "pansketch.example.json").read_bytes())
    user_edits(mine)
    r = run(["deploy/flash.sh", "-b", "esp32", "-c", str(mine), "--mpy"], tmp_path)
    assert r.returncode == 2
    assert "esp32 with .mpy: needs" in r.stdout and "DOES NOT FIT" in r.stdout
    assert "smallest change that fits: flash with --frozen" in r.stdout, r.stdout
    assert_nothing_written(tmp_path, stage_marker)
    r = run(["deploy/flash.sh", "-b", "esp32", "-c", str(mine), "--frozen", "--dry-run"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_missing_put_file_and_missing_board_are_refused(tmp_path, stage_marker):
    mine = tmp_path / "my-board.json"
    mine.write_bytes((REPO / "deploy" / "board" / "picow.example.json").read_bytes())
    user_edits(mine)
    for extra in (["--dry-run"], []):
        r = run(["deploy/flash.sh", "-b", "picow", "-c", str(mine), "--mpy", "--put", "ca.der:/ca.der"] + extra,
                tmp_path)
        assert r.returncode == 2 and "--put file(s) not found: ca.der" in r.stderr, r.stdout + r.stderr
        assert_nothing_written(tmp_path, stage_marker)
    r = run(["deploy/flash.sh", "-c", str(mine), "--mpy"], tmp_path)
    assert r.returncode == 2 and "name the board with -b" in r.stderr
    assert_nothing_written(tmp_path, stage_marker)
