"""End to end for kind dcs: real agents (stdin numbers) -> real mosquitto -> aggregator -> store ->
``pansketch query quantile | cdf | heavy``.

Known streams; every answer must contain the truth within its stated
interval (95%), and the point answers must be close to the truth:

* readings: temperatures with two decimals, mapped by map = [100, 1, -40]
  (x = centi-degrees above -40 C), b = 16, three agents, merged;
* heavy hitters: IPv4 addresses (b = 32, map [1, 1, 0]) from a Zipf stream,
  no candidate list; the true top 10 must be found.

The rank intervals are calibrated (host_tools/query/dyadic.py): a correct
implementation covers with probability 95% per answer, so of the 15 rank
rows below a few may miss (at most 3: P(Binomial(15, 0.05) > 3) = 0.006;
the seeds are fixed); a broken sketch (e.g. wrong level layout) gives
ranks off by thousands and misses them all.
"""

from __future__ import annotations

import random
import subprocess
from collections import Counter

from tests.support.e2e import (REPO, agent_env, needs_mosquitto, pansketch_cmd)
from tests.support.e2e_dcs import _fleet, _query, _stop

pytestmark = needs_mosquitto


def test_quantiles_and_cdf_of_readings(tmp_path):
    rng = random.Random(7)
    streams = []
    values = []  # domain values x = floor((t + 40) * 100)
    for i in range(3):
        lines = []
        for _ in range(4000):
            t = round(rng.gauss(21.0 + i, 4.0), 2)
            lines.append("%.2f" % t)
            values.append(int(round((t + 40) * 100)))
        lines += ["not a number", "-300", "9e9"]  # ignored; clipped to 0; clipped to 2^16 - 1
        values += [0, 65535]
        streams.append(lines)
    broker, agg, log, hcfg = _fleet(tmp_path, streams, "dcs", w=1024, sketch_extra="b = 16\nmap = [100, 1, -40]")
    try:
        n = len(values)
        qa = _query(hcfg, "quantile", "--q", "0.05", "0.5", "0.95")
        assert [a["q"] for a in qa] == [0.05, 0.5, 0.95]
        misses = []  # rank rows whose interval misses the true rank (calibrated 95%: a few may)
        for a in qa:
            assert a["devices"] == ["pi-0", "pi-1", "pi-2"] and a["releases"] == 3 and a["b"] == 16
            true_rank = sum(1 for v in values if v <= a["value"])
            if not a["rank_lo"] <= true_rank <= a["rank_hi"]:
                misses.append((a, true_rank))
            assert a["n_lo"] <= n <= a["n_hi"]
            assert (a["cdf_lo"] <= true_rank / n <= a["cdf_hi"]) or misses and misses[-1][0] is a
            # the answer is a true quantile up to 1% of rank
            assert abs(true_rank / n - a["q"]) <= 0.01, (a, true_rank / n)
            lo, hi = a["reading"]
            assert abs(hi - lo - 0.01) < 1e-9
        med = sorted(values)[n // 2]
        assert abs(qa[1]["value"] - med) <= 20  # within 0.2 C
        ca = _query(hcfg, "cdf", "--at", "10", "21.5", "30")
        for a, t in zip(ca, (10, 21.5, 30)):
            x = int(round((t + 40) * 100))
            assert a["value"] == x
            true_rank = sum(1 for v in values if v <= x)
            if not a["rank_lo"] <= true_rank <= a["rank_hi"]:
                misses.append((a, true_rank))
        grid = _query(hcfg, "cdf", "--points", "9")
        # the default grid follows the data (estimated quantiles), and is monotone and consistent
        assert 2 <= len(grid) <= 9 and grid[0]["value"] >= min(values) - 100 and grid[-1]["value"] <= max(values) + 100
        assert all(a["value"] < b["value"] and a["cdf"] <= b["cdf"] for a, b in zip(grid, grid[1:]))
        assert all(0 <= a["cdf_lo"] <= a["cdf"] <= a["cdf_hi"] <= 1 for a in grid) and grid[-1]["cdf"] >= 0.99
        assert sum(1 for a in grid if 2000 < a["value"] < 10000) >= len(grid) - 2  # where the readings are
        for a in grid:
            true_rank = sum(1 for v in values if v <= a["value"])
            if not a["rank_lo"] <= true_rank <= a["rank_hi"]:
                misses.append((a, true_rank))
        assert len(misses) <= 3, misses
        # a cs query on dcs releases is refused with the reason
        q = subprocess.run(pansketch_cmd("query", "--config", hcfg, "freq", "x"), capture_output=True,
                           env=agent_env(), cwd=REPO, timeout=60)
        assert q.returncode == 1 and b"kind dcs" in q.stderr
    finally:
        _stop(broker, agg, log)


def test_heavy_hitters_without_candidates(tmp_path):
    rng = random.Random(11)
    ips = ["10.%d.%d.%d" % (rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(2000)]
    weights = [k ** -1.1 for k in range(1, len(ips) + 1)]
    streams = [rng.choices(ips, weights=weights, k=8000) for _ in range(2)]
    truth = Counter()
    for s in streams:
        for ip in s:
            a, b, c, d = (int(p) for p in ip.split("."))
            truth[(a << 24) | (b << 16) | (c << 8) | d] += 1
    broker, agg, log, hcfg = _fleet(tmp_path, streams, "dcs", w=1024, sketch_extra="b = 32")
    try:
        ha = _query(hcfg, "heavy", "-k", "10")
        assert [a["rank"] for a in ha] == list(range(1, 11))
        top10 = {x for x, _ in truth.most_common(10)}
        found = {a["value"] for a in ha}
        assert len(found & top10) >= 9, (sorted(found), sorted(top10))
        misses = [a for a in ha if not a["lo"] <= truth[a["value"]] <= a["hi"]]
        assert len(misses) <= 1, misses
        th = _query(hcfg, "heavy", "-k", "1000", "--threshold", "200")
        assert {a["value"] for a in th} >= {x for x, c in truth.items() if c >= 260}
        assert all(a["estimate"] >= 200 for a in th)
    finally:
        _stop(broker, agg, log)


def test_distinct_count_dbits(tmp_path):
    """kind dbits: three agents see known sets of phones (many sightings each); the fleet answer is the
    sum of the per-device distinct counts, inside its interval."""
    rng = random.Random(5)
    sizes = (300, 2000, 5000)
    streams = []
    for i, n in enumerate(sizes):
        macs = ["%02x:11:22:%02x:%02x:%02x" % (i, k >> 16, (k >> 8) & 255, k & 255) for k in range(n)]
        streams.append([rng.choice(macs) for _ in range(4 * n)] + macs)  # every MAC at least once
    broker, agg, log, hcfg = _fleet(tmp_path, streams, "dbits", d=16, w=1024, mechanism="dlap", budget="1")
    try:
        per = [_query(hcfg, "distinct", "--device", "pi-%d" % i)[0] for i in range(3)]
        for a, n in zip(per, sizes):
            assert a["lo"] <= n <= a["hi"], (a, n)
        a = _query(hcfg, "distinct")[0]
        assert a["releases"] == 3 and a["devices"] == ["pi-0", "pi-1", "pi-2"]
        assert a["lo"] <= sum(sizes) <= a["hi"], a
        assert abs(a["estimate"] - sum(sizes)) <= 0.25 * sum(sizes)
    finally:
        _stop(broker, agg, log)
