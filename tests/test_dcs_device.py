"""Kind dcs on the device: reading -> domain map, layout, recorder/release, CPython == MicroPython."""

from __future__ import annotations

import numpy as np
import pytest

from pansketch.agent import hashing
from pansketch.agent.dcs import DyadicSketch, exact_from, map_value, parse_reading
from pansketch.agent.params import ParamError, Params
from pansketch.agent.sketch import new_counters
from pansketch.host_tools.query.dyadic import exact_counters
from tests.support import mpvm
from tests.support import recorder_replay as R

T0 = R.T0
READINGS = ["21.5", "-3.25", "1e3", "2.5E-1", "+7", "0x1F", "10.0.0.1", "aa:bb:cc:dd:ee:ff", "AA-BB-CC-00-11-22",
            " 42 ", "nan", "inf", "", "1.2.3", "12:x", "1e999", "-0.001", 17, -5, "3.14159265358979323846"]


def test_parse_reading_exact():
    assert parse_reading("21.5") == (215, 10)
    assert parse_reading("-3.25") == (-325, 100)
    assert parse_reading("1e3") == (1000, 1)
    assert parse_reading("2.5E-1") == (25, 100)
    assert parse_reading("0x1F") == (31, 1)
    assert parse_reading("10.0.0.1") == ((10 << 24) | 1, 1)
    assert parse_reading("aa:bb:cc:dd:ee:ff") == (0xAABBCCDDEEFF, 1)
    assert parse_reading("AA-BB-CC-00-11-22") == (0xAABBCC001122, 1)
    for bad in ("nan", "inf", "", "1.2.3", "12:x", "1e999", "--1", ".", "e5", "1.5.6.7.8", "300.1.1.1"):
        assert parse_reading(bad) is None, bad
    assert parse_reading(True) is None


def test_map_scale_offset_clip():
    m = (100, 1, -40)  # centi-degrees above -40
    assert map_value("21.5", 16, m) == 6150
    assert map_value("-40", 16, m) == 0
    assert map_value("-40.005", 16, m) == 0  # below the domain: clipped
    assert map_value("-39.999", 16, m) == 0  # floor
    assert map_value("-39.99", 16, m) == 1
    assert map_value("1e6", 16, m) == 65535  # above: clipped
    assert map_value("x", 16, m) is None
    assert map_value("7.9", 3, (1, 1, 0)) == 7 and map_value("8", 3, (1, 1, 0)) == 7
    assert map_value("5", 8, (1, 3, 0)) == 1  # scale 1/3


def test_params_and_layout():
    p = Params({"device": "a", "salt": "fleet-salt-1", "kind": "dcs", "b": 16, "d": 4, "w": 1024})
    assert p.dcs_levels == 17 and p.levels == 1 and p.cells == 17 * 4 * 1024 and p.arrays == 17 and p.map == (1, 1, 0)
    assert (p.noise.num, p.noise.den) == (68, 1)  # sigma^2 = L d c^2 / (2 rho) = 17*4/1
    assert exact_from(16, 1024) == 6 and exact_from(4, 8) == 1 and exact_from(3, 8) == 0
    with pytest.raises(ParamError) as e:
        Params({"device": "a", "salt": "fleet-salt-1", "kind": "dcs", "map": [1, 0, 0]})
    assert e.value.key == "map"
    with pytest.raises(ParamError) as e:
        Params({"device": "a", "salt": "fleet-salt-1", "kind": "cs", "b": 8})
    assert e.value.key == "b"
    # the fingerprint covers b and map (a persisted state never resumes under another map)
    q = Params({"device": "a", "salt": "fleet-salt-1", "kind": "dcs", "b": 16, "d": 4, "w": 1024, "map": [2, 1, 0]})
    assert p.fingerprint() != q.fingerprint()


@pytest.mark.parametrize("b,w", [(16, 1024), (12, 64), (48, 256)])
def test_device_counters_equal_host_replay(b, w):
    rng = np.random.default_rng(b)
    vals = rng.integers(0, 1 << b, 3000, dtype=np.int64) >> rng.integers(0, b, 3000)
    wts = rng.integers(-3, 4, 3000)
    s = DyadicSketch(b, 3, w, hashing.salt_prefix("fleet-salt-1"), 2, (1, 1, 0), new_counters((b + 1) * 3 * w))
    s.update_many([str(int(v)) for v in vals], [int(x) for x in wts])
    clipped = np.clip(wts, -2, 2)
    want = exact_counters(vals, b, 3, w, "fleet-salt-1", clipped)
    assert (np.array(s.counters, dtype=np.int64).reshape(-1, w) == want).all()
    one = DyadicSketch(b, 3, w, hashing.salt_prefix("fleet-salt-1"), 2, (1, 1, 0), new_counters((b + 1) * 3 * w))
    for v, x in zip(vals[:300], wts[:300]):
        one.update(int(v), int(x))
    assert (np.array(one.counters, dtype=np.int64).reshape(-1, w)
            == exact_counters(vals[:300], b, 3, w, "fleet-salt-1", clipped[:300])).all()


CFG = {"device": "pico-7", "salt": "fleet-salt-1", "kind": "dcs", "b": 10, "map": [10, 1, -20], "d": 3, "w": 32,
       "mode": "keep", "window_s": 3600, "epoch_s": 600, "mechanism": "dgauss", "budget": "1/2"}


def _events(k):
    return [READINGS[(k * 7 + i) % len(READINGS)] for i in range(25)] + ["%d.%d" % (k % 40, i) for i in range(10)]


