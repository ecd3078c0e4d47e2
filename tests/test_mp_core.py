"""The device core inside a real MicroPython VM (WebAssembly port under node).

* hash columns/signs and noise draws are bit-identical to CPython;
* a keep-mode CountSketch (d=4, w=1024) processes 10,000 events into
  releases with the live heap under 128 KiB, and its outbox and state files
  are byte-identical to the same run on CPython;
* the counter update allocates nothing; the full per-event path allocates
  only the hash's transient objects (a constant, reported).
"""

from __future__ import annotations

import json

import pytest

from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.agent import hashing
from pansketch.agent.noise import NoiseSpec
from tests.support import mpvm

pytestmark = pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")

HEAP = 128 * 1024
T0 = 200_000 * 3600
CFG = {"device": "pico-7", "salt": "fleet-salt-1", "kind": "cs", "d": 4, "w": 1024,
       "mode": "keep", "window_s": 3600, "epoch_s": 600, "mechanism": "dgauss", "budget": "1/2"}
ITEMS = ["item-%04d" % (i * 7919 % 200) for i in range(10_000)]  # 200 distinct, ~9 bytes
CHUNK = 500
MIXED = ["abc", "é-ü", "", b"\x00\xff", b"", 0, -1, 2**40, -(2**70) + 3, "x" * 40]


def test_hashing_and_noise_identical_on_both_vms():
    code = """
from pansketch.agent import hashing
from pansketch.agent.noise import NoiseSpec
from pansketch.agent.rng import Rng, DeterministicSource
items = %r
for d in (4, 9):
    p = hashing.salt_prefix("fleet-salt-1")
    print("@cols%%d %%r" %% (d, [hashing.columns(p, x, d, 1000) for x in items]))
rng = Rng(DeterministicSource(b"seed"))
for mech, n, m in (("dlap", 1, 2), ("dlap", 8, 1), ("dgauss", 4, 1), ("dgauss", 1000, 7)):
    s = NoiseSpec(mech, n, m)
    print("@%%s-%%d-%%d %%r" %% (mech, n, m, [s.sample(rng) for _ in range(200)]))
""" % (MIXED,)
    r = mpvm.run(code, heap=HEAP).check()
    got = r.values()
    for d in (4, 9):
        p = hashing.salt_prefix("fleet-salt-1")
        assert got["cols%d" % d] == repr([hashing.columns(p, x, d, 1000) for x in MIXED])
    rng = Rng(DeterministicSource(b"seed"))
    for mech, n, m in (("dlap", 1, 2), ("dlap", 8, 1), ("dgauss", 4, 1), ("dgauss", 1000, 7)):
        s = NoiseSpec(mech, n, m)
        assert got["%s-%d-%d" % (mech, n, m)] == repr([s.sample(rng) for _ in range(200)])


