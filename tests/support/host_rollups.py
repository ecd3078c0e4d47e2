"""Shared by tests/test_host_rollups.py and the tests that build on it: _fill."""

from __future__ import annotations

from typing import Any
from pansketch.host_tools.ingest.aggregator import Aggregator
from tests.support.host import T0, encoded, params, record, topic, zipf_stream


def _fill(agg: Aggregator, tmp: Any) -> None:
    for dv in range(4):
        dev = "r%d" % dv
        p = params(dev, d=5, w=128)
        wins = [zipf_stream(600, 300, 1.2, 10 * dv + k) for k in range(4)]
        for raw in record(p, str(tmp / dev), wins, persists=dv % 2):
            assert agg.handle(topic(dev), raw).stored
    # keep mode, 10-minute epochs: one release per epoch (hand-made counters, real encoder), the last one
    # covering 4 epochs across a window boundary (as after a full outbox)
    pk = params("keep1", d=5, w=128, mode="keep", window_s=3600, epoch_s=600)
    e0 = T0 // 600
    for k in range(20):
        assert agg.handle(topic("keep1"), encoded(pk, seq=k, elo=e0 + k, fill=k - 7, nz=2 + k % 3)).stored
    assert agg.handle(topic("keep1"), encoded(pk, seq=20, elo=e0 + 20, ehi=e0 + 24, fill=3)).stored
