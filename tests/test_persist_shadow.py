"""The shadow persist scheme (persist_noise = "shadow", agent/recorder.py).

The accumulator R = Z_int + events is never written; the shadow M (pure
noise) gives the flash track S = R - M. Noise comes from a
DeterministicSource, so the draws are replayed and the structure checked
exactly (docs/PRIVACY.md "Persisting without growing the noise"):

* snapshot j = events up to persist j - (G_0 + ... + G_{j-1});
* M = Z_int + G_0 + ... + G_k after k persists (no event in it);
* the release = events + Z_int + Z_out, nz = 2, however many persists;
* after a restart on snapshot k: R = S_k + Z_int', nz = k + 2.
"""

from __future__ import annotations

import math

import cbor2
import pytest

from pansketch.agent import calibrate, storage
from pansketch.agent.noise import wrap32
from pansketch.agent.params import ParamError, Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from tests.support.sketches import exact, params_with

T0 = 200_000 * 3600
HOUR = 3600


params = params_with({"device": "dev-s", "salt": "fleet-salt-1", "kind": "cs", "d": 3, "w": 16, "mode": "window",
                     "window_s": HOUR, "mechanism": "dgauss", "budget": "1/2", "persist_s": 600,
                     "persist_noise": "shadow"})


class Replay:
    """The draws a Recorder makes from DeterministicSource(seed), in order."""

    def __init__(self, seed: str) -> None:
        self.rng = Rng(DeterministicSource(seed))

    def take(self, n: int, spec) -> list[int]:
        return [spec.sample(self.rng) for _ in range(n)]


def vec(*parts: list[int], signs: tuple[int, ...] = ()) -> list[int]:
    sg = signs or (1,) * len(parts)
    return [wrap32(sum(s * p[i] for s, p in zip(sg, parts))) for i in range(len(parts[0]))]


def flash(rec: Recorder) -> tuple[list[int], int]:
    import array

    buf = array.array("i", bytes(4 * rec.p.cells))
    st = storage.read_state(rec.state_path, rec._fps[1], buf)
    assert st is not None
    return list(buf), st[4]


def the_release(root) -> dict:
    ob = storage.Outbox(str(root))
    (s,) = ob.pending()
    return cbor2.loads(ob.read(s))


def ctr(rel: dict) -> list[int]:
    return list(memoryview(rel["ctr"]).cast("i"))


def test_flash_track_and_release_structure_exactly(tmp_path):
    p = params()
    n = p.cells
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("s1")), log=lambda m: None)
    rp = Replay("s1")
    z_int = rp.take(n, p.inoise)
    gs = [rp.take(n, p.inoise)]  # G_0, drawn at open
    assert list(rec.counters) == z_int
    assert list(rec.shadow) == vec(z_int, gs[0])
    events: list[str] = []
    for j in range(1, 6):  # five persists in the hour (persist_s = 600)
        batch = ["e%d" % ((j * 7 + i) % 11) for i in range(40 + j)]
        for x in batch:
            rec.add(x)
        events += batch
        assert rec.persist(T0 + 600 * j)
        gs.append(rp.take(n, p.inoise))
        s, nz = flash(rec)
        # snapshot j = exact(events so far) - (G_0 + ... + G_{j-1}): j draws
        assert s == vec(exact(p, events), *gs[:j], signs=(1,) + (-1,) * j)
        assert nz == j
        # the shadow is pure noise: Z_int + G_0..G_j; R - M - S = -G_j (no event since the persist)
        assert list(rec.shadow) == vec(z_int, *gs)
        assert list(rec.counters) == vec(exact(p, events), z_int)
        assert not any(rec.relbuf)
    tail = ["late"] * 9
    for x in tail:
        rec.add(x)
    assert rec.tick(T0 + HOUR) == 1
    z_out = rp.take(n, p.noise)
    rel = the_release(tmp_path)
    # one internal draw (at half the budget) + Z_out, not 1 + 5 + 1 draws
    assert rel["nz"] == 2
    assert tuple(rel["nint"]) == (p.inoise.num, p.inoise.den) and tuple(rel["nout"]) == (p.noise.num, p.noise.den)
    assert ctr(rel) == vec(exact(p, events + tail), z_int, z_out)
    # the released accumulator's shadow left RAM: the next one is fresh (Z_int' + G_0')
    z2 = rp.take(n, p.inoise)
    g2 = rp.take(n, p.inoise)
    assert list(rec.counters) == z2 and list(rec.shadow) == vec(z2, g2)


