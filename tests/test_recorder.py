"""Pan-privacy structure, release modes and crash safety of agent.recorder.

Noise is drawn from a DeterministicSource, so the tests replay the exact
draws: Z_int of an accumulator is the first d*w draws after it opens, Z_out
of its release the next d*w draws. That lets us check the internal/output
split of DESIGN.md exactly, not statistically.
"""

import math
import os

import cbor2
import pytest

from agent import hashing, storage
from agent.noise import NoiseSpec
from agent.params import Params, ParamError
from agent.recorder import Recorder
from agent.rng import DeterministicSource, Rng
from agent.sketch import Sketch

EP = 600
T0 = 200_000 * 3600  # a window (and epoch) boundary


def params(**kw):
    cfg = {"device": "dev-1", "salt": "fleet-salt-1", "kind": "cs", "d": 4, "w": 64,
           "mode": "keep", "window_s": 3600, "epoch_s": EP, "mechanism": "dgauss", "budget": "1/2"}
    cfg.update(kw)
    return Params(cfg)


def draws(seed, n, spec, skip=0):
    rng = Rng(DeterministicSource(seed))
    out = [spec.sample(rng) for _ in range(skip + n)]
    return out[skip:]


def exact(p, events):
    s = Sketch(p.kind, p.d, p.w, hashing.salt_prefix(p.salt), p.clip)
    for x in events:
        s.update(x)
    return list(s.counters)


def releases(root):
    ob = storage.Outbox(str(root))
    return [(s, ob.read(s)) for s in ob.pending()]


def test_state_is_exact_counts_plus_internal_noise(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("a")), log=lambda m: None)
    events = ["x%d" % (i % 7) for i in range(500)]
    for x in events:
        rec.add(x)
    n = p.d * p.w
    z_int = draws("a", n, p.noise)
    assert [a - b for a, b in zip(rec.counters, exact(p, events))] == z_int
    assert any(z_int)  # the noise is really there


def test_release_minus_earlier_state_is_later_counts_plus_output_noise(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("b")), log=lambda m: None)
    before = ["a", "b", "a"] * 30
    after = ["c", "a", "d"] * 40
    for x in before:
        rec.add(x)
    snapshot = list(rec.counters)  # what an intruder reads now
    for x in after:
        rec.add(x)
    assert rec.tick(T0 + EP) == 1
    (seq, data), = releases(tmp_path)
    rel = cbor2.loads(data)
    ctr = list(memoryview(rel["ctr"]).cast("i"))
    n = p.d * p.w
    z_out = draws("b", n, p.noise, skip=n)
    diff = [r - s for r, s in zip(ctr, snapshot)]
    assert [a - b for a, b in zip(diff, exact(p, after))] == z_out
    # and without the output noise the difference would reveal `after` exactly
    assert diff != exact(p, after)


@pytest.mark.parametrize("mech,budget", [("dgauss", "1/2"), ("dlap", "1")])
def test_noise_spread_matches_calibration(tmp_path, mech, budget):
    """Var(release - state) equals the calibrated noise variance (2x wrong fails)."""
    p = params(mechanism=mech, budget=budget, w=2048)
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("c" + mech)), log=lambda m: None)
    state = list(rec.counters)
    rec.tick(T0 + EP)
    (_, data), = releases(tmp_path)
    z = [a - b for a, b in zip(memoryview(cbor2.loads(data)["ctr"]).cast("i"), state)]
    n = len(z)
    if mech == "dgauss":
        s2 = p.noise.num / p.noise.den
        var = sum(k * k * math.exp(-k * k / (2 * s2)) for k in range(-300, 301)) / sum(
            math.exp(-k * k / (2 * s2)) for k in range(-300, 301))
    else:
        q = math.exp(-p.noise.den / p.noise.num)
        var = 2 * q / (1 - q) ** 2
    emp = sum(x * x for x in z) / n
    # relative standard error of a variance estimate is about sqrt((kurtosis-1)/n) <= sqrt(5/n)
    assert abs(emp / var - 1) < 4.5 * math.sqrt(5 / n)


