"""Benchmark of the device core; writes bench-results/core.json.

    python -m pansketch.host_tools.bench.core [--events N] [--out DIR] [--no-mp]

CPython: events/second of the per-event and batch update paths for
Count-Min and CountSketch (d=4, w=2048, ~16-byte string items from a Zipf
stream), printed as ratios against a plain-Python dict counter and
``collections.Counter`` measured in the same process on the same stream;
also the numpy host path (pansketch.host_tools.fasthash). Release size and encode time
for d=4, w=1024. MicroPython (WebAssembly port under node, see tests/support/mpvm.py):
time per event, bytes allocated per event, the live heap high-water mark
for a d=4, w=1024 keep-mode recorder, and the time to draw the noise.
Figures, not assertions: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from pansketch.agent import hashing, release
from pansketch.agent.params import Params
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.agent.sketch import Sketch, new_counters

SALT = "bench-fleet-salt"


def zipf_items(n: int, universe: int = 100_000, s: float = 1.1, seed: int = 1) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    ranks = rng.zipf(s, size=n)
    ranks = ranks[ranks <= universe]
    while len(ranks) < n:
        extra = rng.zipf(s, size=n)
        ranks = np.concatenate([ranks, extra[extra <= universe]])
    return ["device-%09d" % int(r) for r in ranks[:n]]  # 16 bytes each


def best_of(fn: Callable[[], Any], repeat: int = 3, clock: Callable[[], float] = time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def bench_cpython(n: int) -> dict[str, Any]:
    items = zipf_items(n)
    prefix = hashing.salt_prefix(SALT)
    res: dict[str, Any] = {"events": n, "distinct": len(set(items)), "d": 4, "w": 2048, "item_bytes": 16}

    def dict_counter() -> None:
        c: dict[str, int] = {}
        for x in items:
            c[x] = c.get(x, 0) + 1

    res["dict_counter_eps"] = n / best_of(dict_counter)
    res["collections_counter_eps"] = n / best_of(lambda: collections.Counter(items))
    for kind in ("cms", "cs"):
        def per_event() -> None:
            s = Sketch(kind, 4, 2048, prefix)
            for x in items:
                s.update(x)

        def batch() -> None:
            Sketch(kind, 4, 2048, prefix).update_many(items)

        res[kind + "_per_event_eps"] = n / best_of(per_event, 1)
        res[kind + "_batch_eps"] = n / best_of(batch)
    try:  # the peer: Apache DataSketches' Count-Min, per event from Python
        from datasketches import count_min_sketch

        rounds = []
        for _ in range(5):  # interleaved with ours, so both see the same machine load; CPU time of this process
            def ds_per_event() -> None:
                c = count_min_sketch(4, 2048)
                u = c.update
                for x in items:
                    u(x)

            def ours_per_event() -> None:
                s = Sketch("cms", 4, 2048, prefix)
                u = s.update
                for x in items:
                    u(x)

            rounds.append((best_of(ds_per_event, 1, time.process_time), best_of(ours_per_event, 1, time.process_time)))
        ds_t = min(r[0] for r in rounds)
        ours_t = min(r[1] for r in rounds)
        res["datasketches_cms_per_event_eps"] = n / ds_t
        res["cms_per_event_vs_datasketches"] = ds_t / ours_t
        res["cms_per_event_vs_datasketches_per_round"] = [round(r[0] / r[1], 3) for r in rounds]
        res["per_event_timer"] = "CPU time of the process (time.process_time), best of 5 interleaved rounds"
        res["loadavg_1min"] = round(os.getloadavg()[0], 2)
    except ImportError:  # pip install datasketches to compare
        pass
    try:
        from pansketch.host_tools import fasthash

        res["numpy_host_eps"] = n / best_of(lambda: fasthash.sketch_counts(items, None, "cs", 4, 2048, SALT))
    except ImportError:  # numpy missing: not a device requirement
        pass
    p = Params({"device": "bench-1", "salt": SALT, "d": 4, "w": 1024, "mode": "keep", "epoch_s": 600})
    ctr = new_counters(4 * 1024)
    blob = release.encode(p, 0, 1000, 1001, 0, ctr)
    res["release_bytes_d4_w1024"] = len(blob)
    res["release_encode_ms"] = 1000 * best_of(lambda: release.encode(p, 0, 1000, 1001, 0, ctr), 5)
    rng = Rng(DeterministicSource(b"bench"))
    cells = 4096
    res["noise_draw_us_per_cell_cpython"] = 1e6 * best_of(lambda: [p.noise.sample(rng) for _ in range(cells)], 1) / cells
    return res


MP_SETUP = """
import gc, time
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import Rng, DeterministicSource
from pansketch.agent import release
P = Params({"device": "bench-1", "salt": %r, "d": 4, "w": 1024, "mode": "keep", "window_s": 3600, "epoch_s": 600})
t = time.ticks_us()
rec = Recorder(P, "/flash/dev", %d, rng=Rng(DeterministicSource(b"bench")), log=lambda m: None)
print("@open_us", time.ticks_diff(time.ticks_us(), t))
NAMES = ["device-%%09d" %% j for j in range(200)]
def step(k, n):
    a = gc.mem_alloc()
    t = time.ticks_us()
    for i in range(n):
        rec.add(NAMES[(i * 7919 + k) %% 200])
    dt = time.ticks_diff(time.ticks_us(), t)
    print("@step %%d %%d %%d" %% (k, dt, gc.mem_alloc() - a))
    rec.tick(%d + k * 180)
