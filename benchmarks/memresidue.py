"""Longer run of the whole-memory intruder against the real Pi daemon (docs/PRIVACY.md "Memory residue").

    python -m benchmarks.memresidue [--intervals N] [--out DIR] [--no-wipe]

Runs tests/support/memresidue.py for ``run`` (followed file source, publishing to a real
mosquitto) with dgauss, ``run`` with an MQTT source (each raw item one message published to
that mosquitto; its large burst is 5,000 items, not 20,000: one message each) and ``feed
--jobs 2`` (its count worker is a second process, read too) with dlap, each over N persist
intervals (a release falls among them), and prints and writes (bench-results/memresidue.json)
per moment what the memory still held: raw items, their digests, windows of the residual noise
draw (the exact-recovery attack's trials), windows of earlier draws and of exact chunk counts. ``--no-wipe`` runs the negative control
(PANSKETCH_TEST_NO_WIPE=1). Needs root (or ptrace permission) and mosquitto.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def run(intervals: int, no_wipe: bool) -> dict[str, Any]:
    from tests.support.broker import start_mosquitto
    from tests.support.memresidue import run_scenario

    out: dict[str, Any] = {"intervals": intervals, "no_wipe": no_wipe, "runs": []}
    for command, mech, source in (("run", "dgauss", "file"), ("run", "dgauss", "mqtt"), ("feed", "dlap", "file")):
        with tempfile.TemporaryDirectory() as td:
            b = start_mosquitto(td)
            try:
                t = time.monotonic()
                rep = run_scenario(td, command, mech, b.port, intervals=intervals, no_wipe=no_wipe, source=source,
                                   big=5000 if source == "mqtt" else 20000)
            finally:
                b.stop()
        print("== %s %s %s (%.0f s)\n%s" % (command, source, mech, time.monotonic() - t, rep.summary()), flush=True)
        out["runs"].append({"command": command, "source": source, "mech": mech, "trials": rep.trials,
                            "recovered": rep.recovered,
                            "old_draw_hits": rep.old_draw_hits, "old_draw_trials": rep.old_draw_trials,
                            "count_hits": rep.count_hits, "count_trials": rep.count_trials,
                            "items_total": rep.items_total, "moments": rep.moments})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--intervals", type=int, default=8)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--no-wipe", action="store_true", help="the negative control: wiping turned off")
    a = ap.parse_args()
    res = run(a.intervals, a.no_wipe)
    Path(a.out).mkdir(exist_ok=True)
    name = "memresidue-nowipe.json" if a.no_wipe else "memresidue.json"
    (Path(a.out) / name).write_text(json.dumps(res, indent=1, default=float))
    print("wrote %s" % (Path(a.out) / name))


if __name__ == "__main__":
    main()