def test_keep_mode_releases_each_epoch_once_and_clock_aligned(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0 + 10, rng=Rng(DeterministicSource("d")), log=lambda m: None)
    for k in range(5):
        for i in range(10):
            rec.add("e%d" % i)
            assert rec.tick(T0 + k * EP + 10 + i) == 0  # inside the epoch: no release
        assert rec.tick(T0 + (k + 1) * EP) == 1  # boundary: one release
    rels = [cbor2.loads(b) for _, b in releases(tmp_path)]
    assert [r["seq"] for r in rels] == [0, 1, 2, 3, 4]
    assert [(r["elo"], r["ehi"]) for r in rels] == [(T0 // EP + k, T0 // EP + k + 1) for k in range(5)]
    assert {r["win"] for r in rels} == {T0 // 3600}
    assert len({len(b) for _, b in releases(tmp_path)}) == 1


def test_release_size_does_not_depend_on_data(tmp_path):
    sizes = []
    for i, events in enumerate([[], ["a"] * 1000, ["x%d" % j for j in range(3000)]]):
        root = tmp_path / str(i)
        rec = Recorder(params(), str(root), T0, rng=Rng(DeterministicSource("s%d" % i)), log=lambda m: None)
        rec.add_many(events)
        rec.tick(T0 + EP)
        sizes += [len(b) for _, b in releases(root)]
    assert len(set(sizes)) == 1


def test_restart_resumes_persisted_state_and_never_redraws(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("e")), log=lambda m: None)
    for x in ["a"] * 50:
        rec.add(x)
    rec.persist(T0 + 5)
    persisted = list(rec.counters)
    del rec  # power cut
    # The restarted device gets *different* randomness: resuming must not draw.
    rec2 = Recorder(p, str(tmp_path), T0 + 20, rng=Rng(DeterministicSource("other")), log=lambda m: None)
    assert list(rec2.counters) == persisted
    assert rec2.seq == 0


@pytest.mark.parametrize("crash_at", ["marker", "rename"])
def test_crash_during_commit_never_double_releases(tmp_path, monkeypatch, crash_at):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("f")), log=lambda m: None)
    rec.add("a")
    rec.persist(T0 + 1)

    class PowerCut(BaseException):
        pass

    real_marker, real_rename = storage.write_marker, storage.rename

    def bad_marker(*a):
        raise PowerCut()

    def bad_rename(src, dst):
        if src.endswith(".tmp"):
            raise PowerCut()
        return real_rename(src, dst)

    if crash_at == "marker":
        monkeypatch.setattr(storage, "write_marker", bad_marker)
    else:
        monkeypatch.setattr(storage, "rename", bad_rename)
    with pytest.raises(PowerCut):
        rec.tick(T0 + EP)
    monkeypatch.setattr(storage, "write_marker", real_marker)
    monkeypatch.setattr(storage, "rename", real_rename)
    tmp_files = sorted(os.listdir(tmp_path / "outbox"))
    assert tmp_files == ["0000000000.tmp"]
    crashed_bytes = (tmp_path / "outbox" / "0000000000.tmp").read_bytes()

    rec2 = Recorder(p, str(tmp_path), T0 + EP + 1, rng=Rng(DeterministicSource("g")), log=lambda m: None)
    rec2.tick(T0 + EP + 2)
    rec2.tick(T0 + 2 * EP)
    rels = releases(tmp_path)
    keys = [(cbor2.loads(b)["elo"], cbor2.loads(b)["part"]) for _, b in rels]
    assert len(keys) == len(set(keys))  # one release per (epoch, part)
    first = dict(rels)[0]
    if crash_at == "rename":
        # the marker was written: the committed bytes are sent, byte for byte
        assert first == crashed_bytes
    else:
        # nothing was committed: the state is released afresh (those bytes never left)
        assert cbor2.loads(first)["elo"] == T0 // EP