"""


def bench_micropython(events: int = 10_000, chunk: int = 500) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support import mpvm

    if not mpvm.available():
        return {"skipped": "MicroPython VM not installed (make setup)"}
    t0 = 200_000 * 3600
    steps = [MP_SETUP % (SALT, t0, t0)] + ["step(%d, %d)" % (k, chunk) for k in range(events // chunk)]
    steps.append("t = time.ticks_us(); rec.tick(%d); print('@release_us', time.ticks_diff(time.ticks_us(), t))" % (t0 + 3600))
    with tempfile.TemporaryDirectory() as td:
        r = mpvm.run(steps, heap=128 * 1024, flash=td).check()
    us = alloc = 0
    for line in r.stdout.splitlines():
        if line.startswith("@step"):
            _, _k, dt, a = line.split()
            us += int(dt)
            alloc += int(a)
    v = r.values()
    return {
        "vm": "MicroPython 1.27 WebAssembly port (node)",
        "config": "cs d=4 w=1024 keep, 10-min epochs",
        "events": events,
        "us_per_event": us / events,
        "bytes_allocated_per_event": alloc / events,
        "live_heap_high_water_bytes": r.peak_live,
        "open_with_internal_noise_ms": int(v["open_us"]) / 1000,
        "release_with_output_noise_ms": int(v["release_us"]) / 1000,
    }


MP_TREE_SETUP = """
import gc, time
from pansketch.agent.params import Params
from pansketch.agent.recorders import make
from pansketch.agent.rng import Rng, DeterministicSource
cfg = {"device": "bench-t", "salt": %r, "kind": "cs", "d": %d, "w": %d, "epoch_s": 60, "persist_s": 86400,
       "persist_noise": %r}
if %d > 1:
    cfg["mode"] = "tree"
    cfg["levels"] = %d
else:
    cfg["mode"] = "window"
    cfg["window_s"] = 60
P = Params(cfg)
import pansketch.agent.tree
NAMES = ["device-%%09d" %% j for j in range(200)]
def step(k, n):
    t = time.ticks_us()
    for i in range(n):
        rec.add(NAMES[(i * 7919 + k) %% 200])
    print("@step %%d %%d" %% (k, time.ticks_diff(time.ticks_us(), t)))
"""
MP_TREE_OPEN = """
t = time.ticks_us()
rec = make(P, "/flash/dev", %d, rng=Rng(DeterministicSource(b"bench")), log=lambda m: None)
print("@open_us", time.ticks_diff(time.ticks_us(), t))
"""


MP_UPDATE = """
import time
from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch, new_counters
pre = hashing.salt_prefix(%r)
d, w = %d, %d
NAMES = ["device-%%09d" %% j for j in range(200)]
streams = [hashing.digest(pre, x, d) for x in NAMES]
sk = Sketch("cs", d, w, pre, 1, new_counters(d * w))
best = {}
def timed(key, fn):
    t = time.ticks_us()
    for i in range(2000):
        fn(i)
    best[key] = min(best.get(key, 1e9), time.ticks_diff(time.ticks_us(), t) / 2000)
for rep in range(%d):
    timed("hash", lambda i: hashing.digest(pre, NAMES[i %% 200], d))
    sk.arrays = None
    timed("window", lambda i: sk.add_stream(streams[i %% 200], 1))
    for L in %r:
        sk.arrays = [new_counters(d * w) for _ in range(L)]
        timed(L, lambda i: sk.add_stream(streams[i %% 200], 1))