EVENTS = [_events(k) for k in range(R.STEPS)]


def _cpython(root):
    R.run_cpython(root, CFG, b"dcs-seed", EVENTS)


def test_release_is_v2_and_decodes(tmp_path):
    _cpython(tmp_path)
    rels = R.released(tmp_path)
    assert len(rels) == 6
    for _raw, m, r in rels:
        assert m["v"] == 2 and m["lvl"] == 0 and m["kind"] == "dcs" and m["b"] == 10 and m["map"] == [10, 1, -20]
        assert m["L"] == 11 and len(m["ctr"]) == 4 * 11 * 3 * 32
        assert r.counters().shape == (33, 32) and r.group[-2:] == (10, (10, 1, -20))
    # size is data-independent: every release of these parameters has the same length (same digit counts)
    assert len({len(raw) for raw, _m, _r in rels[1:]}) == 1


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed")
def test_recorder_identical_on_micropython(tmp_path):
    R.assert_same_on_micropython(tmp_path, CFG, b"dcs-seed", EVENTS, 6)


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed")
def test_big_domain_identical_on_micropython():
    """b = 48 (MAC addresses): node values are big ints on a 32-bit port."""
    code = """
from pansketch.agent import hashing
from pansketch.agent.dcs import DyadicSketch
from pansketch.agent.sketch import new_counters
s = DyadicSketch(48, 2, 64, hashing.salt_prefix("fleet-salt-1"), 1, (1, 1, 0), new_counters(49 * 2 * 64))
items = ["%02x:%02x:%02x:00:11:%02x" % (i % 7, i % 5, i, i % 3) for i in range(60)]
s.update_many(items)
for x in items[:10]:
    s.update(x, -1)
print("@ctr", ",".join(str(v) for v in s.counters))
"""
    got = mpvm.run(code, heap=256 * 1024).check().values()["ctr"]
    s = DyadicSketch(48, 2, 64, hashing.salt_prefix("fleet-salt-1"), 1, (1, 1, 0), new_counters(49 * 2 * 64))
    items = ["%02x:%02x:%02x:00:11:%02x" % (i % 7, i % 5, i, i % 3) for i in range(60)]
    s.update_many(items)
    for x in items[:10]:
        s.update(x, -1)
    assert got == ",".join(str(v) for v in s.counters)


def test_sources_emit_numbers_the_map_reads():
    """The Pi agent's sources hand readings to the core as text: a JSON number field of the mqtt
    source (Tasmota / Zigbee2MQTT style) and one number per stdin line."""
    import queue

    from pansketch.agent.pi.config import SourceConfig
    from pansketch.agent.pi.sources import MqttSource, Warner, parse_lines

    src = MqttSource(queue.Queue(), lambda m: None, SourceConfig(type="mqtt", topic="zigbee2mqtt/+",
                                                                 field="payload.temperature"), "c")
    m = (100, 1, -40)
    for body, want in ((b'{"temperature": 21.37, "humidity": 40}', 6137), (b'{"temperature": -5}', 3500),
                       (b'{"temperature": 1e-7}', 4000), (b'{"temperature": 1e300}', 65535),
                       (b'{"temperature": [20.5, 21]}', None)):
        items, weights = src.handle("zigbee2mqtt/kitchen", body)
        xs = [map_value(x, 16, m) for x in items]
        if want is None:
            assert xs == [6050, 6100]
        else:
            assert xs == [want], (body, items)
    items, _ = parse_lines(b"21.37\n-5\r\n  7.5 \nabc\n", Warner(lambda m: None))
    assert [map_value(x, 16, m) for x in items] == [6137, 3500, 4750, None]


def test_tree_mode_refuses_dcs_and_dbits():
    """Tree mode is implemented for cms/cs only (docs/PRIVACY.md): a tree of dcs would need
    L x (b + 1) arrays; Params refuses both kinds by name and the host rejects such a release."""
    import pytest

    from pansketch.agent.params import ParamError, Params

    base = {"device": "dev-1", "salt": "fleet-salt-1", "mode": "tree", "levels": 4}
    for extra in ({"kind": "dcs", "b": 4}, {"kind": "dbits", "d": 4, "w": 64, "mechanism": "dlap", "budget": "1"}):
        with pytest.raises(ParamError) as ei:
            Params(dict(base, **extra))
        assert ei.value.key == "kind" and "tree mode supports kinds cms and cs" in str(ei.value)
    for kind in ("cms", "cs"):
        p = Params(dict(base, kind=kind))
        assert p.levels == 4 and p.dcs_levels == 1 and p.arrays == 4 and p.cells == p.d * p.w


def test_host_rejects_a_tree_dcs_release():
    from pansketch.agent import cbor, release
    from pansketch.agent.params import Params
    from pansketch.agent.sketch import new_counters
    from pansketch.host_tools.ingest.decode import Rejected, decode

    p = Params({"device": "dev-1", "salt": "fleet-salt-1", "kind": "dcs", "b": 2, "d": 1, "w": 2})
    m = release.release_map(p, 0, 8, 9, 0, new_counters(p.cells))
    m["mode"], m["L"], m["win_s"], m["ep_s"] = "tree", 1, 3600, 3600
    m["ctr"] = bytes(m["ctr"])
    try:
        decode(cbor.dumps(m))
    except Rejected as exc:
        assert "tree mode supports kinds cms and cs" in str(exc)
    else:
        raise AssertionError("a tree-mode dcs release was accepted")
