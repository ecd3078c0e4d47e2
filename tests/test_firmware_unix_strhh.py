"""Kind strhh on the board firmware (MicroPython Unix port, tests/support/unixvm.py) -> real mosquitto ->
aggregator -> ``pansketch query heavy``: the MicroPython agent's releases add up to the exact
prefix counters of the lines fed (zero noise: a huge budget), and the host's descent finds the
planted strings with no candidate list."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from pansketch.agent.strhh import encode_item
from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.query import strheavy
from tests.support import unixvm as U
from tests.support.broker import needs_mosquitto
from tests.support.unixvm import mpunix  # noqa: F401  (fixture)

pytestmark = needs_mosquitto

L, D, W = 4, 3, 256
HEAVY = ["sensor-ok", "err", "\u00e9t\u00e9"]  # two longer than L = 4 bytes (prefix + hash bucket)


def test_board_strhh_releases_exact_and_heavy_found(mpunix, tmp_path):  # noqa: F811
    host = U.Host(tmp_path / "host", persistent=True)
    try:
        host.start_aggregator()
        flash = U.stage_flash(tmp_path / "flash", U.board_config(host.port, kind="strhh", len=L, d=D, w=W,
                                                                   budget="100000"), mpy=False)
        board = U.Board(mpunix, flash, tmp_path / "hw", heap="192K")
        fed = [h for h in HEAVY for _ in range(60)] + ["rare-%d" % i for i in range(40)]
        fed = [fed[(i * 37) % len(fed)] for i in range(len(fed))]
        try:
            board.start()
            board.wait_for(r"mqtt: connected")
            board.wait_for(r"clock synced")
            board.feed(fed)
            seq0 = board.next_seq()
            assert U.wait_until(lambda: board.next_seq() >= seq0 + 2 and U.all_stored(host, board), 20), \
                (board.next_seq(), host.stored_seqs())
        finally:
            board.stop()
        payloads = [r[4] for r in host.stored()]
        total = sum(decode(p).counters().astype(np.int64) for p in payloads)
        assert (total == strheavy.exact_counters(fed, L, D, W, U.SALT)).all()
        q = subprocess.run([sys.executable, "-m", "pansketch.host_tools.cli", "query", "--config", str(host.config), "heavy",
                            "-k", "5", "--json"], capture_output=True, cwd=U.REPO, timeout=60,
                           env=dict(__import__("os").environ, PYTHONPATH=str(U.REPO)))
        assert q.returncode == 0, q.stderr.decode()
        rows = [json.loads(x) for x in q.stdout.decode().splitlines() if x.strip()]
        # the three planted strings first, exactly; below them (no noise to hide behind) at most the
        # buckets of the rare long items, which truly hold 1-2 events each
        assert {r["label"] for r in rows[:3]} == {strheavy.label(encode_item(h, L)) for h in HEAVY}
        assert all(r["estimate"] == 60 for r in rows[:3]), rows
        assert all(r["estimate"] <= 2 and r["item"] == "ra" and r["long"] for r in rows[3:]), rows
    finally:
        host.close()
