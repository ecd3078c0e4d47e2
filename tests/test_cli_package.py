"""`pansketch --version`, and `serve` / `demo --serve` saying the web extra is missing before any work."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
import time

import pytest
from pansketch.host_tools import cli, demo
from pansketch.host_tools.web import extra, serve


@pytest.mark.slow
def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "--version"], capture_output=True, text=True,
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


def test_every_package_folder_is_in_the_distribution() -> None:
    """pyproject.toml lists every folder of agent/, firmware/ and host_tools/ that has an __init__.py, as
    pansketch.<folder>..., and maps the three folders into pansketch (one top-level import name)."""
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    repo = Path(__file__).resolve().parents[1]
    st = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert st["package-dir"] == {"pansketch." + t: t for t in ("agent", "firmware", "host_tools")}
    found = sorted("pansketch." + ".".join(p.parent.relative_to(repo).parts)
                   for t in ("agent", "firmware", "host_tools") for p in (repo / t).rglob("__init__.py")
                   if "__pycache__" not in p.parts)
    assert sorted(st["packages"]) == found


def _sub_help(parser: argparse.ArgumentParser, name: str) -> str:
    act = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return act.choices[name].format_help()


def test_a_subcommand_named_first_gets_its_own_parser_alone() -> None:
    """`pansketch query ...` registers (and imports) the query subcommand only; its parser is the same."""
    for name in ("query", "status", "device"):
        assert _sub_help(cli.build_parser(name), name) == _sub_help(cli.build_parser(), name)
    code = ("import sys; from pansketch.host_tools import cli\n"
            "try:\n    cli.main(['query', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in sys.modules if m.startswith('pansketch.host_tools.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    for other in ("pansketch.host_tools.ingest.service", "pansketch.host_tools.web.serve", "pansketch.host_tools.demo"):
        assert other not in loaded
    assert "usage: pansketch query" in r.stdout