def test_restart_rebuilds_from_the_flash_track(tmp_path):
    p = params()
    n = p.cells
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("s2")), log=lambda m: None)
    rp = Replay("s2")
    rp.take(n, p.inoise)  # Z_int (lost with the RAM)
    gs = [rp.take(n, p.inoise)]
    events: list[str] = []
    for j in (1, 2, 3):
        batch = ["r%d" % (i % 5) for i in range(20 * j)]
        for x in batch:
            rec.add(x)
        events += batch
        rec.persist(T0 + 600 * j)
        gs.append(rp.take(n, p.inoise))
    for x in ["lost"] * 7:  # after the last persist: lost in the power cut
        rec.add(x)
    rec2 = Recorder(p, str(tmp_path), T0 + 1900, rng=Rng(DeterministicSource("s2b")), log=lambda m: None)
    rp2 = Replay("s2b")
    z_new = rp2.take(n, p.inoise)
    g_new = rp2.take(n, p.inoise)
    s3 = vec(exact(p, events), *gs[:3], signs=(1, -1, -1, -1))
    assert rec2.resumed and rec2.nz == 4 and rec2.nzm == 4
    assert list(rec2.counters) == vec(s3, z_new)  # R = S_3 + Z_int'
    assert list(rec2.shadow) == vec(z_new, g_new)  # M = Z_int' + G'
    more = ["after"] * 5
    for x in more:
        rec2.add(x)
    rec2.persist(T0 + 2400)
    s4, nz4 = flash(rec2)
    assert s4 == vec(s3, exact(p, more), g_new, signs=(1, 1, -1)) and nz4 == 4
    rp2.take(n, p.inoise)  # the persist's G
    assert rec2.tick(T0 + HOUR) == 1
    z_out = rp2.take(n, p.noise)
    rel = the_release(tmp_path)
    # the release carries Z_int' + the three G inside S_3 + Z_out
    assert rel["nz"] == 5
    assert ctr(rel) == vec(s3, exact(p, more), z_new, z_out)


def test_failed_write_counts_as_written_and_wipes_the_draw(tmp_path, monkeypatch):
    """A write that was attempted counts as written (docs/PRIVACY.md "Failed
    writes"): M gets the fresh G exactly as after a good write (a partial S may
    be on flash), R is untouched, the scratch buffer is zero, the shadow never
    keeps S = R - M."""
    p = params()
    rec = Recorder(p, str(tmp_path), T0, rng=Rng(DeterministicSource("s3")), log=lambda m: None)
    rec.add("x")
    m0 = list(rec.shadow)
    r0 = list(rec.counters)
    replay = Rng(DeterministicSource("s3"))
    rec2 = Recorder(p, str(tmp_path / "twin"), T0, rng=replay, log=lambda m: None)
    rec2.add("x")

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "write_state", full)
    assert rec.persist(T0 + 600) is False
    assert list(rec.counters) == r0 and not any(rec.relbuf)
    monkeypatch.undo()
    assert rec2.persist(T0 + 600) is True  # the twin's good write: the same bookkeeping
    assert list(rec.shadow) == list(rec2.shadow) and list(rec.shadow) != m0
    assert rec.nzm == 2 == rec2.nzm
    assert rec.last_persist == T0 + 600  # an attempt is a persist: retried after persist_s, not every tick


def test_calibration_splits_the_budget_between_the_two_views():
    """An event sits in R (Z_int) and in one flash-track increment (one G): the two
    privacy losses add up to the budget exactly. With the refresh scale (the L factor
    of 2 dropped) they would add up to twice the budget."""
    for mech, budget, d, clip in (("dlap", "1/2", 4, 1), ("dgauss", "1/2", 4, 1), ("dgauss", "1/10", 5, 2)):
        p = params(mechanism=mech, budget=budget, d=d, clip=clip)
        b = calibrate.parse_ratio(budget)
        name, g = calibrate.guarantee(p.inoise, d, clip, 1)  # the loss of one view at sensitivity 1 array
        assert 2 * g[0] * b[1] == b[0] * g[1], (mech, g, b)
        name, g = calibrate.guarantee(p.noise, d, clip, 1)  # Z_out alone covers the release at the budget
        assert g == b
        # numerically: dlap d*c/t_int + d*c/t_int = eps; dgauss 2 * d*c^2/(2 sigma_int^2) = rho
        if mech == "dlap":
            loss = 2 * d * clip * p.inoise.den / p.inoise.num
        else:
            loss = 2 * d * clip * clip * p.inoise.den / (2 * p.inoise.num)
        assert math.isclose(loss, b[0] / b[1])


