"""The SQLite WAL stays bounded: the writer's RESTART checkpoint (pansketch.host_tools.store.sqlite.Store.checkpoint_if_large).

Real releases through the real Aggregator into a SQLite file; a second connection plays a
query holding a read transaction.
"""

from __future__ import annotations

import os
import sqlite3
import time

import pytest
from pansketch.host_tools.ingest.aggregator import Aggregator
from tests.support.host import T0, encoded, host_cfg, params, topic


def _wal(db: str) -> int:
    return os.path.getsize(db + "-wal") if os.path.exists(db + "-wal") else 0


@pytest.mark.slow
def test_checkpoint_rewinds_a_large_wal_and_waits_for_readers(tmp_path):
    agg = Aggregator(host_cfg(tmp_path))
    db = agg.cfg.aggregator.db
    agg.store.db.execute("PRAGMA wal_autocheckpoint = 0")  # as under background_checkpoints: no inline ones
    p = params("a")
    for k in range(200):  # one commit each: several pages per commit into the WAL
        assert agg.handle(topic("a"), encoded(p, seq=k, elo=T0 // 3600 + k, fill=k)).stored
    assert _wal(db) > 1 << 20
    assert agg.store.checkpoint_if_large(64 << 20) is None  # under the limit: nothing done
    # a reader inside a read transaction on the current snapshot: the WAL cannot restart under it
    reader = sqlite3.connect(db, isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM releases").fetchone()[0] == 200
    assert agg.handle(topic("a"), encoded(p, seq=200, elo=T0 // 3600 + 200)).stored
    t = time.monotonic()
    busy, _frames, _done = agg.store.checkpoint_if_large(1 << 20, wait=0.3)
    assert busy == 1 and time.monotonic() - t < 5  # gave up after about `wait`, not the 30 s busy timeout
    assert _wal(db) > 1 << 20 and agg.store.checkpoints == [1, 0]
    reader.execute("COMMIT")  # the query ends: the next try completes
    big = _wal(db)
    busy, frames, done = agg.store.checkpoint_if_large(1 << 20)
    assert busy == 0 and frames == done > 0 and agg.store.checkpoints == [1, 1]
    assert reader.execute("SELECT COUNT(*) FROM releases").fetchone()[0] == 201  # nothing lost
    reader.close()
    assert _wal(db) == big  # kept for reuse: not truncated to nothing (then grown page by page again)
    # the writer keeps going; its next commit writes the WAL from the start again (the file is reused),
    # and journal_size_limit cuts the file back to the limit
    assert agg.handle(topic("a"), encoded(p, seq=201, elo=T0 // 3600 + 201)).stored
    assert _wal(db) <= 1 << 20 < big
    check = sqlite3.connect(db, isolation_level=None)
    _busy, frames, _done = check.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert 0 < frames < 20  # one release's pages, not 200 releases' and more
    assert check.execute("SELECT COUNT(*) FROM releases").fetchone()[0] == 202
    check.close()
    agg.close()