print("@best", repr(best))
"""


def bench_tree_update_mp(levels: tuple[int, ...] = (1, 8, 12, 16, 24), d: int = 4, w: int = 256,
                         reps: int = 12) -> dict[str, float]:
    """µs per event in the VM: SHA-256 + counter updates for L arrays (min over interleaved repeats of
    2000 events, robust to a loaded machine; the port's clock ticks in ms). 'window' is the single-array path of window/keep mode."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support import mpvm

    if not mpvm.available():
        return {}
    r = mpvm.run(MP_UPDATE % (SALT, d, w, reps, tuple(levels)), heap=512 * 1024).check()
    best = eval(r.values()["best"], {})  # a dict literal of numbers printed by the guest
    h = best.pop("hash")
    out = {"hash_us": h, "window_us_per_event": h + best.pop("window")}
    for L, v in best.items():
        out["tree_L%d_us_per_event" % L] = h + v
    return out


def bench_tree_micropython(levels: tuple[int, ...] = (1, 8, 12, 16), d: int = 4, w: int = 256,
                           events: int = 5000, chunk: int = 250, persist_noise: str = "refresh") -> dict[str, Any]:
    """Per-event time, recorder heap and tick/persist cost in tree mode, per L (L=1: window mode),
    under one persist scheme (shadow: one more array per level)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support import mpvm

    if not mpvm.available():
        return {"skipped": "MicroPython VM not installed (make setup)"}
    t0 = 200_000 * 3600
    out: dict[str, Any] = {"vm": "MicroPython 1.27 WebAssembly port (node)", "config": "cs d=%d w=%d" % (d, w),
                           "events": events, "persist_noise": persist_noise, "levels": {}}
    for L in levels:
        steps = [MP_TREE_SETUP % (SALT, d, w, persist_noise, L, L), MP_TREE_OPEN % t0]
        steps += ["step(%d, %d)" % (k, chunk) for k in range(events // chunk)]
        # the end of epoch 2^(L-1) - 1 closes every level at once: the worst tick
        e_all = ((t0 // 60) | ((1 << (L - 1)) - 1)) + 1
        steps.append("t = time.ticks_us(); n = rec.tick(%d); print('@tick_all_us', time.ticks_diff(time.ticks_us(), t)); "
                     "print('@tick_all_releases', n)" % (e_all * 60))
        steps.append("t = time.ticks_us(); rec.persist(%d); print('@persist_us', time.ticks_diff(time.ticks_us(), t))"
                     % (e_all * 60 + 1))
        with tempfile.TemporaryDirectory() as td:
            arrays = (2 * L if persist_noise == "shadow" else L) + 2
            r = mpvm.run(steps, heap=max(128 * 1024, arrays * 4 * d * w + 96 * 1024), flash=td).check()
        chunks = [int(line.split()[2]) for line in r.stdout.splitlines() if line.startswith("@step")]
        v = r.values()
        out["levels"][str(L)] = {
            "us_per_event": sum(chunks) / events,
            "us_per_event_best_chunk": min(chunks) / chunk,
            "recorder_bytes": r.live[1] - r.live[0],  # live heap after opening minus before (same imports)
            "live_heap_high_water_bytes": r.peak_live,
            "open_ms": int(v["open_us"]) / 1000,
            "tick_all_levels_ms": int(v["tick_all_us"]) / 1000,
            "tick_all_levels_releases": int(v["tick_all_releases"]),
            "persist_ms": int(v["persist_us"]) / 1000,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000, help="CPython stream length (default 200000)")
    ap.add_argument("--out", default="bench-results", help="directory for core.json (default bench-results)")
    ap.add_argument("--no-mp", action="store_true", help="skip the MicroPython VM measurements")
    ap.add_argument("--tree-only", action="store_true", help="only the tree-mode MicroPython figures (tree.json)")
    a = ap.parse_args(argv)
    if a.tree_only:
        res_t = bench_tree_micropython()
        res_t["shadow"] = bench_tree_micropython(persist_noise="shadow")
        res_t["update"] = bench_tree_update_mp()
        print(json.dumps(res_t, indent=2))
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tree.json").write_text(json.dumps(res_t, indent=2))
        return 0
    print("CPython: %d Zipf events ..." % a.events, flush=True)
    res: dict[str, Any] = {"cpython": bench_cpython(a.events)}
    c = res["cpython"]
    base = c["dict_counter_eps"]
    print("  %-28s %12s %10s" % ("path", "events/s", "vs dict"))
    for key in ("dict_counter_eps", "collections_counter_eps", "cms_per_event_eps", "cms_batch_eps",
                "cs_per_event_eps", "cs_batch_eps", "numpy_host_eps"):
        if key in c:
            print("  %-28s %12.0f %9.3fx" % (key[:-4], c[key], c[key] / base))
    if "cms_per_event_vs_datasketches" in c:
        print("  Count-Min per event vs DataSketches count_min_sketch(4, 2048) per event: %.3fx (%.0f vs %.0f events/s)"
              % (c["cms_per_event_vs_datasketches"], c["datasketches_cms_per_event_eps"] * c["cms_per_event_vs_datasketches"],
                 c["datasketches_cms_per_event_eps"]))
    print("  release d=4 w=1024: %d bytes, encode %.2f ms" % (c["release_bytes_d4_w1024"], c["release_encode_ms"]))
    if not a.no_mp:
        print("MicroPython VM: 10000 events, d=4 w=1024 keep ...", flush=True)
        res["micropython"] = bench_micropython()
        for k, v in res["micropython"].items():
            print("  %s: %s" % (k, v))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "core.json").write_text(json.dumps(res, indent=2))
    print("wrote", out / "core.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (0 once it is gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
