"""The registry of query kinds (pansketch.host_tools.query.kinds): the CLI and the dashboard take every kind from it."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import pytest

from pansketch.host_tools.query import cli as query_cli
from pansketch.host_tools.query import kinds

KIND_NAMES = ["freq", "topk", "series", "quantile", "cdf", "heavy", "distinct"]


def _parser() -> tuple[argparse.ArgumentParser, Any]:
    top = argparse.ArgumentParser(prog="pansketch")
    sub = top.add_subparsers(dest="command")
    query_cli.add_parser(sub)
    qp = sub.choices["query"]
    qsub = next(a for a in qp._actions if isinstance(a, argparse._SubParsersAction))
    return top, qsub


def test_registry_holds_the_kinds_in_cli_order() -> None:
    assert [k.name for k in kinds.KINDS] == KIND_NAMES
    assert set(kinds.BY_NAME) == set(KIND_NAMES)
    for k in kinds.KINDS:
        assert k.sketches and set(k.sketches) <= {"cms", "cs", "dcs", "dbits", "strhh"}, k.name


def test_cli_subcommands_come_from_the_registry() -> None:
    top, qsub = _parser()
    assert list(qsub.choices) == KIND_NAMES
    assert [c.help for c in qsub._choices_actions] == [k.help for k in kinds.KINDS]
    args = top.parse_args(["query", "heavy", "-k", "3", "--json", "--since", "2026-01-01"])
    assert (args.qtype, args.k, args.json, args.since) == ("heavy", 3, True, "2026-01-01")


def test_handler_names() -> None:
    assert kinds.QueryKind.handler("/item") == "page_item"
    assert kinds.QueryKind.handler("/api/cdf") == "api_cdf"


def test_dashboard_routes_come_from_the_registry(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("jinja2")
    from pansketch.host_tools.web.app import Dashboard
    from tests.support.host import host_cfg

    dash = Dashboard(host_cfg(tmp_path))
    for k in kinds.KINDS:
        for path in (k.page, k.api):
            assert path and dash.routes[path] == getattr(dash, k.handler(path)), (k.name, path)
    # a new kind is one registration: the CLI and the dashboard pick it up
    new = dataclasses.replace(kinds.BY_NAME["distinct"], name="distinct2", help="a new kind", page="/topk", api="/api/status")
    monkeypatch.setattr(kinds, "KINDS", kinds.KINDS + (new,))
    _top, qsub = _parser()
    assert list(qsub.choices)[-1] == "distinct2"
    assert Dashboard(host_cfg(tmp_path)).routes["/api/status"].__name__ == "api_status"


def test_a_registered_path_without_a_handler_is_an_error(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("jinja2")
    from pansketch.host_tools.web.app import Dashboard
    from tests.support.host import host_cfg

    bad = dataclasses.replace(kinds.BY_NAME["freq"], name="nope", page="/nope", api=None)
    monkeypatch.setattr(kinds, "KINDS", kinds.KINDS + (bad,))
    with pytest.raises(AttributeError, match="page_nope"):
        Dashboard(host_cfg(tmp_path))


def test_dashboard_menu_lists_each_page_once(tmp_path: Any) -> None:
    pytest.importorskip("jinja2")
    from pansketch.host_tools.web.app import Dashboard
    from tests.support.host import host_cfg

    out: list[str] = []
    body = b"".join(Dashboard(host_cfg(tmp_path))({"REQUEST_METHOD": "GET", "PATH_INFO": "/no-such-page"},
                                                  lambda status, headers: out.append(status))).decode()
    assert out == ["404 Not Found"]
    nav = body[body.index("<nav>"):body.index("</nav>")]
    pages = list(dict.fromkeys(k.page for k in kinds.KINDS))
    assert [nav.count('href="%s"' % p) for p in pages] == [1] * len(pages)
    assert re.search(r'href="/quantiles"\s+title="kind dcs">Quantiles</a>', nav)
    assert re.search(r'href="/distinct"\s+title="kind dbits">Distinct</a>', nav)
    assert re.search(r'href="/item"\s*>Item over time</a>', nav)
