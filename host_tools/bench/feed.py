"""Whole-process benchmark: ``pansketch-agent feed`` against a DataSketches stdin reader.

    python -m pansketch.host_tools.bench.feed [--events N] [--rounds R] [--out DIR]

Both processes read the same file of N Zipf(1.1) items (16-byte strings)
on standard input and count it into a d=4, w=2048 sketch (ours: CountSketch,
``--kind cs``, as in the goals table; ``--kind cms`` for Count-Min): the peer is
Apache DataSketches' ``count_min_sketch(4, 2048)`` updated line by line
from Python (no privacy, no output); ours is the real agent with internal
and output noise, a release committed to the outbox and delivered through
a real mosquitto to a real aggregator that stores it and acknowledges it
(so the figure includes start-up, noise, commit and end-to-end delivery).
Rounds are interleaved; each round's ratio (peer time / our time, wall
clock and CPU time of the process) and the best of each are reported, with
the load average, and written to bench-results/feed.json. Needs mosquitto
and ``datasketches``. ``--profile`` also runs the agent once under cProfile
and keeps the top of the profile (bench-results/feed-profile.txt).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
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


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run(events: int, rounds: int, kind: str = "cs", profile: bool = False) -> dict[str, Any]:
    from pansketch.host_tools.bench.core import zipf_items
    from pansketch.host_tools.localnet import Mosquitto
    from pansketch.host_tools.bench.localfleet import AggregatorThread, agent_toml, host_toml

    res: dict[str, Any] = {"events": events, "kind": kind, "d": 4, "w": 2048, "rounds": [],
                           "loadavg_at_start": os.getloadavg()}
    # A deployed agent runs from compiled modules (pip and the Debian package compile them), as the
    # peer's DataSketches does; a PYTHONDONTWRITEBYTECODE environment would recompile ours per run.
    compileall.compile_dir(str(Path(__file__).resolve().parents[2] / "agent"), quiet=1)
    with tempfile.TemporaryDirectory() as td:
        tdp = Path(td)
        data = tdp / "events.txt"
        data.write_text("\n".join(zipf_items(events)) + "\n")
        broker = Mosquitto(tdp)
        try:
            # one window holds every event of a round: the host's contribution limit must admit them
            host = AggregatorThread(host_toml(str(tdp / "h.toml"), broker.port, str(tdp / "h.db"),
                                              fleet_extra="max_events_per_window = %d" % max(100000, 2 * events)))
            for r in range(rounds + (1 if profile else 0)):
                cfg = agent_toml(str(tdp / ("a%d.toml" % r)), "bench-%d" % r, broker.port, str(tdp / ("s%d" % r)),
                                 w=2048, d=4, kind=kind)
                agent = [sys.executable, "-m", "pansketch.agent.pi.daemon", "feed", "--config", cfg, "--timeout", "60", "-q"]
                if r == rounds:  # the extra profiled run (not a round)
                    prof = tdp / "feed.prof"
                    # pansketch.agent.pi.daemon.main, not the entry point: cli() ends with os._exit, before cProfile writes
                    driver = tdp / "profiled_agent.py"
                    driver.write_text("import gc, sys\nimport pansketch.agent.pi.common as c, pansketch.agent.pi.daemon as d\n"  # as cli() does, without os._exit
                                      "c.gc_held = True\ngc.disable()\nsys.exit(d.main())\n")
                    with open(data, "rb") as f:
                        subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), str(driver)] + agent[3:],
                                       stdin=f, env=_env(), capture_output=True, check=True)
                    res["profile"] = _profile_top(prof)
                    continue
                rnd: dict[str, Any] = {"loadavg_1min": round(os.getloadavg()[0], 2)}
                for name, cmd in (("datasketches", [sys.executable, "-c", PEER]), ("agent", agent)):
                    with open(data, "rb") as f:
                        c0 = _child_cpu()
                        t = time.perf_counter()
                        p = subprocess.run(cmd, stdin=f, env=_env(), capture_output=True)
                        dt = time.perf_counter() - t
                        cpu = _child_cpu() - c0
                    if p.returncode != 0:
                        raise RuntimeError("%s failed: %s" % (name, p.stderr.decode()[-500:]))
                    rnd[name] = {"wall_s": round(dt, 4), "cpu_s": round(cpu, 4)}
                    print("round %d %-12s %.2f s wall, %.2f s CPU (%.0f k events/s)"
                          % (r, name, dt, cpu, events / dt / 1e3), flush=True)
                rnd["ratio_wall"] = round(rnd["datasketches"]["wall_s"] / rnd["agent"]["wall_s"], 3)
                rnd["ratio_cpu"] = round(rnd["datasketches"]["cpu_s"] / rnd["agent"]["cpu_s"], 3)
                res["rounds"].append(rnd)
            host.stop()
        finally:
            broker.stop()
    rs = res["rounds"]
    best = {n: min(x[n]["wall_s"] for x in rs) for n in ("agent", "datasketches")}
    best_cpu = {n: min(x[n]["cpu_s"] for x in rs) for n in ("agent", "datasketches")}
    res.update({"agent_s": best["agent"], "datasketches_s": best["datasketches"],
                "ratio": round(best["datasketches"] / best["agent"], 3),
                "agent_cpu_s": best_cpu["agent"], "datasketches_cpu_s": best_cpu["datasketches"],
                "ratio_cpu": round(best_cpu["datasketches"] / best_cpu["agent"], 3),
                "ratios_per_round": [x["ratio_wall"] for x in rs], "ratios_cpu_per_round": [x["ratio_cpu"] for x in rs]})
    print("best: agent %.2f s, DataSketches %.2f s -> agent runs at %.2fx the peer's speed (CPU time: %.2fx); "
          "per round %s" % (best["agent"], best["datasketches"], res["ratio"], res["ratio_cpu"], res["ratios_per_round"]))
    return res


def _profile_top(path: Path, n: int = 25) -> str:
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(n)
    text = out.getvalue()
    return text[text.find("   ncalls"):] if "   ncalls" in text else text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kind", choices=("cs", "cms"), default="cs")
    ap.add_argument("--profile", action="store_true", help="also profile one agent run (feed-profile.txt)")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()
    res = run(a.events, a.rounds, a.kind, a.profile)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    prof = res.pop("profile", None)
    if prof is not None:
        (Path(a.out) / "feed-profile.txt").write_text(prof)
    (Path(a.out) / "feed.json").write_text(json.dumps(res, indent=1))
    print("wrote %s" % (Path(a.out) / "feed.json"))


if __name__ == "__main__":
    main()
