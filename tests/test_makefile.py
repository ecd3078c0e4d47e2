"""The Makefile's setup logic (README: `make demo`, `make test`), without installing anything.

`make -n` in a copy of the Makefile shows what each command would run:
outside a venv it builds .venv with $(PYTHON) (PEP 668 distributions refuse
pip into the system Python), inside one it uses it, a second run with fresh
stamps installs nothing, `make demo` never touches npm, and a python3
without the venv module gets one line naming the Debian package. `.ci/run`
runs the real thing with /usr/bin/python3 and no node on the PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def base_python() -> str:
    """An interpreter that is not a venv's (the one this venv, if any, was made from)."""
    for name in ("python3", "python"):
        p = os.path.join(sys.base_prefix, "bin", name)
        if os.path.exists(p):
            return p
    pytest.skip("no base interpreter found under %s" % sys.base_prefix)
    return ""


def project(tmp_path: Path) -> Path:
    d = tmp_path / "proj"
    (d / "tests" / "mpnode").mkdir(parents=True)
    for f in ("Makefile", "pyproject.toml", "tests/mpnode/package.json", "tests/mpnode/package-lock.json"):
        shutil.copy(REPO / f, d / f)
    return d


def make(d: Path, *args: str, venv: str | None = None, dry: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL")}
    if venv is not None:
        env["VIRTUAL_ENV"] = venv
    cmd = ["make", "--no-print-directory"] + (["-n"] if dry else []) + list(args)
    return subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=60)


def test_outside_a_venv_builds_dot_venv_and_demo_needs_no_npm(tmp_path):
    d = project(tmp_path)
    py = base_python()
    r = make(d, "demo", "PYTHON=" + py)
    assert r.returncode == 0, r.stderr
    assert "%s -m venv .venv" % py in r.stdout
    assert ".venv/bin/python -m pip install -q -e \".[web]\"" in r.stdout
    assert ".venv/bin/pansketch demo" in r.stdout
    assert "npm" not in r.stdout and "[test" not in r.stdout
    r = make(d, "bench", "PYTHON=" + py)
    assert "npm" not in r.stdout and ".venv/bin/python -m pansketch.host_tools.bench.core" in r.stdout
    r = make(d, "test", "PYTHON=" + py)
    assert r.returncode == 0, r.stderr
    assert "npm install" in r.stdout
    assert '.venv/bin/python -m pip install -q -e ".[test,repro,web]"' in r.stdout
    assert ".venv/bin/python -m pytest -q" in r.stdout


def test_second_run_installs_nothing_until_pyproject_changes(tmp_path):
    d = project(tmp_path)
    py = base_python()
    v = d / ".venv"
    (v / "bin").mkdir(parents=True)
    os.symlink(py, v / "bin" / "python")
    old = time.time() - 100
    os.utime(d / "pyproject.toml", (old, old))
    for stamp in (".pansketch-venv", ".pansketch-installed-core", ".pansketch-installed-test",
                  ".pansketch-installed-demo"):
        (v / stamp).touch()
    r = make(d, "demo", "PYTHON=" + py)
    assert r.returncode == 0, r.stderr
    assert "pip install" not in r.stdout and "-m venv" not in r.stdout
    assert ".venv/bin/pansketch demo" in r.stdout
    (d / "pyproject.toml").touch()  # newer than the stamps: reinstall, but keep the venv
    r = make(d, "demo", "PYTHON=" + py)
    assert ".venv/bin/python -m pip install -q -e \".[web]\"" in r.stdout and "-m venv" not in r.stdout


def test_an_active_venv_is_used(tmp_path):
    d = project(tmp_path)
    venv = tmp_path / "myenv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(base_python(), venv / "bin" / "python")
    r = make(d, "test", venv=str(venv))
    assert r.returncode == 0, r.stderr
    assert "-m venv" not in r.stdout
    assert '%s/bin/python -m pip install -q -e ".[test,repro,web]"' % venv in r.stdout
    assert "%s/bin/python -m pytest -q" % venv in r.stdout
    assert ".venv/" not in r.stdout


def test_python_without_venv_module_gets_one_line(tmp_path):
    d = project(tmp_path)
    fake = tmp_path / "python3"  # a Debian python3 without python3-venv: no ensurepip
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && case "$2" in *ensurepip*) exit 1;; esac\nexec %s "$@"\n'
                    % base_python())
    fake.chmod(0o755)
    r = make(d, "demo", "PYTHON=%s" % fake, dry=False)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("make: ***")]
    assert lines == ["make: %s cannot create a virtual environment: install the venv module with: "
                     "sudo apt install python3-venv" % fake], r.stderr
    assert not (d / ".venv").exists()


def test_make_test_says_in_one_line_where_micropython_comes_from(tmp_path):
    """A clone without ../shared/micropython: one line naming what is missing and how to get it, exit 2."""
    d = project(tmp_path)
    env_keep = {k: os.environ.pop(k) for k in ("PANSKETCH_SHARED", "PANSKETCH_MICROPYTHON") if k in os.environ}
    try:
        r = make(d, "setup-mpunix", dry=False)
        assert r.returncode == 2, r.stdout + r.stderr
        assert len(r.stderr.strip().splitlines()) == 2 and "Error 2" in r.stderr.splitlines()[-1], r.stderr
        line = r.stderr.splitlines()[0]
        assert "../shared/micropython/build-unix.sh" in line and "PANSKETCH_SHARED" in line
        assert "PANSKETCH_MICROPYTHON" in line and "github.com/micropython/micropython" in line
        r = make(d, "test", dry=False)  # before the venv, npm or pytest
        assert r.returncode == 2 and "firmware tests need" in r.stderr and not (d / ".venv").exists()
        shared = REPO.parent / "shared"
        if (shared / "micropython" / "build-unix.sh").exists():
            r = make(d, "setup-mpunix", "PANSKETCH_SHARED=%s" % shared, dry=False)
            assert r.returncode == 0 and not r.stderr, r.stderr
        r = make(d, "setup-mpunix", "PANSKETCH_MICROPYTHON=/usr/local/bin/micropython", dry=False)
        assert r.returncode == 0 and not r.stderr, r.stderr
    finally:
        os.environ.update(env_keep)
