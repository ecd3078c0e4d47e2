"""End to end for kind strhh: real agents -> real mosquitto -> aggregator -> store ->
``pansketch query heavy`` finds planted heavy strings with no candidate list.

Acceptance of kind strhh: every planted string holding >= 2 % of 10^5 events at eps = 1 is
found in >= 19 of 20 runs, and none holding < 0.2 % is reported above the threshold (here
1 % of the events, ``--threshold 1000``) in more than 1 of 20. CI runs ONE run of it twice:

* ``test_heavy_strings_without_candidates``: two CPython agents (stdin) of 5 * 10^4 events;
* ``test_cpython_and_micropython_agents_one_acceptance_run``: one CPython agent and the board
  firmware on the MicroPython Unix port, 5 * 10^4 events each (tests/bench_strhh_e2e.one_run).

Eight strings hold 2 % of the events each (two of them longer than len = 12 bytes: reported
as their first 10 bytes and a hash bucket), 30 strings 0.19 % each, the rest are rare. Every
2 % string must be reported, no 0.19 % string (nor any other) above the threshold. The 20
runs: ``python -m benchmarks.strhh_e2e --runs 20`` (bench-results/strhh-e2e.json: docs/HOST.md
"Heavy-hitter strings" has the counts); the 20-seed host simulation with the same calibration
is tests/test_strhh.py::test_descent_finds_planted_heavy_strings_20_seeds.
"""

from __future__ import annotations

import random
import subprocess

from pansketch.agent.strhh import encode_item
from pansketch.host_tools.query.strheavy import label
from tests.support.e2e_dcs import _fleet, _query, _stop
from tests.support.e2e import REPO, agent_env, needs_mosquitto, pansketch_cmd
from tests.support.unixvm import mpunix  # noqa: F401  (fixture)

pytestmark = needs_mosquitto

HEAVY = ["GET /index.html", "sensor-a", "def", "\u00e9t\u00e9", "x", "temperature_high", "ok", "self"]
LIGHT = ["light-%03d" % i for i in range(30)]


def test_heavy_strings_without_candidates(tmp_path):
    rng = random.Random(23)
    events = []
    for h in HEAVY:
        events += [h] * 2000
    for s in LIGHT:
        events += [s] * 190
    events += ["rare-%d" % rng.randrange(30000) for _ in range(100_000 - len(events))]
    rng.shuffle(events)
    streams = [events[:50_000], events[50_000:]]
    broker, agg, log, hcfg = _fleet(tmp_path, streams, "strhh", timeout=180, d=3, w=1024, mechanism="dlap", budget="1",
                                    sketch_extra="len = 12")
    try:
        rows = _query(hcfg, "heavy", "-k", "20", "--threshold", "1000")
        got = {r["label"] for r in rows}
        want = {label(encode_item(h, 12)) for h in HEAVY}
        assert got == want, (got, want)
        for r in rows:
            assert r["kind"] == "strhh" and r["devices"] == ["pi-0", "pi-1"] and r["lo"] <= 2000 <= r["hi"], r
        assert {r["item"] for r in rows if r["long"]} == {"GET /index", "temperatur"}
        # without a threshold: the FDR-controlled discoveries, heaviest first
        top = _query(hcfg, "heavy", "-k", "5")
        assert len(top) == 5 and {r["label"] for r in top} <= want
        text = subprocess.run(pansketch_cmd("query", "--config", hcfg, "heavy", "-k", "3"), capture_output=True,
                              env=agent_env(), cwd=REPO, timeout=60)
        assert text.returncode == 0 and b"strhh len=12 d=3 w=1024" in text.stdout, text.stdout
        q = subprocess.run(pansketch_cmd("query", "--config", hcfg, "freq", "x"), capture_output=True,
                           env=agent_env(), cwd=REPO, timeout=60)
        assert q.returncode == 1 and b"kind strhh (2 devices: answers heavy)" in q.stderr
    finally:
        _stop(broker, agg, log)


def test_cpython_and_micropython_agents_one_acceptance_run(mpunix, tmp_path):  # noqa: F811
    from benchmarks.strhh_e2e import HEAVY as H, one_run

    r = one_run(tmp_path, 0, mpunix)
    assert r["found"] == sorted(label(encode_item(h, 12)) for h in H), r
    assert not r["light_reported"] and not r["other"], r
