"""Queries: selection, merging rules, top-k, the CLI's output and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pansketch.host_tools.query import core as query
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.store.sqlite import Store
from tests.support.host import SALT, T0, encoded, host_cfg, params, record, topic, zipf_stream

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: Any) -> dict[str, Any]:
    """3 devices x 3 hourly windows of Zipf events, stored through the aggregator."""
    tmp = tmp_path_factory.mktemp("fleet")
    cfg = host_cfg(tmp)
    agg = Aggregator(cfg)
    truth: dict[tuple[str, int], dict[str, int]] = {}
    for dv in range(3):
        dev = "q%d" % dv
        p = params(dev, d=5, w=256)
        windows = [zipf_stream(4000, 800, 1.2, 100 * dv + k) for k in range(3)]
        for k, ev in enumerate(windows):
            t = truth.setdefault((dev, k), {})
            for x in ev:
                t[x] = t.get(x, 0) + 1
        for raw in record(p, str(tmp / dev), windows):
            assert agg.handle(topic(dev), raw).stored
    agg.close()
    conf = tmp / "host.toml"
    conf.write_text('[aggregator]\ndb = "host.db"\n[fleet]\nsalt = "%s"\n' % SALT)
    return {"db": cfg.aggregator.db, "truth": truth, "conf": str(conf), "tmp": tmp}


def total(truth: dict[tuple[str, int], dict[str, int]], item: str, devs: Any = None, wins: Any = None) -> int:
    return sum(c.get(item, 0) for (d, k), c in truth.items()
               if (devs is None or d in devs) and (wins is None or k in wins))


def test_parse_time():
    assert query.parse_time("1700000000") == 1700000000
    assert query.parse_time("2023-11-14T22:13:20Z") == 1700000000
    assert query.parse_time("2023-11-14T23:13:20+01:00") == 1700000000
    assert query.parse_time("2023-11-14T22:13:20") == 1700000000  # naive = UTC
    with pytest.raises(ValueError):
        query.parse_time("yesterday")


def test_freq_selections_match_truth(fleet):
    st = Store(fleet["db"], readonly=True)
    truth = fleet["truth"]
    items = ["item-%d" % k for k in range(40)]
    w0 = T0 // 3600
    cases = [
        ({}, None, None, 9),
        ({"window": w0 + 1}, None, [1], 3),
        ({"since": T0 + 3600, "until": T0 + 3 * 3600}, None, [1, 2], 6),
        ({"device": "q1"}, ["q1"], None, 3),
        ({"device": ["q0", "q2"], "window": w0}, ["q0", "q2"], [0], 2),
    ]
    inside = n = 0
    for kw, devs, wins, nrel in cases:
        ans = query.freq(st, items, salt=SALT, **kw)
        assert [a.item for a in ans] == items
        assert all(a.releases == nrel for a in ans)
        for a in ans:
            f = total(truth, a.item, devs, wins)
            inside += a.lo <= f <= a.hi
            n += 1
            assert a.lo <= a.estimate <= a.hi
    assert inside / n >= 0.9  # 95% intervals, 200 answers (correlated): loose floor
    st.close()


def test_range_selection_reports_straddling_releases(fleet):
    st = Store(fleet["db"], readonly=True)
    ans = query.freq(st, ["item-0"], salt=SALT, since=T0 + 1800, until=T0 + 3 * 3600)
    assert ans[0].releases == 6 and ans[0].partial_excluded == 3  # windows 1, 2 inside; 0 straddles `since`
    with pytest.raises(query.QueryError, match="no releases match"):
        query.freq(st, ["x"], salt=SALT, since=T0 + 10 * 3600)
    with pytest.raises(query.QueryError, match="either a window id or a time range"):
        query.freq(st, ["x"], salt=SALT, window=1, since=T0)
    with pytest.raises(query.QueryError, match="salt"):
        query.freq(st, ["x"], salt="some-other-fleet-salt")
    st.close()


def test_unmergeable_releases_are_refused_with_reason(tmp_path):
    # window id T0 // 3600 of a 30-minute device is in 1996: no bound on old windows here
    a = Aggregator(host_cfg(tmp_path, aggregator={"max_past_s": 0}))
    assert a.handle(topic("small"), encoded(params("small", w=64))).stored
    assert a.handle(topic("large"), encoded(params("large", w=128))).stored
    with pytest.raises(query.QueryError, match="different sketch parameters.*w=64.*w=128|w=128.*w=64"):
        query.freq(a.store, ["x"], salt=SALT)
    assert query.freq(a.store, ["x"], salt=SALT, device="large")[0].releases == 1
    # window ids of devices with different window lengths mean different times
    assert a.handle(topic("half"), encoded(params("half", w=64, window_s=1800), elo=T0 // 3600)).stored
    with pytest.raises(query.QueryError, match="window lengths"):
        query.freq(a.store, ["x"], salt=SALT, window=T0 // 3600, device=["small", "half"])
    a.close()


def test_topk_finds_the_heavy_hitters(fleet):
    st = Store(fleet["db"], readonly=True)
    truth = fleet["truth"]
    cands = ["item-%d" % k for k in range(800)] + ["never-%d" % k for k in range(2000)]
    top = query.topk(st, cands, 10, salt=SALT)
    assert [a.rank for a in top] == list(range(1, 11))
    assert all(top[i].estimate >= top[i + 1].estimate for i in range(9))
    true_top = sorted(cands, key=lambda x: -total(truth, x))[:5]
    assert set(true_top) <= {a.item for a in top}
    # duplicates in the candidate list are answered once
    again = query.topk(st, cands + cands[:50], 10, salt=SALT)
    assert [a.item for a in again] == [a.item for a in top]
    st.close()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


@pytest.mark.slow
def test_cli_freq_and_topk_json(fleet):
    r = _cli("query", "--config", fleet["conf"], "freq", "item-0", "item-1", "nothing", "--json",
             "--window", str(T0 // 3600 + 2), "--confidence", "0.9")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["item"] for x in rows] == ["item-0", "item-1", "nothing"]
    for x in rows:
        for k in ("item", "estimate", "lo", "hi", "confidence", "window", "range", "devices"):
            assert k in x
        assert x["confidence"] == 0.9 and x["window"] == T0 // 3600 + 2 and x["devices"] == ["q0", "q1", "q2"]
        assert x["lo"] <= x["estimate"] <= x["hi"]
    f0 = total(fleet["truth"], "item-0", None, [2])
    assert abs(rows[0]["estimate"] - f0) <= 0.05 * f0

    cand = fleet["tmp"] / "cands.txt"
    cand.write_text("".join("item-%d\t3\n" % k for k in range(800)))  # event-file format: text before TAB
    r = _cli("query", "--config", fleet["conf"], "topk", "-k", "3", "--candidates", str(cand), "--json",
             "--since", "2023-11-14T22:00:00Z", "--device", "q0")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["rank"] for x in rows] == [1, 2, 3] and rows[0]["item"] == "item-0"
    assert rows[0]["devices"] == ["q0"] and rows[0]["window"] is None and rows[0]["range"]["since"]

    r = _cli("query", "--config", fleet["conf"], "freq", "item-0")  # table output
    assert r.returncode == 0 and "item-0" in r.stdout and "INTERVAL" in r.stdout
    r = _cli("query", "--config", fleet["conf"], "freq", "x", "--since", "2000-01-01", "--until", "2000-01-02")
    assert r.returncode == 1 and "no releases match" in r.stderr
    r = _cli("query", "--config", fleet["conf"], "freq", "x", "--since", "soon")
    assert r.returncode == 2 and "not a time" in r.stderr


def test_integer_items(tmp_path):
    p = params("ints", d=3, w=128)
    a = Aggregator(host_cfg(tmp_path))
    for raw in record(p, str(tmp_path / "ints"), [[42] * 300 + [7] * 100 + ["42"] * 5]):
        assert a.handle(topic("ints"), raw).stored
    ans = query.freq(a.store, [42, "42", 7], salt=SALT)
    est = [x.estimate for x in ans]
    assert abs(est[0] - 300) < 30 and abs(est[1] - 5) < 30 and abs(est[2] - 100) < 30
    assert query._item("42", True, "x") == 42
    a.close()
    arr = np.array(est)
    assert arr[0] > arr[2] > arr[1] - 30


def test_unreachable_confidence_gives_unbounded_interval(tmp_path):
    """d=1, w=4: no finite t reaches 99% (each row misses with prob >= 1/(2w)); say so, do not pretend."""
    p = params("tiny", d=1, w=4)
    a = Aggregator(host_cfg(tmp_path))
    assert a.handle(topic("tiny"), encoded(p, fill=2)).stored
    ans = query.freq(a.store, ["x"], salt=SALT, confidence=0.99)[0]
    assert ans.lo == -np.inf and ans.hi == np.inf
    d = ans.to_dict()
    assert d["lo"] is None and d["hi"] is None and d["estimate"] in (2, -2)
    assert np.isfinite(query.freq(a.store, ["x"], salt=SALT, confidence=0.6)[0].hi)
    a.close()
