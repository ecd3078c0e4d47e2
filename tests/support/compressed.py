"""Releases of every kind stored three ways (compressed, raw, mixed) and the answers compared: shared by the SQLite and PostgreSQL compressed-payload tests."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import pytest
from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.query import core as query
from pansketch.host_tools.store.rows import Pending

from tests.support.dashboard_kinds import SALT

DEVICES: dict[str, dict[str, Any]] = {
    "k-cs": {"kind": "cs", "d": 4, "w": 256},
    "k-cms": {"kind": "cms", "d": 4, "w": 256},
    "k-tree": {"kind": "cs", "d": 3, "w": 128, "mode": "tree", "epoch_s": 1800, "levels": 2},
    "k-dcs": {"kind": "dcs", "b": 6, "map": [1, 1, 0], "d": 3, "w": 16},
    "k-strhh": {"kind": "strhh", "len": 4, "d": 3, "w": 64},
    "k-dbits": {"kind": "dbits", "d": 6, "w": 64, "mechanism": "dlap", "budget": "1"},
}


def _events(kind: str, win: int) -> list[Any]:
    if kind == "dcs":
        return [(i * 7 + win) % 50 for i in range(400)]
    return ["item-%d" % ((i * i + win) % 97 % (1 + i % 40)) for i in range(600)]


def fill(st: Any, sent: dict[str, list[bytes]], monkeypatch: pytest.MonkeyPatch,
         encoded: Callable[[int], bool]) -> None:
    """Store every release, the i-th (over all devices) encoded if ``encoded(i)``, else raw (the store's
    ``compress``, [store] compress, switched per release)."""
    i = 0
    default = st.compress
    for dev, raws in sent.items():
        for raw in raws:
            st.compress = encoded(i)
            rel = decode(raw, "pansketch/%s/release" % dev)
            st.commit_group([Pending(rel.payload, None, 1.0e9 + i, rel=rel, device=dev)])
            assert st.release_count() == i + 1
            i += 1
    st.compress = default


def answers(st: Any) -> list[Any]:
    """Everything a query reads from the payloads, as bytes and reprs: payloads, per-device merges
    (raw releases), fleet-wide merges (roll-ups), frequency answers, roll-up sums."""
    out: list[Any] = []
    for r in st.releases(with_payload=True):
        assert r.payload is not None and hashlib.sha256(r.payload).hexdigest() == st._q(
            "SELECT sha256 FROM releases WHERE device = ? AND elo = ? AND ehi = ? AND part = ?",
            (r.device, r.elo, r.ehi, r.part))[0][0]
        out.append((r.device, r.seq, r.payload, st.payload(r.device, r.elo, r.ehi, r.part)))
    out.append([c.tobytes() for c in st.iter_counters()])
    for dev in sorted({r.device for r in st.releases()}):
        m, _ = query.select_merged(st, device=dev, use_rollups=False)
        out.append((dev, m.counters.tobytes(), m.releases, repr(m.noise), m.t0, m.t1))
    for kind in ("cs", "cms"):
        try:
            out.append(repr(query.freq(st, ["item-1", "item-3"], salt=SALT, device="k-" + kind)))
        except query.QueryError as exc:  # the device was purged
            out.append(str(exc))
    ids = [r.id for r in st.rollups()]
    out.append([s.tobytes() for s in st.rollup_sums(ids)])
    return out