def _cpython_run(root):
    rec = Recorder(Params(CFG), str(root), T0, rng=Rng(DeterministicSource(b"dev-seed")), log=lambda m: None)
    for k in range(len(ITEMS) // CHUNK):
        for x in ITEMS[k * CHUNK:(k + 1) * CHUNK]:
            rec.add(x)
        rec.tick(T0 + k * 180)
    rec.tick(T0 + 3600)


def test_keep_mode_10k_events_in_128k_heap_identical_to_cpython(tmp_path):
    setup = """
import gc
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import Rng, DeterministicSource
CFG = %r
NAMES = ["item-%%04d" %% j for j in range(200)]
rec = Recorder(Params(CFG), "/flash/dev", %d, rng=Rng(DeterministicSource(b"dev-seed")), log=lambda m: None)
def step(k):
    for i in range(k * %d, (k + 1) * %d):
        rec.add(NAMES[i * 7919 %% 200])
    rec.tick(%d + k * 180)
""" % (CFG, T0, CHUNK, CHUNK, T0)
    steps = [setup] + ["step(%d)" % k for k in range(len(ITEMS) // CHUNK)] + ["rec.tick(%d)" % (T0 + 3600)]
    mp_root = tmp_path / "mp"
    r = mpvm.run(steps, heap=HEAP, flash=mp_root).check()
    assert r.peak_live <= HEAP, "live heap %d exceeds 128 KiB" % r.peak_live
    cp_root = tmp_path / "cp"
    _cpython_run(cp_root)
    mp_files = sorted(p.relative_to(mp_root / "dev") for p in (mp_root / "dev").rglob("*") if p.is_file())
    cp_files = sorted(p.relative_to(cp_root) for p in cp_root.rglob("*") if p.is_file())
    assert mp_files == cp_files
    outbox = [f for f in cp_files if str(f).startswith("outbox/")]
    assert len(outbox) == 6  # one release per 10-minute epoch of the hour
    for f in cp_files:
        assert (mp_root / "dev" / f).read_bytes() == (cp_root / f).read_bytes(), f
    (tmp_path / "heap.json").write_text(json.dumps({"peak_live": r.peak_live, "live": r.live}))


def test_counter_update_allocates_nothing_and_hashing_a_constant():
    code = """
import gc
from pansketch.agent.sketch import Sketch
from pansketch.agent import hashing
s = Sketch("cs", 4, 1024, hashing.salt_prefix("fleet-salt-1"))
stream = hashing.digest(s.prefix, "warm-up", 4)
items = ["item-%04d" % i for i in range(200)]
def upd(n):
    a = gc.mem_alloc()
    for i in range(n):
        s.add_stream(stream, 1)
    return gc.mem_alloc() - a
def full(n):
    a = gc.mem_alloc()
    for i in range(n):
        s.update(items[i % 200])
    return gc.mem_alloc() - a
upd(10); full(10)
print("@upd", upd(1000))
print("@full", full(1000))
"""
    r = mpvm.run(code, heap=HEAP).check()
    v = r.values()
    assert int(v["upd"]) == 0
    per_event = int(v["full"]) / 1000
    assert 0 < per_event < 512  # sha256 object + digest + canonical bytes, nothing that grows


def test_noise_samplers_allocate_nothing_beyond_the_byte_source():
    """With a byte source that hands out preallocated buffers, a discrete
    Gaussian/Laplace draw allocates (almost) nothing: all noise-path garbage
    on a board is the source's own (os.urandom: one bytes object per read of
    Rng.CHUNK bytes, copied into the Rng's preallocated buffer)."""
    code = """
import gc
from pansketch.agent.rng import Rng, DeterministicSource
from pansketch.agent import noise
ds = DeterministicSource(b"pool")
POOL = [ds.read(Rng.CHUNK) for i in range(64)]
class Pooled:
    i = 0
    def read(self, n):
        self.i = (self.i + 1) % 64
        return POOL[self.i]
rng = Rng(Pooled())
def meas(f, n=300):
    a = gc.mem_alloc()
    for i in range(n):
        f()
    return (gc.mem_alloc() - a) / n
meas(lambda: noise.discrete_gaussian(rng, 4, 1), 5)
print("@dg", meas(lambda: noise.discrete_gaussian(rng, 4, 1)))
print("@dl", meas(lambda: noise.discrete_laplace(rng, 8, 1)))
"""
    v = mpvm.run(code, heap=HEAP).check().values()
    assert float(v["dg"]) < 2 and float(v["dl"]) < 2


def test_counters_wrap_identically_on_micropython():
    """Past int32 a counter wraps mod 2^32, explicitly, with the same result
    as CPython (tests/test_recorder.py); nothing raises."""
    code = """
from pansketch.agent.sketch import Sketch
from pansketch.agent import hashing
s = Sketch("cs", 2, 8, hashing.salt_prefix("salt-salt"), clip=5)
s.update("x", 5)
t = [i for i in range(len(s.counters)) if s.counters[i]]
for i in t:
    s.counters[i] = 0x7FFFFFFF - 2 if s.counters[i] > 0 else -0x80000000 + 2
s.update("x", 5)
print("@result", [s.counters[i] for i in t])
"""
    from pansketch.agent import hashing
    from pansketch.agent.sketch import Sketch

    s = Sketch("cs", 2, 8, hashing.salt_prefix("salt-salt"), clip=5)
    s.update("x", 5)
    t = [i for i in range(len(s.counters)) if s.counters[i]]
    up = [s.counters[i] > 0 for i in t]
    for i in t:
        s.counters[i] = 0x7FFFFFFF - 2 if s.counters[i] > 0 else -0x80000000 + 2
    s.update("x", 5)
    want = [s.counters[i] for i in t]
    # +5 past the top lands at the bottom and -5 past the bottom at the top
    assert want == [-0x80000000 + 2 if u else 0x7FFFFFFF - 2 for u in up]
    assert mpvm.run(code, heap=HEAP).check().values()["result"] == str(want)


def test_text_shortcut_equals_hash_version_1_on_both_vms():
    """Sketch.update's shortcut for text items (kept prefix hash state on
    CPython, str hashed directly on MicroPython) gives the counters of the
    reference path add_stream(hashing.digest(...)), for d <= 8 (shortcut)
    and d > 8 (two blocks: reference path), on CPython and in the VM."""
    items = ["a", "ü-münchen", "日本語", "", "x" * 300, "device-000000042"]
    code = """
from pansketch.agent.sketch import Sketch
from pansketch.agent import hashing
out = []
for kind, d in (("cs", 4), ("cms", 8), ("cs", 9)):
    s = Sketch(kind, d, 32, hashing.salt_prefix("salt-salt"), clip=3)
    for x in %r:
        s.update(x, 2)
    out.append(list(s.counters))
print("@c", out)
""" % (items,)
    from pansketch.agent import hashing
    from pansketch.agent.sketch import Sketch

    want = []
    for kind, d in (("cs", 4), ("cms", 8), ("cs", 9)):
        fast = Sketch(kind, d, 32, hashing.salt_prefix("salt-salt"), clip=3)
        ref = Sketch(kind, d, 32, hashing.salt_prefix("salt-salt"), clip=3)
        for x in items:
            fast.update(x, 2)
            ref.add_stream(hashing.digest(ref.prefix, x, d), 2)
        assert list(fast.counters) == list(ref.counters)
        want.append(list(ref.counters))
    assert mpvm.run(code, heap=HEAP).check().values()["c"] == str(want)
