"""Heap and time of the board firmware on MicroPython's Unix port (real GC, fixed heap).

    python -m tests.bench_firmware_unix          # full: also the smallest heap each config runs in
    (tests/test_firmware_unix_bench.py runs the quick part in the test suite)

Writes ``bench-results/firmware-unix.json``. The firmware boots from a flash
staged like ``deploy/flash.sh --mpy`` (tests/unixvm.py) and runs its real main
loop against a real mosquitto; ``tests/mpunix/bench.py`` measures inside the VM.
Heaps here are exact ``-X heapsize`` values on the VM tests/mpunix/build.sh
built: 32-bit like the ESP32/RP2040 where the compiler can build it (the JSON's
``bits``); a 64-bit VM needs about 1.5x the heap for the same code and objects.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from tests import unixvm as U

OUT = U.REPO / "bench-results" / "firmware-unix.json"


def _config(port: int, w: int, device: str) -> dict[str, Any]:
    # the default CountSketch (d=4; w=1024 is agent.params' default), keep mode like the WebAssembly figures
    return U.board_config(port, device=device, kind="cs", d=4, w=w, mode="keep", window_s=4, epoch_s=2,
                          persist_s=600)


def run_bench(binary: Path, tmp: Path, port: int, heap: str, w: int, mpy: bool = True, **opts: Any) -> dict[str, str]:
    """One VM run of tests/mpunix/bench.py; returns its ``@key value`` lines (``error`` if it failed)."""
    tmp.mkdir(parents=True, exist_ok=True)
    flash = U.stage_flash(tmp / "flash", _config(port, w, "bench-%s-%d" % (heap, w)), mpy=mpy)
    hw = tmp / "hw"
    hw.mkdir(exist_ok=True)
    (hw / "bench.json").write_text(json.dumps(opts))
    b = U.Board(binary, flash, hw, heap=heap, log=tmp / "bench.log", exact_heap=True)
    rc = b.run_script("bench", 60, also=("benchrun",))
    v = b.values()
    if rc != 0 or "done" not in v:
        v["error"] = "exit %s: %s" % (rc, "\n".join(b.text.splitlines()[-6:]))
    return v


def measure(binary: Path, tmp: Path, port: int, heap: str, w: int, **opts: Any) -> dict[str, Any]:
    v = run_bench(binary, tmp, port, heap, w, **opts)
    if "error" in v:
        return {"heap": heap, "d": 4, "w": w, "boots": False, "error": v.get("idle") or v["error"]}
    steps, live_hw, slow_ms, seq = (int(x) for x in v["loop"].split())
    fills = []
    for ln in (tmp / "bench.log").read_text().splitlines():
        if ln.startswith("@fill "):
            free, us, gcs, gc_us = ln.split()[1:]
            fills.append({"free_bytes": int(free), "us_per_event": float(us), "events_per_s": round(1e6 / float(us)),
                          "collections_per_1000_events": int(gcs), "us_per_collection": int(gc_us),
                          "gc_us_per_event": round(int(gcs) * int(gc_us) / 1000, 2)})
    return {
        "heap": heap, "d": 4, "w": w, "boots": True,
        "heap_bytes": int(v["heap"]), "live_after_boot": int(v["live_boot"]),
        "largest_free_block_after_boot": int(v["largest_free_boot"]),
        "live_with_bench_code": int(v["live_loaded"]),
        "live_high_water": live_hw, "loop_steps": steps, "slowest_step_ms": slow_ms,
        "idle_step_us": int(v["idle_step_us"]),
        "garbage_per_event": int(v["alloc_event"]),
        "us_per_event_by_free_heap": fills,
        "uart_us_per_event": float(v["uart_us"].split()[1]),
    }


def runs_in(binary: Path, tmp: Path, port: int, heap_kib: int, w: int) -> bool:
    """Does /main.py, unchanged, boot in this heap, count 300 UART lines, commit a release, publish it and
    delete it on the host's acknowledgement?"""
    flash = U.stage_flash(tmp / "flash", _config(port, w, "min-%d-%d" % (w, heap_kib)), mpy=True)
    b = U.Board(binary, flash, tmp / "hw", heap="%dK" % heap_kib, log=tmp / "board.log", exact_heap=True)
    try:
        b.start(wait=False)
        try:
            b.wait_for(r"pansketch: (running|NOT RUNNING)", 15)
        except AssertionError:
            return False
        if "NOT RUNNING" in b.text:
            return False
        b.feed(["item-%d" % (i % 64) for i in range(300)])
        done = U.wait_until(lambda: b.next_seq() >= 1 and not b.outbox() or not b.running, 8)
        return done and b.running and b.next_seq() >= 1 and not b.trouble()
    finally:
        b.kill()


def min_heap(binary: Path, tmp: Path, port: int, w: int, lo: int = 64, hi: int = 320, step: int = 4) -> Optional[int]:
    """Smallest -X heapsize (KiB, multiple of ``step``) in which :func:`runs_in` holds, or None if not even ``hi``."""
    def ok(k: int) -> bool:
        return runs_in(binary, tmp / ("min-%d-%d" % (w, k)), port, k, w)

    if not ok(hi):
        return None
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


MIN_HEAP_W = (64, 128, 256, 512, 1024)
# (board heap, w): the VM gets U.vm_heap(board heap), i.e. the same on a 32-bit VM
# the default sketch (w = 1024) needs 132 KiB since the failure-path, identifier and TLS code of
# this round (124 KiB before): measured in 144 KiB
FULL = (("144K", 1024), ("128K", 256), ("192K", 1024))
QUICK = (("144K", 1024),)


def main(argv: Optional[list[str]] = None, quick: bool = False) -> dict[str, Any]:
    """Measure; write bench-results/firmware-unix.json (quick: the default sketch in 144 KiB only; the other
    configs and the smallest heaps are kept from a full run on the same kind of VM)."""
    binary = U.build()
    bits = U.word_bits(binary)
    res: dict[str, Any] = {"vm": "MicroPython Unix port v1.29.0-preview, %d-bit, real GC, fixed heap (-X heapsize, "
                                 "exactly as listed), .mpy code (deploy/flash.sh --mpy layout), umqtt.simple 1.8.0, "
                                 "real mosquitto and aggregator (releases leave on its acks)" % bits,
                           "bits": bits,
                           "config": "CountSketch d=4, keep mode, epoch 2 s, dgauss rho=1/2, UART source",
                           "runs": []}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        host = U.Host(tmp / "host", persistent=False)  # mosquitto + aggregator: releases leave on its acks
        try:
            host.start_aggregator()
            for board_heap, w in (QUICK if quick else FULL):
                heap = U.vm_heap(board_heap, binary)
                r = measure(binary, tmp / ("m-%s-%d" % (heap, w)), host.port, heap, w)
                r["board_heap"] = board_heap
                res["runs"].append(r)
            if not quick:
                res["min_heap_kib"] = {str(w): min_heap(binary, tmp, host.port, w) for w in MIN_HEAP_W}
        finally:
            host.close()
    OUT.parent.mkdir(exist_ok=True)
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    if quick and old.get("bits") == bits:  # keep what only a full run (on this kind of VM) measures
        for k in ("min_heap_kib",):
            if k in old:
                res[k] = old[k]
        mine = {(r["heap"], r["w"]) for r in res["runs"]}
        res["runs"] += [r for r in old.get("runs", []) if (r["heap"], r["w"]) not in mine]
    OUT.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    return res


if __name__ == "__main__":
    json.dump(main(sys.argv[1:]), sys.stdout, indent=2)
    print()