def test_outbox_survives_restart_byte_for_byte(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("h")), log=lambda m: None)
    rec.add("z")
    rec.tick(T0 + EP)
    before = releases(tmp_path)
    rec2 = Recorder(p, str(tmp_path), T0 + EP + 3, rng=Rng(DeterministicSource("i")), log=lambda m: None)
    assert releases(tmp_path) == before
    assert rec2.seq == 1


def test_flush_releases_early_and_continues_with_next_part(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0 + 5, rng=Rng(DeterministicSource("j")), log=lambda m: None)
    rec.add("a")
    assert rec.flush(T0 + 6)
    assert rec.part == 1 and rec.elo == T0 // EP
    rec2 = Recorder(p, str(tmp_path), T0 + 7, rng=Rng(DeterministicSource("k")), log=lambda m: None)
    rec2.add("b")
    rec2.flush(T0 + 8)
    parts = [(cbor2.loads(b)["elo"], cbor2.loads(b)["part"]) for _, b in releases(tmp_path)]
    assert parts == [(T0 // EP, 0), (T0 // EP, 1)]


def test_full_flash_keeps_counting_and_extends_the_range(tmp_path, monkeypatch):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("l")), log=lambda m: None)
    real = storage.write_atomic

    def full(path, chunks):
        if "outbox" in path:
            raise OSError(28, "No space left on device")
        return real(path, chunks)

    monkeypatch.setattr(storage, "write_atomic", full)
    rec.add("a")
    assert rec.tick(T0 + EP) == 0
    assert (rec.elo, rec.ehi) == (T0 // EP, T0 // EP + 2)
    rec.add("a")
    monkeypatch.setattr(storage, "write_atomic", real)
    assert rec.tick(T0 + 2 * EP) == 1
    (_, data), = releases(tmp_path)
    r = cbor2.loads(data)
    assert (r["elo"], r["ehi"]) == (T0 // EP, T0 // EP + 2)
    assert os.listdir(tmp_path / "outbox") == ["0000000000.cbor"]


def test_changed_parameters_refuse_the_old_state(tmp_path):
    Recorder(params(), str(tmp_path), T0, rng=Rng(DeterministicSource("m")), log=lambda m: None)
    with pytest.raises(storage.StateError, match="different parameters"):
        Recorder(params(w=128), str(tmp_path), T0, rng=Rng(DeterministicSource("m")), log=lambda m: None)


def test_corrupt_state_is_detected(tmp_path):
    Recorder(params(), str(tmp_path), T0, rng=Rng(DeterministicSource("n")), log=lambda m: None)
    path = tmp_path / "state.bin"
    data = bytearray(path.read_bytes())
    data[60] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(storage.StateError, match="checksum"):
        Recorder(params(), str(tmp_path), T0, rng=Rng(DeterministicSource("n")), log=lambda m: None)


def test_overflow_is_reported_not_wrapped():
    s = Sketch("cms", 2, 8, hashing.salt_prefix("salt-salt"), clip=5)
    s.update("x", 5)
    for i in range(len(s.counters)):
        if s.counters[i]:
            s.counters[i] = 0x7FFFFFFF - 2
    before = list(s.counters)
    with pytest.raises(OverflowError):
        s.update("x", 5)
    assert list(s.counters) == before


@pytest.mark.parametrize(
    "cfg,key",
    [({"device": ""}, "device"), ({"d": 0}, "d"), ({"kind": "hll"}, "kind"), ({"budget": "-1"}, "budget"),
     ({"epoch_s": 7}, "epoch_s"), ({"mode": "tree"}, "mode"), ({"salt": "short"}, "salt")],
)
def test_bad_params_name_the_key(cfg, key):
    with pytest.raises(ParamError) as ei:
        params(**cfg)
    assert ei.value.key == key