@pytest.mark.parametrize("mech,persist_s,want", [
    ("dgauss", 3600, False), ("dgauss", 1800, False), ("dgauss", 1200, True), ("dgauss", 60, True),
    ("dlap", 900, False), ("dlap", 720, True), ("dlap", 600, True)])
def test_auto_picks_the_smaller_release_variance(mech, persist_s, want):
    """shadow carries 2x (dgauss) or ~4x (dlap) one refresh draw; refresh carries 1 + p draws,
    p = ceil(3600 / persist_s) - 1 persists per hourly window."""
    p = params(persist_noise="auto", mechanism=mech, persist_s=persist_s)
    assert p.shadow is want
    assert p.inoise == (p.internal_noise(True) if want else p.noise)


def test_where_shadow_applies():
    # tree mode: only when asked for (a shadow per level doubles its L arrays)
    assert not params(persist_noise="auto", mode="tree", levels=3, epoch_s=60, window_s=240).shadow
    assert params(mode="tree", levels=3, epoch_s=60, window_s=240).shadow
    # kind dbits keeps no persisted counts
    assert not params(persist_noise="auto", kind="dbits", w=64, mechanism="dlap", budget="1").shadow
    with pytest.raises(ParamError) as e:
        params(kind="dbits", w=64, mechanism="dlap", budget="1")
    assert e.value.key == "persist_noise"
    with pytest.raises(ParamError) as e:
        params(persist_noise="sometimes")
    assert e.value.key == "persist_noise"


@pytest.mark.parametrize("first,then", [("refresh", "shadow"), ("shadow", "refresh")])
def test_changed_scheme_finishes_the_persisted_accumulator_in_its_own(tmp_path, first, then):
    """A config change of persist_noise never strands a persisted state: the accumulator
    on flash is continued and released in the scheme (and noise scale) it was written
    with; the next accumulator uses the new one."""
    p1 = params(persist_noise=first)
    rec = Recorder(p1, str(tmp_path), T0, rng=Rng(DeterministicSource("m1")), log=lambda m: None)
    for x in ["a"] * 30:
        rec.add(x)
    assert rec.persist(T0 + 600)
    p2 = params(persist_noise=then)
    logs: list[str] = []
    rec2 = Recorder(p2, str(tmp_path), T0 + 700, rng=Rng(DeterministicSource("m2")), log=logs.append)
    assert rec2.resumed and rec2.sh == (first == "shadow")
    assert any("persist_noise" in m for m in logs)
    rec2.add("b")
    assert rec2.persist(T0 + 1200)  # written in the old scheme, readable on the next boot
    assert rec2.tick(T0 + HOUR) == 1
    rel = the_release(tmp_path)
    old = p1.inoise
    assert tuple(rel["nint"]) == (old.num, old.den)
    # the state file's draw count: refresh 1 + persist + restart; shadow: G_0 + restart G
    assert rel["nz"] == (3 + 1 if first == "refresh" else 2 + 1)
    assert rec2.sh == (then == "shadow") and (rec2.shadow is not None) == (then == "shadow")


# -- tree mode: one shadow per level (agent/tree.py) ----------------------------------

def tree_params(**kw):
    cfg = {"device": "dev-t", "salt": "fleet-salt-1", "kind": "cs", "d": 4, "w": 256, "mode": "tree",
           "levels": 3, "epoch_s": 60, "mechanism": "dgauss", "budget": "1/2", "persist_s": 10,
           "persist_noise": "shadow"}
    cfg.update(kw)
    return Params(cfg)


