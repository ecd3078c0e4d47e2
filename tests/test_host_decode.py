"""Release validation: every bad message is rejected with a reason and the db is unchanged."""

from __future__ import annotations

import array
from typing import Any

import cbor2
import pytest

from pansketch.agent import calibrate, release
from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.ingest.decode import Rejected, decode
from tests.support.host import SALT, T0, dumps, encoded, host_cfg, params, release_map, topic
from tests.support.host_decode import bad_cases


@pytest.fixture
def agg(tmp_path):
    a = Aggregator(host_cfg(tmp_path))
    # one good release already stored: every rejection below must leave it (and all else) untouched
    assert a.handle(topic("dev-a"), encoded(params(), fill=3)).status == "stored"
    yield a
    a.close()


def test_valid_release_roundtrip():
    p = params(kind="cms", d=3, w=10, mechanism="dlap", budget="1")
    ctr = array.array("i", range(-15, 15))
    raw = release.encode(p, 7, 100, 101, 2, ctr)
    rel = decode(raw, topic=topic("dev-a"))
    assert (rel.dev, rel.seq, rel.elo, rel.ehi, rel.part, rel.kind, rel.d, rel.w) == ("dev-a", 7, 100, 101, 2, "cms", 3, 10)
    assert rel.counters().ravel().tolist() == list(range(-15, 15))
    assert rel.nout == (3, 1)  # dlap scale d*clip/eps
    # persist_noise auto: 5 persists per hourly window (persist_s 600) > 4, so shadow: the
    # internal noise has half the budget (scale 2*d*clip/eps, docs/PRIVACY.md)
    assert p.shadow and rel.nint == (6, 1)
    assert rel.nz == 2
    assert rel.payload == raw
    r2 = decode(release.encode(params(kind="cms", d=3, w=10, mechanism="dlap", budget="1",
                                      persist_noise="refresh"), 7, 100, 101, 2, ctr), topic=topic("dev-a"))
    assert r2.nint == r2.nout == (3, 1)


@pytest.mark.parametrize("nz", [2, 3, 17, 1_000_000])
def test_nz_accepted_and_kept(tmp_path, nz):
    rel = decode(encoded(params(), nz=nz))
    assert rel.nz == nz
    a = Aggregator(host_cfg(tmp_path))
    assert a.handle(topic("dev-a"), encoded(params(), nz=nz)).stored
    assert [r.nz for r in a.store.releases()] == [nz]
    a.close()


def test_nz_error_names_the_field():
    with pytest.raises(Rejected) as ei:
        decode(dumps(release_map(params(), nz=1)))
    assert ei.value.code == "schema" and "'nz'" in ei.value.reason and "[2, 1000000]" in ei.value.reason
    with pytest.raises(Rejected) as ei:
        decode(dumps({k: v for k, v in release_map(params()).items() if k != "nz"}))
    assert ei.value.code == "schema" and ei.value.reason == "missing field 'nz'"


def test_ratio_bound_is_below_2_pow_63():
    """2^63 - 1 passes the range check (fails later on calibration); 2^63 and up
    are out of range: the store keeps them as signed 64-bit integers (a release
    that validated but could not be stored used to stop the aggregator), and
    2^64 used to crash the canonical re-encoding with ValueError."""
    m = release_map(params())
    with pytest.raises(Rejected) as ei:
        decode(dumps(dict(m, budget=[(1 << 63) - 1, 1])))
    assert ei.value.code == "noise"
    for k, v in (("budget", [1 << 63, 1]), ("nout", [1, 1 << 63])):
        with pytest.raises(Rejected) as ei:
            decode(cbor2.dumps(dict(m, **{k: v}), canonical=True))
        assert ei.value.code == "schema" and "2^63" in ei.value.reason, (k, ei.value.reason)
    for k, v in (("budget", [1 << 64, 1]), ("nint", [1 << 64, 1 << 64])):  # a bignum tag: refused at the byte level
        with pytest.raises(Rejected) as ei:
            decode(cbor2.dumps(dict(m, **{k: v}), canonical=True))
        assert ei.value.code == "type" and "tag" in ei.value.reason, (k, ei.value.reason)


