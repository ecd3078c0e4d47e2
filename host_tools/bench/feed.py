"""Whole-process benchmark: ``pansketch-agent feed`` against a DataSketches stdin reader.

    python -m host_tools.bench.feed [--events N] [--rounds R] [--out DIR]

Both processes read the same file of N Zipf(1.1) items (16-byte strings)
on standard input and count it into a d=4, w=2048 sketch: the peer is
Apache DataSketches' ``count_min_sketch(4, 2048)`` updated line by line
from Python (no privacy, no output); ours is the real agent with internal
and output noise, a release committed to the outbox and delivered through
a real mosquitto to a real aggregator that stores it and acknowledges it
(so the figure includes start-up, noise, commit and end-to-end delivery).
Rounds are interleaved; the best of each is reported, and the figures are
written to bench-results/feed.json. Needs mosquitto and ``datasketches``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEER = r"""
import sys
from datasketches import count_min_sketch
c = count_min_sketch(4, 2048)
u = c.update
for line in sys.stdin:
    u(line.rstrip("\n"))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(events: int, rounds: int) -> dict[str, Any]:
    from host_tools.bench.core import zipf_items
    from tests.broker import start_mosquitto  # the test suite's broker launcher (mosquitto on loopback)
    from tests.test_e2e_support import AggregatorThread, agent_toml, host_toml

    with tempfile.TemporaryDirectory() as td:
        tdp = Path(td)
        data = tdp / "events.txt"
        data.write_text("\n".join(zipf_items(events)) + "\n")
        broker = start_mosquitto(tdp)
        try:
            host = AggregatorThread(host_toml(str(tdp / "h.toml"), broker.port, str(tdp / "h.db")))
            best = {"agent": float("inf"), "datasketches": float("inf")}
            for r in range(rounds):
                cfg = agent_toml(str(tdp / ("a%d.toml" % r)), "bench-%d" % r, broker.port, str(tdp / ("s%d" % r)),
                                 w=2048, d=4, kind="cms")
                for name, cmd in (("datasketches", [sys.executable, "-c", PEER]),
                                  ("agent", [sys.executable, "-m", "agent.daemon", "feed", "--config", cfg,
                                             "--timeout", "60", "-q"])):
                    with open(data, "rb") as f:
                        t = time.perf_counter()
                        p = subprocess.run(cmd, stdin=f, env=_env(), capture_output=True)
                        dt = time.perf_counter() - t
                    if p.returncode != 0:
                        raise RuntimeError("%s failed: %s" % (name, p.stderr.decode()[-500:]))
                    best[name] = min(best[name], dt)
                    print("round %d %-12s %.2f s (%.0f k events/s)" % (r, name, dt, events / dt / 1e3), flush=True)
            host.stop()
        finally:
            broker.stop()
    ratio = best["datasketches"] / best["agent"]
    print("best: agent %.2f s, DataSketches %.2f s -> agent runs at %.2fx the peer's speed"
          % (best["agent"], best["datasketches"], ratio))
    return {"events": events, "agent_s": best["agent"], "datasketches_s": best["datasketches"], "ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()
    res = run(a.events, a.rounds)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "feed.json").write_text(json.dumps(res, indent=1))
    print("wrote %s" % (Path(a.out) / "feed.json"))


if __name__ == "__main__":
    main()
