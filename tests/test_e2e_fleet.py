"""End to end: several real agents -> real mosquitto -> real aggregator -> real query CLI.

Estimates must match the known true counts within their stated intervals;
the demo must run the whole system and exit 0.
"""

from __future__ import annotations

import json
import os
import re
import random
import signal
import subprocess
import time
from collections import Counter

from pansketch.host_tools.store.sqlite import Store
from tests.support.e2e import (REPO, agent_env, agent_toml, host_toml, needs_mosquitto, pansketch_cmd,
                                    run_agent, start_mosquitto, wait_for)

pytestmark = needs_mosquitto

T0 = 1_700_000_000 - 1_700_000_000 % 3600  # in the past: the host quarantines windows from the future
FROZEN = ("--clock-start", str(T0 + 100), "--clock-speed", "0")


def zipf_stream(n_events: int, n_items: int, s: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [k ** -s for k in range(1, n_items + 1)]
    return rng.choices(["mac-%04d" % k for k in range(1, n_items + 1)], weights=weights, k=n_events)


def test_several_agents_estimates_match_truth_within_intervals(tmp_path):
    broker = start_mosquitto(tmp_path)
    agg_log = open(tmp_path / "aggregate.log", "wb")
    hcfg = host_toml(str(tmp_path / "host.toml"), broker.port, "fleet.db", fleet_extra='kind = "cs"\nd = 4\nw = 512')
    agg = subprocess.Popen(pansketch_cmd("aggregate", "--config", hcfg), stdout=agg_log, stderr=agg_log,
                           env=agent_env(), cwd=REPO)
    try:
        assert wait_for(lambda: b"subscribing" in open(tmp_path / "aggregate.log", "rb").read(), 20)
        time.sleep(0.3)
        truth: Counter = Counter()
        n_agents = 4
        for i in range(n_agents):
            events = zipf_stream(6000, 400, 1.2, seed=100 + i)
            # a few weighted lines too: weights are clipped to clip = 1
            lines = "\n".join(events) + "\nmac-0001\t5\nmac-0002\t-1\n"
            truth.update(events)
            truth["mac-0001"] += 1
            truth["mac-0002"] -= 1
            cfg = agent_toml(str(tmp_path / ("a%d.toml" % i)), "pi-%d" % i, broker.port, str(tmp_path / ("s%d" % i)),
                             w=512)
            r = run_agent("feed", cfg, "--timeout", "30", "--insecure-seed", "fleet-%d" % i, *FROZEN,
                          input=lines.encode())
            assert r.returncode == 0, r.stderr.decode()
        db = str(tmp_path / "fleet.db")
        with Store(db, readonly=True) as st:
            assert wait_for(lambda: st.release_count() >= n_agents, 20)
            assert st.release_count() == n_agents and st.rejection_count() == 0
        ranked = [x for x, _ in truth.most_common()]
        items = ranked[:10] + ranked[20:200:20] + ["never-seen"]
        q = subprocess.run(pansketch_cmd("query", "--config", hcfg, "freq", *items, "--json", "--confidence", "0.99"),
                           capture_output=True, env=agent_env(), cwd=REPO, timeout=60)
        assert q.returncode == 0, q.stderr.decode()
        answers = [json.loads(line) for line in q.stdout.decode().splitlines() if line.strip()]
        assert [a["item"] for a in answers] == items
        misses = [a for a in answers if not a["lo"] <= truth.get(a["item"], 0) <= a["hi"]]
        # 20 items at 99%: P(>= 2 misses) < 2% for honest intervals; seeds are fixed
        assert len(misses) <= 1, misses
        for a in answers:
            assert sorted(a["devices"]) == ["pi-%d" % i for i in range(n_agents)] and a["releases"] == n_agents
            assert a["confidence"] == 0.99
        # the heavy hitters are estimated to within a few percent
        for a in answers[:3]:
            assert abs(a["estimate"] - truth[a["item"]]) <= 0.05 * truth[a["item"]]
    finally:
        agg.send_signal(signal.SIGTERM)
        assert agg.wait(15) == 0
        agg_log.close()
        broker.stop()


def test_demo_runs_the_whole_system(tmp_path):
    r = subprocess.run(pansketch_cmd("demo", "--agents", "2", "--windows", "2", "--events", "6000", "--w", "1024",
                                     "--dir", str(tmp_path / "demo")),
                       capture_output=True, env=agent_env(), cwd=REPO, timeout=120)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    for step in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
        assert step in out
    # 2 cs agents x 2 windows, cms/dcs/dbits/strhh 2 each, the tree device 3 nodes (2 epochs + their level-1 parent)
    assert "stored 15 releases (0 rejected, 0 duplicates)" in out
    for kind in ("cms", "tree", "dcs", "dbits"):  # one short line per kind
        assert re.search(r"^  %s +demo-" % kind, out, re.M), out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith(("host-", "never-seen"))]
    assert len(rows) >= 10
    assert "true counts inside their intervals" in out
    assert os.path.exists(tmp_path / "demo" / "demo.db")
