"""Tree mode in the device core (agent/tree.py): nodes, calibration, crashes, full flash."""

from __future__ import annotations

import random

import cbor2
import numpy as np
import pytest

from pansketch.agent import calibrate, storage
from pansketch.agent.recorders import make
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.agent.tree import TreeRecorder
from pansketch.host_tools.store import ledger
from pansketch.host_tools.ingest.decode import Rejected, decode
from tests.support.sketches import exact_array as exact, params_with

T0 = 200_000 * 3600  # epoch T0 // 60 is a multiple of 2**8
EP = 60
E0 = T0 // EP


params = params_with({"device": "dev-t", "salt": "fleet-salt-1", "kind": "cms", "d": 4, "w": 64, "mode": "tree",
                     "levels": 4, "epoch_s": EP, "mechanism": "dlap", "budget": "1/2", "persist_s": 86400})


def quiet(_m):
    pass


def outbox(root):
    ob = storage.Outbox(str(root))
    return [ob.read(s) for s in ob.pending()]


def events_of(epoch):
    return ["it-%d" % ((epoch * 13 + i) % 7) for i in range(epoch % 5 + 2)]


def drive(rec, epochs, start=0, persist_every=None):
    for k in range(start, epochs):
        for x in events_of(k):
            rec.add(x)
        if persist_every and k % persist_every == 1:
            rec.persist(T0 + k * EP + 30)
        rec.tick(T0 + (k + 1) * EP)


# -- structure -------------------------------------------------------------------

def test_make_gives_tree_recorder_and_levels_define_horizon():
    p = params(levels=5, epoch_s=3600)
    assert p.arrays == 5 and p.window_s == 3600 * 16
    assert isinstance(make(p, "/tmp/unused-tree-%d" % random.randrange(1 << 30), T0, rng=Rng(DeterministicSource("a")),
                           log=quiet), TreeRecorder)


def test_releases_are_the_aligned_nodes_with_their_events(tmp_path):
    """Every node of every level is released once, when it ends, with exactly
    its events (a huge budget makes the noise ~0 so the counts are visible)."""
    p = params(budget="100000")
    rec = make(p, str(tmp_path), T0, rng=Rng(DeterministicSource("nodes")), log=quiet)
    drive(rec, 19)
    rels = [cbor2.loads(b) for b in outbox(tmp_path)]
    keys = [(r["lvl"], r["elo"] - E0, r["ehi"] - E0, r["part"]) for r in rels]
    want = [(lv, a, a + (1 << lv), 0) for a in range(19) for lv in range(4)
            if (a + (1 << lv)) % (1 << lv) == 0 and a % (1 << lv) == 0 and a + (1 << lv) <= 19]
    assert sorted(keys) == sorted(want)
    assert [r["seq"] for r in rels] == list(range(len(rels)))
    for r in rels:
        assert r["v"] == 2 and r["mode"] == "tree" and r["L"] == 4 and r["nz"] == 2
        assert r["win_s"] == EP * 8 and r["win"] == r["elo"] * EP // (EP * 8)
        lo, hi = r["elo"] - E0, r["ehi"] - E0
        got = np.frombuffer(r["ctr"], dtype="<i4").astype(np.int64)
        want_c = exact(p, [x for k in range(lo, hi) for x in events_of(k)])
        assert np.abs(got - want_c).max() <= 1, (lo, hi)
        decode(outbox(tmp_path)[r["seq"]])  # the host accepts it


def test_one_hash_updates_all_levels_like_separate_sketches(tmp_path):
    p = params()
    rec = make(p, str(tmp_path), T0, rng=Rng(DeterministicSource("h")), log=quiet)
    before = [np.array(a, dtype=np.int64) for a in rec.nodes]
    items = ["a", "b", "a", "zz", 7]
    for x in items:
        rec.add(x)
    rec.add_many(["q", "a"], [1, -1])
    want = exact(p, items + ["q"]) - exact(p, ["a"])
    for a, b in zip(rec.nodes, before):
        assert np.array_equal(np.array(a, dtype=np.int64) - b, want)


