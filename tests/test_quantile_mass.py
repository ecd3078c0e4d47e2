"""Quantile and CDF answers never report ``honest_interval: true`` on a merged total that is negative or
not a number (pansketch.host_tools.query.dyadic.rank_answers), on every path: the CLI's JSON and text,
the dashboard's quantiles page and its JSON API.

The merged total goes negative with a release inside the bound: one honest dcs device with 300
readings and a stolen one whose release is the negated counters of a real release of 2,000 readings
(mass 2,000 per row: far under 100,000 events, stored).
"""

from __future__ import annotations

import array
import json
import math
import subprocess
from typing import Any

import numpy as np
import pytest

from pansketch.host_tools.query import dyadic
from tests.support.dash import REPO, Server, env, pansketch
from tests.support.dashboard import get, get_json
from tests.support.dashboard_kinds import SALT, _releases, _write_conf

DCS = {"kind": "dcs", "b": 10, "map": [10, 1, -40], "d": 3, "w": 64, "mechanism": "dgauss", "budget": "1/2"}


@pytest.fixture(scope="module")
def negative(tmp_path_factory: Any) -> str:
    from pansketch.agent import release
    from pansketch.agent.params import Params
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator
    from pansketch.host_tools.ingest.decode import decode

    conf = _write_conf(str(tmp_path_factory.mktemp("qmass")))
    honest = _releases(dict(DCS, device="t-1"), [["%.1f" % (20 + (i % 30) / 10) for i in range(300)]])
    real = decode(_releases(dict(DCS, device="mal-1"), [["25.0"] * 2000])[0])
    neg = release.encode(Params(dict(DCS, device="mal-1", salt=SALT, window_s=3600)), real.seq, real.elo, real.ehi,
                         real.part, array.array("i", [-int(x) for x in real.counters().ravel()]), real.nz)
    agg = Aggregator(hostconfig.load(conf))
    try:
        for dev, raw in (("t-1", honest[0]), ("mal-1", neg)):
            assert agg.handle("pansketch/%s/release" % dev, raw).status == "stored"
    finally:
        agg.close()
    return conf


def _query(conf: str, *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(pansketch("query", "--config", conf, *args), capture_output=True, text=True, env=env(),
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def test_cli_json_and_text(negative):
    for kind, extra in (("quantile", ("--q", "0.1", "0.5", "0.9")), ("cdf", ())):
        rows = [json.loads(x) for x in _query(negative, kind, *extra, "--json").stdout.splitlines() if x.strip()]
        assert rows and rows[0]["n"] < 0, rows[:1]
        assert not any(r["honest_interval"] for r in rows), rows
        assert all("merged total" in r["note"] for r in rows)
        text = _query(negative, kind, *extra).stdout
        assert "merged total of these releases is" in text, text
        assert "cannot separate the readings" not in text  # the reason is the total, not the resolution


def test_dashboard_page_and_api(negative):
    srv = Server(negative)
    try:
        api = get_json(srv.url + "/api/quantiles?q=0.5")
        rows = api["answers"]
        assert rows and not any(r["honest_interval"] for r in rows), rows
        cdf = get_json(srv.url + "/api/cdf")
        assert not any(r["honest_interval"] for r in cdf["answers"]), cdf
        code, body, _h = get(srv.url + "/quantiles?q=0.5")
        assert code == 200
        assert "no honest interval" in body
    finally:
        srv.stop()


class _View:
    """The parts of a DyadicView rank_answers reads, with a merged total of ``n``."""

    b = 4

    def __init__(self, n: float) -> None:
        self.n = n

    def total(self) -> tuple[float, float]:
        return self.n, 3.0

    def resolved_level(self) -> int:
        return 0

    def rank_ls(self, xs: np.ndarray, right: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.full(len(xs), 5.0), np.full(len(xs), 1.0), np.ones(len(xs), dtype=bool)


@pytest.mark.parametrize("n", [-50.0, 0.0, math.nan, math.inf])
def test_no_honest_interval_on_a_total_no_events_give(n):
    for qs in ([0.5, 0.9], None):
        rows = dyadic.rank_answers(_View(n), np.array([3, 7]), qs, (1, 1, 0))  # type: ignore[arg-type]
        assert rows and not any(a.honest for a in rows)
        assert all(not a.to_dict()["honest_interval"] for a in rows)
    good = dyadic.rank_answers(_View(40.0), np.array([3, 7]), [0.5, 0.9], (1, 1, 0))  # type: ignore[arg-type]
    assert all(a.honest for a in good)  # the control: a positive total gives its intervals
