"""Memory residue on boards: a longer intruder run and what the wiping costs (MicroPython Unix port).

    python -m benchmarks.residue_unix            # residue run + cost, writes bench-results/residue-unix.json
    python -m benchmarks.residue_unix --cost     # the cost part only
    python -m benchmarks.residue_unix --src DIR  # the cost part on another checkout's firmware (DIR: its root)

Residue (tests/support/residue.py): 3 bursts of 400 UART lines into the
default-shape CountSketch (d = 4, w = 1024) in a 192 KiB heap, each burst
followed by an idle second, a persist and a release, with the memory read at
each of those moments and at 10 random moments inside each burst; plus the
same with the scrub that a growing heap (ESP32) uses. Cost
(tests/mpunix/scrubbench.py): time and garbage per event (App.add of a str,
App.add_view of a buffer), per event through App.step() with 1, 8 and 64
lines per step (the heap scrub included), and the scrub itself, at 128 KiB
(w = 256) and 192 KiB (w = 1024) of heap. tests/test_firmware_unix_residue.py
is the CI-sized residue run.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from tests.support import residue as R
from tests.support import unixvm as U
from tests.support.freeze import manifest_files

OUT = U.REPO / "bench-results" / "residue-unix.json"
COST = (("128K", 256), ("192K", 1024))


def cost(binary: Path, tmp: Path, heap: str, w: int, src: Optional[Path] = None) -> dict[str, Any]:
    cfg = U.board_config(9, kind="cs", d=4, w=w, mode="window", window_s=3600, persist_s=3600)
    cfg["watchdog_s"] = 0
    flash = tmp / "flash"
    if src is not None:  # another checkout's firmware (e.g. before the wiping): stage its files
        flash.mkdir(parents=True, exist_ok=True)
        for rel, s in manifest_files(src):  # (path on the board, source): pansketch/... or, before, agent/...
            if s.exists():
                U.mpy_cross(s, flash / (rel[:-3] + ".mpy"))
        U.mpy_cross(U.MPLIB / "umqtt.simple" / "umqtt" / "simple.py", flash / "lib" / "umqtt" / "simple.mpy")
        for f in ("boot.py", "main.py"):
            shutil.copyfile(src / "firmware" / f, flash / f)
        U.write_config(flash, cfg)
    else:
        U.stage_flash(flash, cfg, mpy=True)
    hw = tmp / "hw"
    b = U.Board(binary, flash, hw, heap=heap, log=tmp / "cost.log", exact_heap=True)
    rc = b.run_script("scrubbench", 120, also=("benchrun",))
    res: dict[str, Any] = {"heap": heap, "w": w, "rc": rc}
    for ln in b.text.splitlines():
        if not ln.startswith("@"):
            continue
        k, *v = ln[1:].split()
        if k == "heap":
            res["heap_bytes"], res["free_after_boot"] = int(v[0]), int(v[1])
        elif k in ("event_add", "event_view"):
            res[k] = {"us": float(v[0]), "garbage_bytes": int(v[1])}
        elif k == "uart":
            res.setdefault("uart", []).append({"lines_per_step": int(v[0]), "us_per_event": float(v[1]),
                                               "us_per_step": float(v[2]), "us_per_step_fastest": int(v[3])})
        elif k == "scrub":
            res.setdefault("scrub", {})[v[0]] = {"free_bytes": int(v[1]), "us": int(v[2])}
        elif k == "collect":
            res["collect_us"] = int(v[1])
    if rc != 0:
        res["error"] = "\n".join(b.text.splitlines()[-8:])
    return res


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Per pause kind: the most events (item or digest) and random reads any dump of that kind held."""
    out: dict[str, Any] = {}
    for p in res["pauses"]:
        kind = p["pause"].rsplit("-", 1)[0]
        ev = sum(len(b["found"]) for b in p["bursts"])
        s = out.setdefault(kind, {"dumps": 0, "max_events": 0, "max_random_reads": 0})
        s["dumps"] += 1
        s["max_events"] = max(s["max_events"], ev)
        s["max_random_reads"] = max(s["max_random_reads"], p["random_found"])
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    binary = U.build()
    src = Path(argv[argv.index("--src") + 1]).resolve() if "--src" in argv else None
    doc: dict[str, Any] = {"bits": U.word_bits(binary), "cost": []}
    with tempfile.TemporaryDirectory() as t:
        for i, (heap, w) in enumerate(COST):
            doc["cost"].append(cost(binary, Path(t) / ("c%d" % i), heap, w, src))
            print(json.dumps(doc["cost"][-1]))
        if "--cost" not in argv and src is None:
            runs = []
            for i, grows in enumerate((False, True)):
                r = R.run(binary, Path(t) / ("r%d" % i), w=1024, heap="192K", bursts=3, burst=400, mid=40,
                          random_dumps=10, grows=grows, seed=i, timeout=600)
                r["summary"] = summary(r)
                print(json.dumps({"grows": grows, "summary": r["summary"], "rc": r["rc"]}))
                runs.append(r)
            doc["residue"] = runs
    if src is None:
        OUT.parent.mkdir(exist_ok=True)
        OUT.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
