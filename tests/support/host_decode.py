"""Shared by tests/test_host_decode.py and the tests that build on it: bad_cases."""

from __future__ import annotations

import cbor2
from tests.support.host import dumps, encoded, params, release_map


def bad_cases():
    p = params()
    good = encoded(p)
    m = release_map(p)
    big = params(w=1 << 18)  # 4 MiB of counters > max_bytes
    yield "malformed-truncated", good[:-7], "cbor"
    yield "malformed-garbage", b"\xff\x00\x13garbage", "cbor"
    yield "trailing-bytes", good + b"\x00", "cbor"
    yield "not-a-map", cbor2.dumps([1, 2, 3]), "version"  # no field v to read (docs/FORMAT.md 2.4)
    yield "unknown-version", dumps(dict(m, v=3)), "version"
    yield "missing-version", dumps({k: v for k, v in m.items() if k != "v"}), "version"
    yield "float", cbor2.dumps(dict(m, clip=1.0)), "type"
    yield "tag", cbor2.dumps(dict(m, dev=cbor2.CBORTag(999, "dev-a"))), "type"
    yield "bignum-tag", cbor2.dumps(dict(m, seq=2 ** 70)), "type"
    yield "unknown-field", dumps(dict(m, extra=1)), "schema"
    yield "missing-field", dumps({k: v for k, v in m.items() if k != "seq"}), "schema"
    yield "wrong-type", dumps(dict(m, d="4")), "schema"
    yield "negative-seq", dumps(dict(m, seq=-1)), "schema"
    v1 = {k: v for k, v in m.items() if k != "lvl"}
    yield "tree-mode-in-v1", dumps(dict(v1, v=1, mode="tree")), "schema"
    yield "lvl-in-v1", dumps(dict(m, v=1)), "schema"
    yield "missing-lvl-v2", dumps(v1), "schema"
    yield "lvl-in-window-mode", dumps(dict(m, lvl=1)), "schema"
    yield "wrong-shape", dumps(dict(m, ctr=m["ctr"][:-4])), "shape"
    yield "shape-vs-w", dumps(dict(m, w=65)), "shape"
    yield "empty-range", dumps(dict(m, ehi=m["elo"])), "schema"
    yield "window-mismatch", dumps(dict(m, win=m["win"] + 1)), "schema"
    yield "hash-version", dumps(dict(m, hv=2)), "schema"
    yield "bad-salt-id", dumps(dict(m, salt="XYZ")), "schema"
    yield "missing-nz", dumps({k: v for k, v in m.items() if k != "nz"}), "schema"
    yield "nz-1", dumps(dict(m, nz=1)), "schema"  # fewer than one internal + one output draw
    yield "nz-0", dumps(dict(m, nz=0)), "schema"
    yield "nz-too-big", dumps(dict(m, nz=1_000_001)), "schema"
    yield "nz-text", dumps(dict(m, nz="2")), "schema"
    yield "nz-bool", dumps(dict(m, nz=True)), "schema"
    # 2^64 needs a CBOR bignum (pansketch.agent.cbor cannot write it): a schema rejection, not a crash in the encoder
    yield "budget-2^64", cbor2.dumps(dict(m, budget=[1 << 64, 1]), canonical=True), "type"
    yield "nint-den-2^64", cbor2.dumps(dict(m, nint=[3, 1 << 64]), canonical=True), "type"
    yield "unreduced-budget", dumps(dict(m, budget=[m["budget"][0] * 2, m["budget"][1] * 2])), "schema"
    yield "lookalike-dev", dumps(dict(m, dev="dev-\u0430")), "schema"  # Cyrillic a
    yield "noise-too-small", dumps(dict(m, nout=[1, 1])), "noise"
    yield "noise-vs-budget", dumps(dict(m, budget=[1, 100])), "noise"
    yield "noncanonical", cbor2.dumps(m, canonical=False), "encoding"
    yield "oversized", encoded(big), "size"
