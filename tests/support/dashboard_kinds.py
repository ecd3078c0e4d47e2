"""Shared by tests/test_dashboard_kinds.py and the tests that build on it: SALT, T0, _cs_device, _releases, _store, _write_conf, cli, rows, table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from typing import Any
from tests.support.dash import REPO, env, pansketch


SALT = "dash-kinds-salt"


T0 = 1_800_000_000 // 3600 * 3600


def _write_conf(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    conf = os.path.join(root, "host.toml")
    with open(conf, "w") as f:
        f.write('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "kinds.db"\nmax_clock_skew_s = 1e9\n' % SALT)  # releases of 2027
    return conf


def _releases(cfg: dict[str, Any], windows: list[list[str]]) -> list[bytes]:
    """The real device core (make_recorder picks the dbits recorder for kind dbits) over hourly windows."""
    from pansketch.agent.params import Params
    from pansketch.agent.recorders import make_recorder
    from pansketch.agent.rng import DeterministicSource, Rng

    p = Params(dict(cfg, salt=SALT, window_s=3600))
    with tempfile.TemporaryDirectory() as tmp:
        rec = make_recorder(p, tmp, T0, rng=Rng(DeterministicSource(p.device.encode())), log=lambda m: None)
        t = T0
        for events in windows:
            rec.add_many(events)
            t += 3600
            rec.tick(t)
        return [rec.outbox.read(s) for s in rec.outbox.pending()]


def _store(conf: str, devices: dict[str, tuple[dict[str, Any], list[list[str]]]]) -> None:
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator

    agg = Aggregator(hostconfig.load(conf))
    try:
        for dev, (cfg, windows) in devices.items():
            for raw in _releases(dict(cfg, device=dev), windows):
                assert agg.handle("pansketch/%s/release" % dev, raw).status == "stored"
    finally:
        agg.close()


def _cs_device() -> tuple[dict[str, Any], list[list[str]]]:
    return ({"kind": "cs", "d": 4, "w": 64}, [["item-%d" % (i % 50) for i in range(500)] for _ in range(2)])


def cli(conf: str, *args: str) -> list[dict[str, Any]]:
    r = subprocess.run(pansketch("query", "--config", conf, *args, "--json"), capture_output=True, text=True,
                       env=env(), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def table(dom: str, table_id: str) -> str:
    m = re.search(r'<table[^>]*id="%s".*?</table>' % table_id, dom, re.S)
    assert m, "no table %s" % table_id
    return m.group(0)


def rows(dom: str, table_id: str) -> list[dict[str, str]]:
    """data-* attributes and cell texts of each body row."""
    out = []
    for tr in re.findall(r"<tr ([^>]*data-[^>]*)>(.*?)</tr>", table(dom, table_id), re.S):
        d = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', tr[0]))
        d["cells"] = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", tr[1], re.S)]
        out.append(d)
    return out