@pytest.mark.parametrize("name,payload,code", list(bad_cases()), ids=[c[0] for c in bad_cases()])
def test_rejections_have_reasons_and_touch_nothing(agg, name, payload, code):
    before = agg.store.snapshot()
    out = agg.handle(topic("dev-a"), payload)
    assert out.status == "rejected", name
    assert out.code == code, (name, out.reason)
    assert out.reason and len(out.reason) > 10
    after = agg.store.snapshot()
    assert after[0] == before[0] and after[2] == before[2] and after[3] == before[3]  # releases untouched
    assert after[1] == before[1] + 1  # one rejection logged
    rj = agg.store.rejections(limit=1)[0]
    assert rj[4] == code and rj[5] == out.reason and rj[2] == topic("dev-a") and rj[6] == len(payload)


def test_topic_must_match_device(agg):
    before = agg.store.snapshot()
    out = agg.handle(topic("dev-b"), encoded(params("dev-a"), seq=1, elo=T0 // 3600 + 1))
    assert out.status == "rejected" and out.code == "topic" and "dev-b" in out.reason
    assert agg.store.snapshot()[3] == before[3]
    assert agg.handle("some/other/topic", encoded(params("dev-a"), seq=1, elo=T0 // 3600 + 1)).code == "topic"


def test_fleet_config_is_enforced(tmp_path):
    a = Aggregator(host_cfg(tmp_path, fleet={"kind": "cms", "d": 4, "mechanism": "dgauss"}))
    assert a.handle(topic("x"), encoded(params("x", kind="cs"))).code == "fleet"
    assert a.handle(topic("x"), encoded(params("x", kind="cms", d=5))).code == "fleet"
    assert a.handle(topic("x"), encoded(params("x", kind="cms", mechanism="dlap", budget="1"))).code == "fleet"
    p = params("x", kind="cms")
    other_salt = params("x", kind="cms", salt="another-fleet-salt")
    assert a.handle(topic("x"), encoded(other_salt)).code == "fleet"
    assert a.handle(topic("x"), encoded(p)).status == "stored"
    assert a.store.release_count() == 1 and a.store.rejection_count() == 4


def test_device_parameters_fixed_by_first_release(agg):
    before = agg.store.snapshot()
    nxt = T0 // 3600 + 1
    out = agg.handle(topic("dev-a"), encoded(params(w=128), seq=1, elo=nxt))
    assert out.code == "device" and "w 64 -> 128" in out.reason
    out = agg.handle(topic("dev-a"), encoded(params(kind="cms"), seq=1, elo=nxt))
    assert out.code == "device" and "kind" in out.reason
    out = agg.handle(topic("dev-a"), encoded(params(window_s=1800), seq=1, elo=T0 // 1800 + 2))
    assert out.code == "device" and "ep_s" in out.reason
    assert agg.store.snapshot()[3] == before[3]
    # budget/mechanism may change (the ledger tracks them per window)
    assert agg.handle(topic("dev-a"), encoded(params(mechanism="dlap", budget="2"), seq=1, elo=nxt)).stored


def test_duplicate_and_conflict(agg):
    p = params()
    same = encoded(p, fill=3)
    before = agg.store.snapshot()
    out = agg.handle(topic("dev-a"), same)
    assert out.status == "duplicate"
    after = agg.store.snapshot()
    assert after[0] == before[0] and after[3] == before[3] and after[2] == before[2] + 1
    redrawn = encoded(p, fill=4)  # same key, different noise
    out = agg.handle(topic("dev-a"), redrawn)
    assert out.status == "rejected" and out.code == "conflict" and "re-drawn" in out.reason
    assert agg.store.snapshot()[3] == before[3]
    assert agg.store.payload("dev-a", T0 // 3600, T0 // 3600 + 1, 0) == same  # the first one is kept
    # another part of the same epoch is a different release
    assert agg.handle(topic("dev-a"), encoded(p, seq=1, part=1, fill=4)).stored


def test_noise_calibration_matches_agent():
    for mech, budget, d, clip in (("dlap", "1/2", 4, 1), ("dgauss", "1/3", 5, 2), ("dgauss", "2", 1, 1)):
        p = params(mechanism=mech, budget=budget, d=d, clip=clip)
        rel = decode(encoded(p))
        spec = calibrate.noise_for(mech, budget, d, clip)
        half = calibrate.noise_for(mech, budget, d, clip, 2)
        assert rel.nout == (spec.num, spec.den)
        assert rel.nint == ((half.num, half.den) if p.shadow else (spec.num, spec.den))


def test_internal_noise_other_than_the_two_schemes_is_rejected():
    """nint may be the calibration of L arrays (refresh) or 2L (shadow), nothing else."""
    p = params(mechanism="dlap", budget="1", d=4, persist_noise="refresh")
    m = release.release_map(p, 0, 100, 101, 0, array.array("i", bytes(4 * p.cells)))
    for nint, ok in (([4, 1], True), ([8, 1], True), ([12, 1], False), ([2, 1], False)):
        m["nint"] = nint
        if ok:
            assert decode(dumps(m)).nint == tuple(nint)
        else:
            with pytest.raises(Rejected) as e:
                decode(dumps(m))
            assert e.value.code == "noise" and "expected 4/1 or 8/1" in e.value.reason
    # a tree node (L = 3 levels) under shadow: nint at 6 arrays, nout at 3
    from pansketch.agent.params import Params

    pt = Params({"device": "dev-a", "salt": SALT, "kind": "cs", "d": 4, "w": 64, "mechanism": "dlap", "budget": "1",
                 "mode": "tree", "levels": 3, "epoch_s": 60, "persist_noise": "shadow"})
    elo = T0 // 60 - (T0 // 60) % 4
    rel = decode(release.encode(pt, 0, elo, elo + 4, 0, array.array("i", bytes(4 * pt.cells)), 2, 2))
    assert rel.nint == (24, 1) and rel.nout == (12, 1)


def test_max_bytes_checked_before_decoding(tmp_path):
    cfg = host_cfg(tmp_path, aggregator={"max_bytes": 1000})
    a = Aggregator(cfg)
    out = a.handle(topic("dev-a"), b"\xa1" + b"\x00" * 5000)  # would be malformed too; size wins
    assert out.code == "size" and "1000" in out.reason
    assert a.handle(topic("dev-a"), encoded(params(w=16))).stored
    a.close()


def test_config_errors_name_the_key(tmp_path):
    cases = [
        ({"fleet": {}}, "fleet.salt"),
        ({"fleet": {"salt": "short"}}, "fleet.salt"),
        ({"fleet": {"salt": SALT, "salt_id": "0" * 16}}, "fleet.salt_id"),
        ({"fleet": {"salt": SALT, "kind": "hll"}}, "fleet.kind"),
        ({"fleet": {"salt": SALT}, "broker": {"port": 70000}}, "broker.port"),
        ({"fleet": {"salt": SALT}, "broker": {"prot": 1}}, "broker.prot"),
        ({"fleet": {"salt": SALT}, "aggregator": {"qos": 0}}, "aggregator.qos"),
        ({"fleet": {"salt": SALT}, "aggregator": {"topic": "pansketch/#"}}, "aggregator.topic"),
        ({"fleet": {"salt": SALT}, "aggregator": {"shared_group": "a/b"}}, "aggregator.shared_group"),
        ({"fleet": {"salt": SALT}, "aggregator": {"max_bytes": "big"}}, "aggregator.max_bytes"),
        ({"fleet": {"salt": SALT}, "broker": {"tls_ca": "/nonexistent/ca.pem"}}, "broker.tls_ca"),
        ({"fleet": {"salt": SALT}, "query": {"confidence": 1.5}}, "query.confidence"),
        ({"fleet": {"salt": SALT}, "ledger": {}}, "ledger"),
    ]
    for raw, key in cases:
        with pytest.raises(hostconfig.ConfigError) as ei:
            hostconfig.from_dict(raw, str(tmp_path))
        assert ei.value.key == key, (raw, str(ei.value))
    ok = hostconfig.from_dict({"fleet": {"salt_id": hostconfig.hashing.salt_id(SALT)},
                               "aggregator": {"shared_group": "g1", "db": "x.db"}}, str(tmp_path))
    assert ok.aggregator.subscription == "$share/g1/pansketch/+/release"
    assert ok.aggregator.db == str(tmp_path / "x.db")
    with pytest.raises(hostconfig.ConfigError):
        ok.require_salt()


def test_unexpected_validator_error_is_a_rejection_not_a_crash(agg, monkeypatch):
    import pansketch.host_tools.ingest.validproc as V  # the aggregator's one validation step (in process here)

    def boom(*_a, **_k):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(V, "decode_state", boom)  # what verdict() calls
    before = agg.store.snapshot()
    out = agg.handle(topic("dev-a"), b"anything")
    assert out.code == "internal" and "ZeroDivisionError" in out.reason
    assert agg.store.snapshot()[3] == before[3]


def test_fast_encoding_check_agrees_with_the_reference():
    """canonical_offset (cbor2 C encoder around the counters) == canonical_offset_ref (pansketch.agent.cbor)."""
    import cbor2 as _cbor2

    from pansketch.host_tools.ingest.decode import canonical_offset, canonical_offset_ref

    p = params(w=16)
    good = encoded(p, seq=70000, fill=-3, nz=300)
    m = _cbor2.loads(good)
    assert canonical_offset(m, good) == canonical_offset_ref(m, good) > 0
    variants = [
        dumps(dict(m, seq=2**32 - 1)), dumps(dict(m, budget=[2**63 - 1, 3])), dumps(dict(m, dev="x" * 64)),
        good[:-1] + b"\x00", good + b"\x00",
        _cbor2.dumps(m),  # cbor2's own key order: not the device's
        _cbor2.dumps(m, canonical=True),
        good.replace(b"\x63dev", b"\x63dex", 1),
    ]
    big = dict(m, budget=[2**64 - 1, 1])  # outside the fast path's int range: reference path
    variants.append(dumps(big))
    for v in variants:
        try:
            mv = _cbor2.loads(v)
        except Exception:
            continue
        assert canonical_offset(mv, v) == canonical_offset_ref(mv, v)
        assert canonical_offset(mv, good) == canonical_offset_ref(mv, good)


@pytest.mark.slow
def test_scanner_encoding_check_is_exactly_reencoding():
    """cborscan.scan's one-pass check (shortest heads, keys in encoded order) says canonical exactly when
    pansketch.agent.cbor re-encodes the decoded value to the same bytes; the counters' offset and the plain reader
    agree, also on memoryviews and on random mutations (a wrong check would store non-deterministic bytes,
    or refuse what devices write)."""
    import random

    from pansketch.agent import cbor as acbor
    from pansketch.host_tools import cborscan

    p = params(w=16)
    good = encoded(p, seq=70000, fill=-3, nz=300)
    sc = cborscan.scan(good)
    assert sc.canonical and good[sc.offsets["ctr"]:sc.offsets["ctr"] + len(sc.obj["ctr"])] == sc.obj["ctr"]
    head = good.index(b"\x63seq")  # 'seq' 70000 = 0x1a 00 01 11 70: re-encode it with an 8-byte head
    longer = good[:head + 4] + b"\x1b" + (70000).to_bytes(8, "big") + good[head + 9:]
    assert cborscan.loads(longer)["seq"] == 70000 and not cborscan.scan(longer).canonical
    dv = good.index(b"\x63dev")  # swap two adjacent 3-letter keys' positions by renaming: out of order
    assert not cborscan.scan(good[:dv] + b"\x63zzz" + good[dv + 4:]).canonical

    rng = random.Random(5)
    seen = [0, 0]
    for _ in range(3000):
        b = bytearray(good)
        for _k in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            b[i] = rng.randrange(256)
        b = bytes(b)
        try:
            sc = cborscan.scan(memoryview(b), views=True)
        except cborscan.ScanError:
            continue
        assert _plain(sc.obj) == cborscan.loads(b)
        try:
            same = acbor.dumps(_plain(sc.obj)) == b
        except (TypeError, ValueError):
            same = False
        assert sc.canonical == same, b
        seen[same] += 1
    assert seen[0] > 50 and seen[1] > 50  # both answers exercised


def test_one_pass_reader_agrees_with_the_general_reader():
    """cborscan's one-pass reader of the common case (what decode tries first) either declines or returns
    exactly what the general reader returns (value, canonical, counter offsets), on random mutations of a
    release's header and on crafted maps; it declines whatever the general reader refuses (e.g. more than
    MAX_ITEMS items made only of known keys and integer arrays)."""

    from pansketch.agent import cbor as acbor
    from pansketch.host_tools import cborscan
    from pansketch.host_tools.ingest.decode import _KNOWN

    good = encoded(params(w=16), seq=70000, fill=-3, nz=300)
    fast = cborscan._scan_known(good, memoryview(good), _KNOWN)
    assert fast is not None and fast.canonical and _plain(fast.obj) == cborscan.loads(good)
    rb = memoryview(bytearray(good))  # a writable receive buffer (the validation helper's)
    assert cborscan._scan_known(rb, rb, _KNOWN) == fast
    took = _mutations_agree(good, lambda b: cborscan._scan_known(b, memoryview(b), _KNOWN) if b else None, 11, 4000)
    assert took[0] > 500 and took[1] > 100  # both answers exercised
    many = acbor.dumps({k: [1] * 16 for _kb, (_r, k) in _KNOWN.items()})  # > MAX_ITEMS items
    with pytest.raises(cborscan.ScanError, match="data items"):
        cborscan.loads(many)
    assert cborscan._scan_known(many, None, _KNOWN) is None
    dup = good.replace(b"\x63dev", b"\x63seq", 1)  # a repeated key
    assert cborscan._scan_known(dup, None, _KNOWN) is None
    with pytest.raises(cborscan.ScanError, match="duplicate"):
        cborscan.loads(dup)

def test_payload_frames_between_processes():
    """child.send_batch / recv_frame: a batch's payloads come back byte for byte as views of one buffer,
    pickled objects sent with Connection.send in between are told apart, a reused buffer too small is
    replaced (never resized under live views), sizes that do not add up are refused."""
    import socket
    import struct
    import threading
    from multiprocessing.connection import Connection

    from pansketch.host_tools.ingest import child

    a, b = socket.socketpair()
    ca, cb = Connection(a.detach()), Connection(b.detach())
    msgs = [bytes([i]) * (i * 997) for i in range(1, 12)] + [b""]
    meta = [("t/%d" % i, len(m), i) for i, m in enumerate(msgs)]
    child.send_batch(ca, meta, msgs)
    ca.send(("connected",))
    buf = bytearray(10)
    fr = child.recv_frame(cb, buf)
    assert fr.batch and fr.obj == meta and [bytes(v) for v in fr.payloads] == msgs
    assert fr.buf is not buf and len(buf) == 10
    ev = child.recv_frame(cb, fr.buf)
    assert not ev.batch and ev.obj == ("connected",) and ev.buf is fr.buf
    child.send_batch(ca, meta[:2], msgs[:2])
    fr2 = child.recv_frame(cb, fr.buf)
    assert fr2.buf is fr.buf and [bytes(v) for v in fr2.payloads] == msgs[:2]
    big = [bytes([i % 251]) * 16583 for i in range(300)]  # ~5 MB: writev goes out in many partial writes
    t = threading.Thread(target=child.send_batch, args=(ca, [("x", len(m)) for m in big], big))
    t.start()
    fr3 = child.recv_frame(cb, fr2.buf)
    t.join(10)
    assert [bytes(v) for v in fr3.payloads] == big
    hdr = __import__("pickle").dumps([("x", 2)])
    body = struct.pack("!BI", child.BATCH, len(hdr)) + hdr + b"abc"  # says 2 bytes, carries 3
    ca.send_bytes(body)
    with pytest.raises(ValueError):
        child.recv_frame(cb)
    ca.close()
    with pytest.raises(EOFError):
        child.recv_frame(cb)


@pytest.mark.parametrize("shape", ["v1", "v2", "strhh", "dcs"])
def test_template_reader_agrees_with_the_general_reader(shape):
    """cborscan's regular-expression reader of the common case (decode's first try) either declines or
    returns exactly what the general reader returns (value, canonical, counter offset), for each key
    set a device writes (v1; v2; v2 with kind strhh's and dcs's extra fields), on random mutations of
    the header and on crafted near-misses it must decline: a longer head than needed, a negative
    integer, a trailing byte, counters running past the end, invalid UTF-8, a key out of order."""

    from pansketch.agent import cbor as acbor
    from pansketch.host_tools import cborscan
    from pansketch.host_tools.ingest.decode import _TEMPLATES

    m = release_map(params(w=16), seq=70000, nz=300, elo=2 ** 40, ehi=2 ** 40 + 1)
    if shape == "v1":
        del m["lvl"]
        m["v"] = 1
    elif shape == "strhh":
        m.update(kind="strhh", b=8)
    elif shape == "dcs":
        m.update(kind="dcs", b=8, map=[3, 2, 70000])
    good = acbor.dumps(m)
    t = _TEMPLATES[len(m)]
    fast = t.read(good, memoryview(good))
    ref = cborscan.scan(good, views=True)
    assert fast is not None and _plain(fast.obj) == _plain(ref.obj) == m and fast.offsets == ref.offsets
    assert cborscan.scan(good, views=True, known={}, templates=_TEMPLATES) == fast
    took = _mutations_agree(good, lambda b: t.read(b, memoryview(b)), 12, 3000)
    assert took[0] > 500 and took[1] > 100  # both answers exercised
    near = [good + b"\0",  # a trailing byte
            good.replace(b"\x62nz\x19\x01\x2c", b"\x62nz\x1a\x00\x00\x01\x2c"),  # a longer head for nz = 300
            good.replace(b"\x63seq\x1a\x00\x01\x11\x70", b"\x63seq\x3a\x00\x01\x11\x70"),  # seq negative
            good[:-1]]  # the last byte missing
    bad_utf8 = bytearray(good)
    dv = good.index(b"\x63dev") + 4
    bad_utf8[dv + 1] = 0xFF  # the device id's first byte: not UTF-8
    near.append(bytes(bad_utf8))
    ctr_at = good.index(b"\x63ctr") + 4
    long_ctr = bytearray(good)
    long_ctr[ctr_at + 1:ctr_at + 3] = (0xFFFF).to_bytes(2, "big")  # counters said to run past the end
    near.append(bytes(long_ctr))
    if shape == "dcs":
        near.append(acbor.dumps(dict(m, map=[3, 2, -5])))  # a negative offset: the general reader's
    for b in near:
        assert b != good
        assert t.read(b, memoryview(b)) is None, b[:80]
    assert sum(good.count(x) for x in (b"\x63seq\x1a", b"\x62nz\x19\x01\x2c")) == 2  # the replacements hit
    swapped = acbor.dumps(m).replace(b"\x61L", b"\x61X", 1)  # another key: not this template's key set
    assert t.read(swapped, None) is None


def test_template_with_the_byte_string_last_checks_its_length():
    """A template whose byte string is the last field ends right after it: a length that runs past the
    end of the message is declined (the pattern after it is empty, so only the length check stops it)."""
    from pansketch.agent import cbor as acbor
    from pansketch.host_tools import cborscan

    t = cborscan.Template([("a", "u"), ("zzz", "b")])
    good = acbor.dumps({"a": 5, "zzz": b"xyz"})
    r = t.read(good, None)
    assert r is not None and r.obj == {"a": 5, "zzz": b"xyz"} and r.offsets == {"zzz": len(good) - 3}
    assert t.read(good[:-1], None) is None  # 3 bytes said, 2 there
    assert t.read(good + b"\0", None) is None
    with pytest.raises(ValueError):
        cborscan.Template([("a", "b"), ("c", "b")])


def _plain(o: Any) -> Any:
    if isinstance(o, memoryview):
        return bytes(o)
    if isinstance(o, dict):
        return {k: _plain(v) for k, v in o.items()}
    return [_plain(v) for v in o] if isinstance(o, list) else o


def _mutations_agree(good: bytes, read: Any, seed: int, n: int) -> list[int]:
    """``n`` random mutations of ``good`` (1-3 bytes, mostly in the header, where the structure is; a tenth
    also truncated): whenever ``read`` accepts one, the general reader accepts it too and returns the same
    value and counter offsets, both say canonical, and pansketch.agent.cbor encodes the value back to those bytes.
    Returns [declined, accepted]."""
    import random

    from pansketch.agent import cbor as acbor
    from pansketch.host_tools import cborscan

    ctr = good.index(b"\x63ctr")
    rng = random.Random(seed)
    took = [0, 0]
    for _ in range(n):
        b = bytearray(good)
        for _k in range(rng.randint(1, 3)):
            i = rng.randrange(ctr + 8) if rng.random() < 0.8 else rng.randrange(len(b))
            b[i] = rng.randrange(256)
        if rng.random() < 0.1:
            b = b[:rng.randrange(len(b))]
        b = bytes(b)
        fast = read(b)
        took[fast is not None] += 1
        if fast is None:
            continue
        ref = cborscan.scan(memoryview(b), views=True)  # must not raise: the fast reader accepted it
        assert _plain(fast.obj) == _plain(ref.obj) and fast.canonical and ref.canonical, b
        assert fast.offsets == ref.offsets
        assert acbor.dumps(_plain(fast.obj)) == b
    return took


def _topic_device_by_levels(topic: str, topic_filter: str) -> Any:
    """topic_device as it read topics before it had a pattern per filter: level by level."""
    from pansketch.host_tools.ingest.decode import valid_device

    if not isinstance(topic, str) or len(topic) > 1024:
        return None
    levels, want = topic.split("/"), topic_filter.split("/")
    if want[-1] == "#" or len(want) < 2 or len(levels) != len(want) or levels[-1] != "release" \
            or want[-1] != "release":
        return None
    if any(w != "+" and g != w for g, w in zip(levels[:-2], want[:-2])):
        return None
    if want[-2] != "+" and levels[-2] != want[-2]:
        return None
    return levels[-2] if valid_device(levels[-2]) else None


def test_topic_pattern_agrees_with_reading_level_by_level():
    """topic_device's compiled pattern gives what the level-by-level reading gives, for 28,000 random
    topics against filters with literal, ``+``, ``#``, empty and fixed-device levels (characters
    that regular expressions treat specially included), and for each filter's own matching topics."""
    import random

    from pansketch.host_tools.ingest.decode import topic_device

    rng = random.Random(25)
    alphabet = ["a", "b", "dev-1", "x.y", "_", "+", "#", "", "release", "status", "pansketch", "é", "a b",
                "(", ".*", "\\", "\n", "A" * 64, "A" * 65, "[a]"]
    filters = ["pansketch/+/release", "+/+/release", "site/+/pansketch/+/release", "a/dev-1/release",
               "a/.*/release", "(/+/release", "+/release", "pansketch/+/#", "pansketch/+/status",
               "/+/release", "a/+/release/x", "a/x y/release", "release", "pansketch/+/release/"]
    hits = 0
    for f in filters:
        for _ in range(2000):
            n = rng.randint(1, 6)
            levels = [rng.choice(alphabet) for _ in range(n)]
            if rng.random() < 0.5:  # mostly the filter's own shape, its + levels filled in
                levels = [rng.choice(alphabet) if w == "+" else w for w in f.split("/")]
            t = "/".join(levels)
            want = _topic_device_by_levels(t, f)
            assert topic_device(t, f) == want, (t, f)
            hits += want is not None
    assert hits > 1000  # the comparison covers matches, not only refusals
    assert topic_device("x" * 1020 + "/d/release", "+/+/release") is None  # over 1,024 characters
    assert topic_device(b"pansketch/d/release", "pansketch/+/release") is None  # type: ignore[arg-type]


def _verdict(payload: bytes, topic_: str, cold: bool) -> Any:
    from pansketch.host_tools.ingest import decode as dec

    if cold:
        dec._STATICS.clear()
    try:
        return ("ok", dec.decode_state(payload, topic=topic_))
    except Rejected as rej:
        return ("rejected", rej.code, rej.reason)


def test_parameters_checked_once_per_set_give_the_verdicts_of_checking_each_release_in_full():
    """decode_state checks a release's parameters once per distinct set (remembered by the template's
    encoded bytes of them) and what differs per release every time: every bad case, and the good release,
    gets the same verdict, code and reason with nothing remembered, after a good release of the same
    parameters was remembered, and a second time; and after a good release is remembered, changing any one
    parameter of it (or its key set) is checked anew: refused as in full, or (mode keep) decoded as such."""
    from pansketch.host_tools.ingest import decode as dec

    p = params()
    good = encoded(p)
    cases = [("good", good)] + [(n, pl) for n, pl, _c in bad_cases()]
    for name, payload in cases:
        cold = _verdict(payload, topic("dev-a"), cold=True)
        _verdict(good, topic("dev-a"), cold=True)  # the good release's parameters remembered
        assert dec._STATICS, "a release as devices write it is read by a template and remembered"
        assert _verdict(payload, topic("dev-a"), cold=False) == cold, name
        assert _verdict(payload, topic("dev-a"), cold=False) == cold, name  # its own parameters remembered now
    m = release_map(p)
    changed = {"v": 1, "mode": "keep", "kind": "cms", "d": 5, "w": 65, "hv": 2, "salt": "0" * 16, "clip": 2,
               "mech": "dlap" if m["mech"] != "dlap" else "gauss", "budget": [1, 100], "nint": [1, 1],
               "nout": [1, 1], "nz": 3, "L": 2, "lvl": 1, "win_s": m["win_s"] * 2, "ep_s": m["ep_s"] * 2}
    assert set(changed) == set(m) - {"dev", "seq", "elo", "ehi", "win", "part", "ctr"}  # every parameter
    for k, val in changed.items():
        bad = dumps(dict(m, **{k: val}))
        want = _verdict(bad, topic("dev-a"), cold=True)
        assert want != _verdict(good, topic("dev-a"), cold=True), k  # refused, or another release (mode keep)
        _verdict(good, topic("dev-a"), cold=True)
        assert _verdict(bad, topic("dev-a"), cold=False) == want, k
    # the same parameters under another key set (v1: no lvl) are another template: checked in full
    v1 = dumps(dict({k: v for k, v in m.items() if k != "lvl"}, v=1))
    _verdict(good, topic("dev-a"), cold=True)
    assert _verdict(v1, topic("dev-a"), cold=False) == _verdict(v1, topic("dev-a"), cold=True)


def test_remembered_parameters_are_bounded():
    """Hostile input cannot grow what decode_state remembers: 1,000 releases with distinct salts (each a
    set of parameters of its own) leave at most _STATICS_MAX entries, and each is still decoded."""
    from pansketch.host_tools.ingest import decode as dec

    dec._STATICS.clear()
    m = release_map(params())
    for i in range(1000):
        st = dec.decode_state(dumps(dict(m, salt="%016x" % i)))
        assert st[5] == "%016x" % i
        assert len(dec._STATICS) <= dec._STATICS_MAX
    assert dec._STATICS
