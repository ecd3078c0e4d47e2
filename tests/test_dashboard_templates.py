"""The dashboard's template environment (pansketch.host_tools.web.app._environment, _bytecode_cache).

``x.name`` on a plain dict reads its key at once instead of after a failed attribute lookup: every
template text below is drawn the same as by jinja2's own environment, dict methods, missing keys and
other objects included. Templates are compiled once per user and text: a second dashboard (a fresh
server process, as far as jinja2 knows) loads them instead of compiling; a cache directory that cannot
be made leaves the pages as they were, compiled in each process.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from tests.support.dashboard import _wsgi
from tests.support.host import host_cfg

jinja2 = pytest.importorskip("jinja2")

TEXTS = ["{{ d.a }}", "{{ d.items is defined }}", "{{ d['items'] }}", "{{ d.missing is defined }}",
         "{{ d.keys()|list|join(',') }}", "{{ d.b.c }}", "{{ n.real }}", "{{ s.upper() }}", "{{ d.b.x is defined }}",
         "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}"]


def test_dict_keys_read_as_jinja2_reads_them() -> None:
    from pansketch.host_tools.web.app import _environment

    ctx = {"d": {"a": 1, "items": [2], "b": {"c": "<x>"}}, "n": 3, "s": "t"}
    for undefined in (jinja2.Undefined, jinja2.StrictUndefined):
        ours, plain = _environment(jinja2, autoescape=True, undefined=undefined), jinja2.Environment(
            autoescape=True, undefined=undefined)
        for text in TEXTS:
            assert ours.from_string(text).render(ctx) == plain.from_string(text).render(ctx), text
    strict = _environment(jinja2, undefined=jinja2.StrictUndefined)
    with pytest.raises(jinja2.UndefinedError):
        strict.from_string("{{ d.missing }}").render(ctx)


def _dashboard(tmp_path: Any) -> Any:
    from pansketch.host_tools.store.sqlite import Store
    from pansketch.host_tools.web.app import Dashboard

    cfg = host_cfg(tmp_path)
    Store(cfg.aggregator.db).close()
    return Dashboard(cfg)


def _compiles(monkeypatch: Any) -> list[str]:
    names: list[str] = []
    compile_ = jinja2.Environment.compile

    def counting(self: Any, source: Any, name: Any = None, *a: Any, **k: Any) -> Any:
        names.append(str(name))
        return compile_(self, source, name, *a, **k)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    return names


def test_templates_are_compiled_once(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where jinja2 makes its directory
    names = _compiles(monkeypatch)
    status, _h, first = _wsgi(_dashboard(tmp_path), "/")
    assert status.startswith("200") and "fleet.html" in names
    names.clear()
    status, _h, again = _wsgi(_dashboard(tmp_path), "/")
    assert status.startswith("200") and names == [] and again.count("<tr") == first.count("<tr")


def test_systemd_cache_directory_holds_them(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))  # CacheDirectory= of the unit
    names = _compiles(monkeypatch)
    assert _wsgi(_dashboard(tmp_path), "/")[0].startswith("200") and "fleet.html" in names
    assert len(list((tmp_path / "cache" / "templates").iterdir())) >= 2  # fleet.html and base.html
    names.clear()
    assert _wsgi(_dashboard(tmp_path), "/")[0].startswith("200") and names == []


def test_no_cache_directory_compiles_in_each_process(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file"))  # no directory can be made under it
    names = _compiles(monkeypatch)
    for _ in range(2):
        names.clear()
        status, _h, _body = _wsgi(_dashboard(tmp_path), "/")
        assert status.startswith("200") and "fleet.html" in names
