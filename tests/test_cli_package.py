"""`pansketch --version`, and `serve` / `demo --serve` saying the web extra is missing before any work."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time

import pytest
from host_tools import cli, demo
from host_tools.web import extra, serve


@pytest.mark.slow
def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "host_tools.cli", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "pansketch %s" % version("pansketch")


def _without_web(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jinja2" else real(name, *a))


def test_demo_serve_without_the_web_extra_stops_at_once(monkeypatch, capsys) -> None:
    _without_web(monkeypatch)
    args = cli.build_parser().parse_args(["demo", "--serve"])
    t = time.monotonic()
    assert demo.run_demo(args) == 2
    assert time.monotonic() - t < 2  # no fleet was simulated first
    err = capsys.readouterr().err
    assert "needs the web extra" in err and "jinja2" in err and "pip install 'pansketch[web]'" in err


def test_serve_without_the_web_extra_says_so(monkeypatch, capsys) -> None:
    _without_web(monkeypatch)
    assert extra.missing_web() is not None
    assert serve.main(argparse.Namespace(config="does-not-matter.toml")) == 2
    assert "needs the web extra" in capsys.readouterr().err