def tree_run(root, p, seed, restart_at=None):
    """Four epochs (one tree), a persist every 10 s, 20 events per 10 s; returns
    ({(lvl, elo): (counters, nz, nint)}, events per epoch)."""
    from pansketch.agent.recorders import make

    quiet = lambda m: None  # noqa: E731
    rec = make(p, str(root), T0, rng=Rng(DeterministicSource(seed)), log=quiet)
    per_epoch: dict[int, list[str]] = {}
    for t in range(0, 240, 10):
        batch = ["i%d" % ((t * 13 + i) % 23) for i in range(20)]
        for x in batch:
            rec.add(x)
        per_epoch.setdefault(T0 // 60 + t // 60, []).extend(batch)
        rec.tick(T0 + t + 10)
        if restart_at is not None and t + 10 == restart_at:
            rec = make(p, str(root), T0 + t + 10, rng=Rng(DeterministicSource(seed + "-boot")), log=quiet)
    ob = storage.Outbox(str(root))
    out = {}
    for s in ob.pending():
        m = cbor2.loads(ob.read(s))
        out[(m["lvl"], m["elo"])] = (list(memoryview(m["ctr"]).cast("i")), m["nz"], tuple(m["nint"]))
    return out, per_epoch


@pytest.mark.slow
def test_tree_nodes_carry_one_internal_draw_however_many_persists(tmp_path):
    """24 persists inside the root: under refresh it would carry 1 + 24 + 1 draws; under
    shadow every node carries Z_int at the 2L-array scale + Z_out at L arrays: per-cell
    noise variance 2 sigma^2 + sigma^2. Dropping the factor 2 gives 2 sigma^2, refresh ~26."""
    p = tree_params()
    got, per_epoch = tree_run(tmp_path, p, "tree-a")
    e0 = T0 // 60
    assert len(got) == 4 + 2 + 1
    for (lvl, elo), (ctr, nz, nint) in got.items():
        assert nz == 2 and nint == (p.inoise.num, p.inoise.den), (lvl, elo, nz)
    root_ctr = got[(2, e0)][0]
    events = [x for e in sorted(per_epoch) for x in per_epoch[e]]
    noise = [a - b for a, b in zip(root_ctr, exact(p, events))]
    sigma2 = p.noise.num / p.noise.den
    var = sum(z * z for z in noise) / len(noise) / sigma2
    # 1024 cells: sd of the variance estimate ~ 3 * sqrt(2 / 1024) = 0.13
    assert 2.6 < var < 3.4, var


@pytest.mark.slow
def test_tree_restart_mid_node_rebuilds_each_level(tmp_path):
    p = tree_params()
    got, per_epoch = tree_run(tmp_path, p, "tree-b", restart_at=90)
    e0 = T0 // 60
    # the power cut follows tick(T0 + 90), which persisted: the snapshot of the leaf [1, 2)
    # (opened at 60) holds the G of the persists at 60, 70, 80, 90; those of [0, 2) and the
    # root (opened at T0) the 9 of 10..90
    assert len(got) == 7  # nothing released twice, nothing lost
    nz_leaf1 = got[(0, e0 + 1)][1]
    nz_l1 = got[(1, e0)][1]
    nz_root = got[(2, e0)][1]
    # a rebuilt level carries the G draws of its snapshot + Z_int' + Z_out
    assert (nz_leaf1, nz_l1, nz_root) == (4 + 2, 9 + 2, 9 + 2)
    # nodes opened after the restart are back to one internal draw
    assert got[(0, e0 + 2)][1] == 2 and got[(1, e0 + 2)][1] == 2


def test_tree_scheme_change_keeps_each_level_in_its_own_until_it_closes(tmp_path):
    from pansketch.agent.recorders import make

    quiet = lambda m: None  # noqa: E731
    p1 = tree_params(persist_noise="refresh")
    rec = make(p1, str(tmp_path), T0, rng=Rng(DeterministicSource("mig")), log=quiet)
    rec.add("x")
    assert rec.persist(T0 + 30)
    p2 = tree_params()
    rec2 = make(p2, str(tmp_path), T0 + 40, rng=Rng(DeterministicSource("mig2")), log=quiet)
    assert rec2.resumed and rec2.shs == [False, False, False]
    rec2.tick(T0 + 60)  # the leaf closes (refresh), its successor opens under shadow
    assert rec2.shs == [True, False, False]
    ob = storage.Outbox(str(tmp_path))
    (s,) = ob.pending()
    m = cbor2.loads(ob.read(s))
    assert tuple(m["nint"]) == (p1.inoise.num, p1.inoise.den)  # the refresh scale of the node it was
    assert rec2.persist(T0 + 70)
    rec3 = make(p2, str(tmp_path), T0 + 80, rng=Rng(DeterministicSource("mig3")), log=quiet)
    assert rec3.shs == [True, False, False]  # per level, from the state file
