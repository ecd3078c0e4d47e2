"""The real Pi daemon's RAM, read the way the intruder reads it: no raw item, digest, noise
draw or exact chunk count outlives its use (docs/PRIVACY.md "Memory residue").

``pansketch-agent run`` (a followed file source, publishing to a real mosquitto) and ``feed --jobs 2`` (the daemon and its count worker) are stopped at chosen
moments and every readable mapping of each process is read (tests/support/memscan.py; the
moments and what a trial is: tests/support/memresidue.py). Required at every quiet moment (right after
a chunk, idle, after a persist, after a release): no raw item of any burst, no digest, no window
of any noise draw the exact-recovery attack needs, no exact chunk count. The negative control
runs the same scenario with ``PANSKETCH_TEST_NO_WIPE=1`` (the wiping turned off) and must find
residue: the test has the power to see it. benchmarks/memresidue.py is the longer run
(and measures ``run`` with an MQTT source too: a minute more than CI can spend here).
"""

from __future__ import annotations

import pytest

from tests.support.broker import needs_mosquitto, start_mosquitto
from tests.support.memresidue import run_scenario
from tests.support.memscan import can_read_memory

why = can_read_memory()
pytestmark = [needs_mosquitto, pytest.mark.skipif(why is not None, reason=why or "")]


def _run(tmp_path, no_wipe, command="run"):
    b = start_mosquitto(tmp_path)
    try:
        mech = "dlap" if command == "feed" else "dgauss"
        return run_scenario(str(tmp_path), command, mech, b.port, intervals=1, no_wipe=no_wipe)
    finally:
        b.stop()


def _clean(rep):
    assert rep.trials >= 200, rep.summary()
    assert rep.recovered == 0, rep.summary()  # the exact-recovery attack: 0 of >= 200 trials
    assert rep.old_draw_hits == 0, rep.summary()
    assert rep.count_hits == 0, rep.summary()
    quiet = [m for m in rep.moments if m["what"] != "mid"]
    assert all(m["items"] == 0 and m["digests"] == 0 for m in quiet), rep.summary()
    assert all(m["counters_found"] >= 1 for m in quiet), "the intruder's reference: the counters were located"


def _dirty(rep):
    quiet = [m for m in rep.moments if m["what"] != "mid"]
    assert sum(m["items"] for m in quiet) > 0, rep.summary()


def test_run_leaves_no_item_digest_draw_or_count_in_ram(tmp_path):
    rep = _run(tmp_path, no_wipe=False)
    print(rep.summary())
    _clean(rep)


def test_negative_control_without_the_wipes_finds_the_residue(tmp_path):
    """The same scenario, the wiping off: the search finds what the fix removes (raw items of
    the last chunk and their digests at the quiet moments)."""
    rep = _run(tmp_path, no_wipe=True)
    print(rep.summary())
    _dirty(rep)
    quiet = [m for m in rep.moments if m["what"] != "mid"]
    assert sum(m["digests"] for m in quiet) > 0, rep.summary()


def test_feed_jobs_2_leaves_nothing_in_the_daemon_or_its_count_worker(tmp_path):
    """``feed --jobs 2``: the daemon and its count worker (a second process, read too); the
    20,000-item burst is several reads and chunks, counted by both processes."""
    rep = _run(tmp_path, no_wipe=False, command="feed")
    print(rep.summary())
    assert all(m["pids"] == 2 for m in rep.moments), "the count worker was read too"
    _clean(rep)


def test_feed_negative_control_without_the_wipes_finds_the_residue(tmp_path):
    rep = _run(tmp_path, no_wipe=True, command="feed")
    print(rep.summary())
    _dirty(rep)