# -- calibration: the L factor -----------------------------------------------------

@pytest.mark.parametrize("mech,budget", [("dlap", "1/2"), ("dgauss", "1/4")])
@pytest.mark.parametrize("levels", [2, 5, 12])
def test_noise_is_calibrated_for_L_arrays(mech, budget, levels):
    """One event moves L*d cells: Delta1 = L*d*c, Delta2^2 = L*d*c^2. Fails if L is dropped."""
    p = params(levels=levels, mechanism=mech, budget=budget, clip=2)
    one = calibrate.noise_for(mech, budget, p.d, 2, 1)
    if mech == "dlap":  # scale t = L*d*c/eps
        assert (p.noise.num * one.den) == levels * one.num * p.noise.den
        assert p.noise.num / p.noise.den == levels * 4 * 2 * 2
    else:  # sigma^2 = L*d*c^2/(2 rho)
        assert p.noise.num / p.noise.den == levels * 4 * 4 / (2 * 0.25)
    # the guarantee over the L nodes holding an event is the configured budget
    assert calibrate.guarantee(p.noise, p.d, p.clip, p.arrays)[1] == calibrate.parse_ratio(budget)


def test_host_refuses_a_tree_release_calibrated_without_L(tmp_path):
    p = params(levels=4)
    rec = make(p, str(tmp_path), T0, rng=Rng(DeterministicSource("cal")), log=quiet)
    drive(rec, 2)
    m = cbor2.loads(outbox(tmp_path)[0])
    one = calibrate.noise_for("dlap", "1/2", p.d, 1, 1)
    from pansketch.agent import cbor
    forged = dict(m, nint=[one.num, one.den], nout=[one.num, one.den])
    with pytest.raises(Rejected) as ei:
        decode(cbor.dumps(forged))
    assert ei.value.code == "noise"
    forged = dict(m, L=1, win_s=EP)  # claims to touch one array
    with pytest.raises(Rejected) as ei:
        decode(cbor.dumps(forged))
    assert ei.value.code in ("noise", "schema")


def test_ledger_counts_a_tree_once_per_event_not_per_node(tmp_path):
    from pansketch.host_tools.store.sqlite import Store

    p = params(levels=3, budget="1/2")
    rec = make(p, str(tmp_path / "dev"), T0, rng=Rng(DeterministicSource("led")), log=quiet)
    drive(rec, 8)
    st = Store(str(tmp_path / "db.sqlite"))
    for b in outbox(tmp_path / "dev"):
        assert st.insert(decode(b)) == "stored"
    led = ledger.build(st.releases())
    assert len(led.windows) == 2  # two trees of 4 epochs (horizon 2^(L-1))
    for e in led.windows:
        assert e.releases == 7 and e.missing == []
        assert e.guarantee.eps == 0.5  # L nodes per event at eps/L each: eps per tree, not 7 x or L x
    assert led.device("dev-t").eps == 0.5


# -- crashes -------------------------------------------------------------------------

class PowerCut(BaseException):
    pass


