"""Pan-privacy structure, release modes and crash safety of pansketch.agent.recorder.

Noise is drawn from a DeterministicSource, so the tests replay the exact
draws: Z_int of an accumulator is the first d*w draws after it opens, Z_out
of its release the next d*w draws. That lets us check the internal/output
split of docs/ARCHITECTURE.md "Release modes" exactly, not statistically.
"""

import math
import os

import cbor2
import pytest

from pansketch.agent import hashing, storage
from pansketch.agent.params import ParamError
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.agent.sketch import Sketch
from tests.support.sketches import exact, params_with

EP = 600
T0 = 200_000 * 3600  # a window (and epoch) boundary


params = params_with({"device": "dev-1", "salt": "fleet-salt-1", "kind": "cs", "d": 4, "w": 64,
                     "mode": "keep", "window_s": 3600, "epoch_s": EP, "mechanism": "dgauss", "budget": "1/2"})


def draws(seed, n, spec, skip=0):
    rng = Rng(DeterministicSource(seed))
    out = [spec.sample(rng) for _ in range(skip + n)]
    return out[skip:]


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


def flash_state(root, p):
    from pansketch.agent.sketch import new_counters
    c = new_counters(p.d * p.w)
    st = storage.read_state(str(root / "state.bin"), p.fingerprint(), c)
    return list(c), st


def test_persist_then_fresh_noise_masks_ram_minus_flash(tmp_path):
    """RAM - (flash copy) = events since the persist + a fresh full-scale draw."""
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("p")), log=lambda m: None)
    a_events = ["a", "b"] * 20
    for x in a_events:
        rec.add(x)
    assert rec.persist(T0 + 5)
    snap, st = flash_state(tmp_path, p)
    n = p.d * p.w
    z_int, y1 = draws("p", n, p.noise), draws("p", n, p.noise, skip=n)
    assert snap == [e + z for e, z in zip(exact(p, a_events), z_int)]  # flash = exact + Z_int
    assert st[4] == 1  # one noise draw in the snapshot
    b_events = ["c"] * 7
    for x in b_events:
        rec.add(x)
    diff = [r - f for r, f in zip(rec.counters, snap)]
    assert [d - e for d, e in zip(diff, exact(p, b_events))] == y1  # masked by Y1
    assert diff != exact(p, b_events)
    assert rec.nz == 2


def test_release_counts_its_noise_draws(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("q")), log=lambda m: None)
    events = ["a"] * 10 + ["b"] * 3
    rec.add_many(events[:5])
    rec.persist(T0 + 1)
    rec.add_many(events[5:])
    rec.persist(T0 + 2)
    rec.tick(T0 + EP)
    (_, data), = releases(tmp_path)
    r = cbor2.loads(data)
    assert r["nz"] == 4  # Z_int + 2 persist refreshes + Z_out
    n = p.d * p.w
    z = draws("q", 4 * n, p.noise)
    total = [z[i] + z[n + i] + z[2 * n + i] + z[3 * n + i] for i in range(n)]
    ctr = list(memoryview(r["ctr"]).cast("i"))
    assert [c - e for c, e in zip(ctr, exact(p, events))] == total


def test_restart_resumes_persisted_state_with_fresh_noise(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("e")), log=lambda m: None)
    for x in ["a"] * 50:
        rec.add(x)
    rec.persist(T0 + 5)
    snap, _ = flash_state(tmp_path, p)
    del rec  # power cut
    rec2 = Recorder(p, str(tmp_path), T0 + 20, rng=Rng(DeterministicSource("other")), log=lambda m: None)
    # resumed = the persisted snapshot plus one fresh draw (RAM never equals flash)
    assert [c - s_ for c, s_ in zip(rec2.counters, snap)] == draws("other", p.d * p.w, p.noise)
    assert rec2.seq == 0 and rec2.nz == 2


class FlakySource:
    """A byte source that fails while ``broken`` is set (like MemoryError on a board)."""

    def __init__(self, seed):
        self.inner = DeterministicSource(seed)
        self.broken = False

    def read(self, n):
        if self.broken:
            raise MemoryError("no memory for os.urandom")
        return self.inner.read(n)


