"""The store keeps release payloads compressed (host_tools/store/payloadcodec.py) and answers exactly as
if it kept them raw: releases of every kind from the real device core, stored encoded, stored raw (as a
store written before the encoding) and half and half (such a store upgraded), give byte-identical
payloads, merged counters, roll-ups and answers, also after a purge and a roll-up rebuild."""

from __future__ import annotations


import numpy as np
import pytest

from pansketch.host_tools.ingest.decode import decode
from pansketch.host_tools.store import payloadcodec
from pansketch.host_tools.store.exclusions import purge
from pansketch.host_tools.store.rows import Pending
from pansketch.host_tools.store.sqlite import Store
from tests.support.dashboard_kinds import SALT, _releases
from tests.support.compressed import DEVICES, _events, fill, answers  # noqa: F401

# one device per kind, each over three hourly windows; every kind but dbits has over MIN_BYTES of counters


@pytest.fixture(scope="module")
def sent() -> dict[str, list[bytes]]:
    return {dev: _releases(dict(cfg, device=dev), [_events(cfg["kind"], k) for k in range(3)])
            for dev, cfg in DEVICES.items()}


def test_encoded_store_answers_as_the_raw_one_and_a_mixed_one(tmp_path, sent, monkeypatch):
    stores = {name: Store(str(tmp_path / ("%s.db" % name))) for name in ("encoded", "raw", "mixed")}
    fill(stores["encoded"], sent, monkeypatch, lambda i: True)
    fill(stores["raw"], sent, monkeypatch, lambda i: False)
    fill(stores["mixed"], sent, monkeypatch, lambda i: i % 2 == 1)
    # the encoded store holds every payload but dbits' compressed, each smaller than sent; the raw one as sent
    rows = stores["encoded"]._q("SELECT device, payload FROM releases")
    for dev, blob in rows:
        if dev == "k-dbits":
            assert 0xa0 <= blob[0] <= 0xbf  # a CBOR map: stored as sent
        else:
            assert bytes(blob[:2]) == payloadcodec.MAGIC
    enc = sum(len(b) for _, b in rows)
    raw = sum(len(b) for _, b in stores["raw"]._q("SELECT device, payload FROM releases"))
    assert raw == sum(len(x) for xs in sent.values() for x in xs) and enc < raw / 2
    base = answers(stores["raw"])
    assert answers(stores["encoded"]) == base and answers(stores["mixed"]) == base
    # a purge subtracts the device's counters from the roll-ups exactly, from either encoding
    for st in stores.values():
        rep = purge(st, "k-cs")
        assert rep.releases == 3
    base = answers(stores["raw"])
    assert answers(stores["encoded"]) == base and answers(stores["mixed"]) == base
    # a roll-up rebuild (OPERATIONS.md: delete meta 'rollups', reopen for writing) reads both encodings
    for name, st in stores.items():
        st.db.execute("DELETE FROM meta WHERE key = 'rollups'")
        st.db.commit()
        st.close()
        stores[name] = Store(str(tmp_path / ("%s.db" % name)))
    assert answers(stores["encoded"]) == answers(stores["raw"]) == answers(stores["mixed"])
    for st in stores.values():
        st.close()


def test_codec_round_trips_exactly_and_refuses_damage(sent):
    for raws in sent.values():
        for raw in raws:
            rel = decode(raw)
            r, c = rel.shape
            blob = payloadcodec.encode(raw, rel.ctr_off, r * c)
            assert payloadcodec.decode(blob) == raw
            assert (blob == raw) == (4 * r * c < payloadcodec.MIN_BYTES)
    assert payloadcodec.decode(b"") == b""  # pruned by retention
    # extreme counters (the wrap mod 2^32 of a sum) and every plane width come back exactly
    rel = decode(sent["k-cs"][0])
    n = rel.shape[0] * rel.shape[1]
    edge = np.zeros(n)
    edge[7] = -2**31  # the offset below the median's 128 mod 256 is then under -2^31: kept mod 2^32
    for vals in (np.full(n, -2**31), np.arange(n) * 524309 - 2**31, np.zeros(n), np.arange(n) % 300 - 150, edge,
                 -edge - 1, np.where(np.arange(n) % 2, 2**31 - 1, -2**31)):
        ctr = vals.astype("<i4").tobytes()
        raw = rel.payload[:rel.ctr_off] + ctr + rel.payload[rel.ctr_off + 4 * n:]
        assert payloadcodec.decode(payloadcodec.encode(raw, rel.ctr_off, n)) == raw
    blob = payloadcodec.encode(sent["k-cs"][0], rel.ctr_off, n)
    mid = len(blob) // 2
    for bad, msg in ((b"\x00\x07" + blob[2:], "unknown encoding"), (blob[:40], "does not decompress"),
                     (blob[:2] + bytes([blob[2] ^ 0x40]) + blob[3:], "header fails its checksum"),
                     (blob[:mid] + bytes([blob[mid] ^ 0x01]) + blob[mid + 1:], "does not decompress")):
        with pytest.raises(payloadcodec.PayloadError, match=msg):
            payloadcodec.decode(bad)


def test_store_compress_switch(tmp_path, sent):
    """[store] compress: unset, SQLite compresses payloads with at least 24 KiB of counters and PostgreSQL
    every one over MIN_BYTES (SQLStore.compress_default_bytes); true/false override it; the aggregator opens
    its store with it; a store reads rows of both."""
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator
    from pansketch.host_tools.store.backend import open_store
    from pansketch.host_tools.store.pg import PgStore

    assert Store.compress_default_bytes == 24576 and PgStore.compress_default_bytes == payloadcodec.MIN_BYTES
    base = '[aggregator]\ndb = "s.db"\n[fleet]\nsalt = "%s"\n' % SALT
    assert hostconfig.loads(base).store.compress is None
    with pytest.raises(hostconfig.ConfigError, match="store.compress"):
        hostconfig.loads(base + "[store]\ncompress = 1\n")
    raws = sent["k-cs"]  # d=4 w=256: 4 KiB of counters
    big = _releases({"kind": "cs", "d": 3, "w": 2048, "device": "k-big"}, [_events("cs", 0)])[0]  # 24 KiB
    for i, (text, want, want_big) in enumerate(((base, False, True), (base + "[store]\ncompress = true\n", True, True),
                                                (base + "[store]\ncompress = false\n", False, False))):
        cfg = hostconfig.loads(text.replace("s.db", str(tmp_path / ("s%d.db" % i))))
        agg = Aggregator(cfg)
        assert agg.store.compress is {0: None, 1: True, 2: False}[i]
        for raw, dev in ((raws[i], "k-cs"), (big, "k-big")):
            rel = decode(raw, "pansketch/%s/release" % dev)
            agg.store.commit_group([Pending(rel.payload, None, 1.0e9, rel=rel, device=dev)])
        for dev, blob in agg.store._q("SELECT device, payload FROM releases"):
            w = want if dev == "k-cs" else want_big
            assert (bytes(blob[:2]) == payloadcodec.MAGIC) is w and (bytes(blob) in (raws[i], big)) is not w
        agg.store.close()
    # one file written raw, then compressed: both rows read back as sent
    st = open_store(str(tmp_path / "s0.db"), compress=True)
    rel = decode(raws[1], "pansketch/k-cs/release")
    st.commit_group([Pending(rel.payload, None, 1.0e9, rel=rel, device="k-cs")])
    assert sorted(r.payload for r in st.releases(with_payload=True)) == sorted([raws[0], raws[1], big])
    st.close()