@pytest.mark.slow
def test_power_cuts_mid_node_never_release_twice_or_redraw(tmp_path, monkeypatch):
    """Power cuts at random file writes (state, release .tmp, marker, rename):
    after every restart, each node key is released at most once, and the
    released bytes for a key never change (no noise re-drawn for it)."""
    p = params(levels=4, persist_s=EP // 2)
    rnd = random.Random(7)
    real_write, real_rename = storage.write_atomic, storage.rename
    seen: dict[tuple, bytes] = {}
    cuts = 0
    for trial in range(6):
        root = tmp_path / ("t%d" % trial)
        now = T0
        budget = [rnd.randrange(5, 60)]

        def maybe_cut():
            budget[0] -= 1
            if budget[0] == 0:
                raise PowerCut()

        def write(path, chunks):
            maybe_cut()
            return real_write(path, chunks)

        def rename(a, b):
            maybe_cut()
            return real_rename(a, b)

        monkeypatch.setattr(storage, "write_atomic", write)
        monkeypatch.setattr(storage, "rename", rename)
        boots = 0
        while now < T0 + 40 * EP:
            try:
                rec = make(p, str(root), now, rng=Rng(DeterministicSource("pc-%d-%d" % (trial, boots))), log=quiet)
                boots += 1
                while now < T0 + 40 * EP:
                    for x in events_of(now // EP):
                        rec.add(x)
                    now += EP // 3
                    rec.tick(now)
            except PowerCut:
                cuts += 1
                budget[0] = rnd.randrange(5, 60)
                now += rnd.randrange(0, 2 * EP)
        monkeypatch.setattr(storage, "write_atomic", real_write)
        monkeypatch.setattr(storage, "rename", real_rename)
        make(p, str(root), now, rng=Rng(DeterministicSource("pc-final-%d" % trial)), log=quiet)  # boot after the last cut
        keys = []
        for b in outbox(root):
            r = decode(b)
            keys.append(r.key)
            assert r.ehi - r.elo == 1 << r.lvl and r.elo % (1 << r.lvl) == 0
            k = (trial,) + r.key
            assert seen.setdefault(k, b) == b
        assert len(keys) == len(set(keys)), "a node was released twice"
        assert not list((root / "outbox").glob("*.tmp"))
    assert cuts >= 10


def test_restart_mid_node_resumes_every_level_with_a_fresh_draw(tmp_path):
    p = params(levels=3)
    rec = make(p, str(tmp_path), T0, rng=Rng(DeterministicSource("r1")), log=quiet)
    drive(rec, 1)  # leaf 0 released
    rec.add("x")
    assert rec.persist(T0 + EP + 5)
    flash_nz = list(rec.nzs)
    rec2 = make(p, str(tmp_path), T0 + EP + 20, rng=Rng(DeterministicSource("r2")), log=quiet)
    assert rec2.resumed and rec2.lo == [E0 + 1, E0, E0] and rec2.seq == 1
    assert rec2.nzs == flash_nz  # the flash copy's draws (the RAM draw after the write is lost) + one at boot
    rec2.tick(T0 + 2 * EP)
    rels = [decode(b) for b in outbox(tmp_path)]
    assert [(r.lvl, r.elo - E0) for r in rels] == [(0, 0), (0, 1), (1, 0)]
    # Z_int + boot draw + Z_out (the persist's RAM draw died with the power cut)
    assert [r.nz for r in rels] == [2, 3, 3]


def test_released_node_in_state_is_not_resumed(tmp_path, monkeypatch):
    """Crash after the release of the leaf is committed but before any persist:
    the state file still holds the leaf; the marker says it was released."""
    p = params(levels=2)
    rec = make(p, str(tmp_path), T0, rng=Rng(DeterministicSource("m1")), log=quiet)
    rec.add("a")
    rec.persist(T0 + 1)
    rec.add("b")
    assert rec.tick(T0 + EP) == 1  # leaf [0,1) released; [0,2) goes on
    rec2 = make(p, str(tmp_path), T0 + EP + 1, rng=Rng(DeterministicSource("m2")), log=quiet)
    assert rec2.lo == [E0 + 1, E0] and rec2.parts == [0, 0] and rec2.seq == 1
    assert rec2.nzs[0] == 1  # a fresh leaf, not the released one resumed
    rec2.tick(T0 + 2 * EP)
    keys = [decode(b).key for b in outbox(tmp_path)]
    assert len(keys) == len(set(keys)) == 3


# -- full flash -------------------------------------------------------------------------

def test_failed_release_keeps_the_node_and_retries_without_growing(tmp_path, monkeypatch):
    p = params(levels=3, budget="100000")
    rec = make(p, str(tmp_path), T0, rng=Rng(DeterministicSource("full")), log=quiet)
    real = storage.write_atomic

    def full(path, chunks):
        if path.endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real(path, chunks)

    drive(rec, 1)
    monkeypatch.setattr(storage, "write_atomic", full)
    for x in ["late"] * 3:
        rec.add(x)
    assert rec.tick(T0 + 2 * EP) == 0  # leaf [1,2) and [0,2) cannot be written
    assert rec.status[0] == 1 and rec.status[1] == 1 and rec.lo[0] == E0 + 1
    rec.add("lost-for-levels-0-1")  # only the root counts it
    assert rec.tick(T0 + 2 * EP + 10) == 0
    monkeypatch.setattr(storage, "write_atomic", real)
    assert rec.tick(T0 + 2 * EP + 20) == 2  # retried: the same nodes, same ranges
    drive(rec, 4, start=2)
    rels = [decode(b) for b in outbox(tmp_path)]
    assert [(r.lvl, r.elo - E0, r.ehi - E0) for r in rels] == [
        (0, 0, 1), (0, 1, 2), (1, 0, 2), (0, 2, 3), (0, 3, 4), (1, 2, 4), (2, 0, 4)]
    c = {(r.lvl, r.elo - E0): r.counters().astype(np.int64).ravel() for r in rels}
    late = exact(p, ["late"] * 3)
    assert np.abs(c[(0, 1)] - exact(p, events_of(1)) - exact(p, ["late"] * 3)).max() <= 1
    # the root holds the event that levels 0 and 1 missed while their release waited
    root_want = exact(p, [x for k in range(4) for x in events_of(k)] + ["late"] * 3 + ["lost-for-levels-0-1"])
    assert np.abs(c[(2, 0)] - root_want).max() <= 1
    assert late.any()


def test_daemon_batch_path_updates_every_level(tmp_path):
    """agent/pi/batch.py (the Pi daemon's numpy path) adds a chunk to all L open accumulators."""
    from pansketch.agent.pi.batch import add_batch

    p = params(kind="cs")
    items = ["it-%d" % (i % 300) for i in range(2000)] + [5, b"x"]
    weights = [(-1) ** i for i in range(len(items))]
    a = make(p, str(tmp_path / "a"), T0, rng=Rng(DeterministicSource("b")), log=quiet)
    b = make(p, str(tmp_path / "b"), T0, rng=Rng(DeterministicSource("b")), log=quiet)
    a.add_many(items, weights, adder=add_batch)
    b.add_many(items, weights)
    for x, y in zip(a.nodes, b.nodes):
        assert x.tobytes() == y.tobytes()
    assert not a.relbuf.tobytes().strip(b"\0")


@pytest.mark.slow
def test_marker_stays_small_and_flush_parts_survive_a_restart_without_state(tmp_path):
    """The marker is rewritten at every release: it keeps at most 2L + 1 lines
    however long the device runs without persisting; and after a flush and a
    restart with no state file, the next parts do not reuse released keys."""
    p = params(levels=4)
    rec = make(p, str(tmp_path), T0, rng=Rng(DeterministicSource("mk")), log=quiet)
    drive(rec, 200)
    lines = storage.read_markers(rec.marker_path)
    assert len(lines) <= 2 * 4 + 1 and lines[-1][0] == rec.seq - 1
    rec.add("x")
    assert rec.flush(T0 + 200 * EP + 5) == 4  # all four open nodes, part 0
    storage.remove(rec.state_path)
    rec2 = make(p, str(tmp_path), T0 + 200 * EP + 9, rng=Rng(DeterministicSource("mk2")), log=quiet)
    assert rec2.parts == [1, 1, 1, 1] and not rec2.resumed
    rec2.add("y")
    rec2.tick(T0 + 208 * EP)
    keys = [decode(b).key for b in outbox(tmp_path)]
    assert len(keys) == len(set(keys))
