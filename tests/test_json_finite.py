"""JSON stays JSON: a store whose numbers give NaN or infinite bounds is answered with ``null`` and a reason.

One dcs device whose only release holds no readings and negative noise: its noisy total is below 0, so
the CDF is undefined (NaN) and, at confidence 0.999999, the heavy-hitter bounds are infinite. The CLI's
``--json`` and ``--csv`` and the dashboard's JSON API must stay strict JSON (no ``NaN``/``Infinity``),
and no endpoint may answer 500.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pansketch.host_tools.output import finitejson
from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.query.dyadic import exact_counters
from pansketch.host_tools.store.sqlite import Store
from tests.support.dashboard import _wsgi
from tests.support.dcs_host import SALT, params, payload, topic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity (Python's accepts them)."""
    def no(c):
        raise ValueError("not JSON: %s" % c)
    return json.loads(text, parse_constant=no)


@pytest.fixture(scope="module")
def conf(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    st = Store(str(root / "host.db"))
    p = params()
    ex = exact_counters([], p.b, p.d, p.w, SALT)
    noise = -np.random.default_rng(1).integers(0, 50, ex.shape)
    assert st.insert(decode(payload(p, [], noise=noise), topic("pi-1"))) == "stored"
    st.close()
    c = root / "host.toml"
    c.write_text('[aggregator]\ndb = "host.db"\nmax_clock_skew_s = 1e12\n[fleet]\nsalt = "%s"\n' % SALT)
    return c


def _cli(conf, *args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "query", "--config", str(conf), *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@pytest.mark.parametrize("args", [("quantile", "--q", "0.5"), ("cdf",), ("heavy", "-k", "5", "--confidence", "0.999999")])
def test_cli_json_is_strict_with_reasons(conf, args):
    r = _cli(conf, *args, "--json")
    assert r.returncode == 0, r.stderr
    rows = [strict(ln) for ln in r.stdout.splitlines() if ln.strip()]
    assert rows
    nulls = {k for row in rows for k, v in row.items() if v is None}
    reasons = {k for row in rows for k in row.get("null_reasons", {})}
    assert nulls and nulls - {"null_reasons"} <= reasons | {"window"}, (nulls, reasons)
    r = _cli(conf, *args, "--csv")
    assert r.returncode == 0, r.stderr
    cells = [c for row in csv.reader(io.StringIO(r.stdout)) for c in row]
    assert not {"nan", "inf", "-inf"} & {c.lower() for c in cells}  # empty cells, the reasons in their columns


@pytest.mark.parametrize("path,qs", [("/api/quantiles", ""), ("/api/cdf", ""), ("/api/heavy", ""),
                                     ("/api/heavy", "confidence=0.999999"), ("/api/quantiles", "confidence=0.999999"),
                                     ("/quantiles", ""), ("/heavy", "confidence=0.999999"), ("/api/status", "")])
def test_dashboard_answers_strict_json_not_500(conf, path, qs):
    pytest.importorskip("waitress")
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.web.app import Dashboard

    app = Dashboard(hostconfig.load(str(conf)))
    status, headers, body = _wsgi(app, path, qs)
    assert status.startswith("200"), (status, body[:300])
    if path.startswith("/api/"):
        doc = strict(body)
        if path != "/api/status":
            assert any(a.get("null_reasons") for a in doc["answers"]), doc


def test_finite_replaces_only_non_finite_numbers():
    obj = {"a": 1.5, "b": math.nan, "c": [1, math.inf, -math.inf], "d": {"e": -math.inf}, "f": "nan"}
    out = finitejson.finite(obj)
    assert out == {"a": 1.5, "b": None, "c": [1, None, None], "d": {"e": None, "null_reasons": {"e": out["d"]
                   ["null_reasons"]["e"]}}, "f": "nan",
                   "null_reasons": {"b": out["null_reasons"]["b"], "c[1]": out["null_reasons"]["c[1]"],
                                    "c[2]": out["null_reasons"]["c[2]"]}}
    assert out["null_reasons"]["b"].startswith("nan:") and out["null_reasons"]["c[2]"].startswith("-inf:")
    clean = {"x": [1, 2.0, {"y": "z"}]}
    assert finitejson.finite(clean) is clean
