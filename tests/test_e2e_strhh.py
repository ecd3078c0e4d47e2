"""End to end for kind strhh: real agents (stdin lines) -> real mosquitto -> aggregator -> store ->
``pansketch query heavy`` finds planted heavy strings with no candidate list.

Two agents see 5 * 10^4 lines each (10^5 events) at eps = 1 (dlap) per window: eight strings
hold 2 % of the events each (two of them longer than len = 12 bytes: reported as their
first 10 bytes and a hash bucket), 30 strings 0.19 % each, the rest are rare. Every 2 %
string must be reported, no 0.19 % string above the 1 % line (threshold 1000): the 20-seed
version of this claim is tests/test_strhh.py (host simulation with the same calibration).
"""

from __future__ import annotations

import random
import subprocess

from agent.strhh import encode_item
from host_tools.query.strheavy import label
from tests.test_e2e_dcs import _fleet, _query, _stop
from tests.test_e2e_support import REPO, agent_env, needs_mosquitto, pansketch_cmd

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