def test_failed_noise_for_next_accumulator_never_counts_unnoised(tmp_path):
    p = params()
    src = FlakySource("r")
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(src), log=lambda m: None)
    rec.add("a")
    # let the release's Z_out succeed, then fail while drawing the next Z_int
    real_open = rec._open

    def failing_open(epoch, part):
        src.broken = True
        try:
            return real_open(epoch, part)
        finally:
            pass

    rec._open = failing_open
    assert rec.tick(T0 + EP) == 1  # the release is committed
    rec._open = real_open
    released = list(rec.counters)
    with pytest.raises(MemoryError):
        rec.add("b")  # cannot be counted without noise
    assert rec.persist(T0 + EP + 1) is False  # the released array is never persisted
    assert rec.tick(T0 + EP + 2) == 0
    assert list(rec.counters) == released
    src.broken = False
    rec.add("b")  # the pending open succeeds first
    assert rec._pending is None and rec.nz == 1
    rec.tick(T0 + 2 * EP)
    keys = [(cbor2.loads(b)["elo"], cbor2.loads(b)["ehi"], cbor2.loads(b)["part"]) for _, b in releases(tmp_path)]
    assert len(keys) == len(set(keys)) == 2


def test_clock_behind_the_last_release_never_reuses_a_key(tmp_path):
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("s")), log=lambda m: None)
    rec.tick(T0 + EP)
    rec.tick(T0 + 2 * EP)  # released epochs k0, k0+1
    del rec
    # reboot with a clock 3 epochs in the past (e.g. restored from an old save)
    rec2 = Recorder(p, str(tmp_path), T0 - 3 * EP, rng=Rng(DeterministicSource("t")), log=lambda m: None)
    rec2.add("x")
    rec2.flush(T0 - 3 * EP + 1)
    rec2.tick(T0 + 3 * EP)
    keys = [(cbor2.loads(b)["elo"], cbor2.loads(b)["ehi"], cbor2.loads(b)["part"]) for _, b in releases(tmp_path)]
    assert len(keys) == len(set(keys)) == 4


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
    Recorder(params(), str(tmp_path), T0, rng=Rng(DeterministicSource("m")), log=lambda m: None).persist()
    with pytest.raises(storage.StateError, match="different parameters"):
        Recorder(params(w=128), str(tmp_path), T0, rng=Rng(DeterministicSource("m")), log=lambda m: None)


def test_corrupt_state_is_detected(tmp_path):
    Recorder(params(), str(tmp_path), T0, rng=Rng(DeterministicSource("n")), log=lambda m: None).persist()
    path = tmp_path / "state.bin"
    data = bytearray(path.read_bytes())
    data[60] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(storage.StateError, match="checksum"):
        Recorder(params(), str(tmp_path), T0, rng=Rng(DeterministicSource("n")), log=lambda m: None)


def test_counters_wrap_mod_2_32_and_nothing_is_refused():
    """Counters live in Z/2^32 (docs/PRIVACY.md): an update past int32 wraps
    (two's complement) instead of being refused, so one event never decides
    whether a later one counts."""
    s = Sketch("cms", 2, 8, hashing.salt_prefix("salt-salt"), clip=5)
    s.update("x", 5)
    touched = [i for i in range(len(s.counters)) if s.counters[i]]
    for i in touched:
        s.counters[i] = 0x7FFFFFFF - 2
    s.update("x", 5)
    assert [s.counters[i] for i in touched] == [-0x80000000 + 2] * len(touched)
    s.update("x", -5)  # and back: the group operation is exactly invertible
    assert [s.counters[i] for i in touched] == [0x7FFFFFFF - 2] * len(touched)


@pytest.mark.parametrize(
    "cfg,key",
    [({"device": ""}, "device"), ({"d": 0}, "d"), ({"kind": "hll"}, "kind"), ({"budget": "-1"}, "budget"),
     ({"epoch_s": 7}, "epoch_s"), ({"mode": "binary"}, "mode"), ({"mode": "tree", "levels": 0}, "levels"), ({"mode": "tree", "window_s": 7200}, "window_s"), ({"salt": "short"}, "salt")],
)
def test_bad_params_name_the_key(cfg, key):
    with pytest.raises(ParamError) as ei:
        params(**cfg)
    assert ei.value.key == key


def test_half_written_first_state_is_dropped_not_adopted(tmp_path):
    """A power cut during the very first state write leaves a partial
    state.bin.new; boot must ignore it (not refuse to start)."""
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("u")), log=lambda m: None)
    rec.persist()
    whole = (tmp_path / "state.bin").read_bytes()
    (tmp_path / "state.bin").unlink()
    (tmp_path / "state.bin.new").write_bytes(whole[: len(whole) // 2])
    rec2 = Recorder(p, str(tmp_path), T0 + 1, rng=Rng(DeterministicSource("v")), log=lambda m: None)
    assert not (tmp_path / "state.bin.new").exists() and rec2.seq == 0
    # a complete .new is adopted
    rec2.persist()
    (tmp_path / "state.bin").rename(tmp_path / "state.bin.new")
    rec3 = Recorder(p, str(tmp_path), T0 + 2, rng=Rng(DeterministicSource("w")), log=lambda m: None)
    assert rec3.nz == 2  # resumed the snapshot (Z_int) + one fresh draw
