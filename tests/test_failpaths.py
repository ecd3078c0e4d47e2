"""Pan-privacy on every failure path: a write that was attempted counts as written.

The device core (agent/) runs a fixed schedule of adds, persists, releases
and a flush under the keep-every-byte flash model of
tests/support/failpaths_scenario.py, once per failure stage (every stage of every
state, release and marker write, and the renames), with ENOSPC/EIO and with
MemoryError. Each run is made twice on the same seed and the same failure:
with events (A) and without (B). Noise is injected (wide uniform draws from
the replayed Rng), so in every array the intruder can read -- RAM at the
end of each operation, every flash write so far (partial ones and files
removed later included), every published release -- B is the noise part
and A - B the exact event part.

**Exact check.** An intrusion after operation k recovers events by a linear
combination iff some combination c of its views has c . noise = 0 and
c . events != 0. Per group of cells with the same views (a partial write
covers a prefix), the left null space of the noise matrix (views x cells,
more cells than views, noise 21 bits wide) is computed exactly mod the prime
2^31 - 1; any null vector that does not annihilate the event part is a
leak. This is stronger than a statistical test: it finds every linear
recovery, not only the ±1 combinations of a few arrays.

Kind dbits keeps no additive noise (its state is randomized-response bits);
its check is that after a failed commit nothing later depends on the items
counted before it (test_dbits_failed_commit_starts_fresh_bits).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import failpaths_scenario as fs
from tests.support.unixvm import mpunix  # noqa: F401  (fixture)
from tests.support.failpaths import CASES, EXCS, _collect, _signed, _stages, cfg_for, leak_moments, run_py


# CI runs a sample of the stages (test_no_failure_stage_lets_an_intruder_recover_events) with the exception
# cycling over ENOSPC, MemoryError and EIO; PANSKETCH_FAILPATHS_FULL=1 runs every stage with each
# (tests/failpaths_report.py prints the per-case table).
FULL = os.environ.get("PANSKETCH_FAILPATHS_FULL") == "1"


def sweep(cfg: dict[str, Any], tmp: Path, offset: int = 0, full: bool = FULL, stride: int = 2) -> dict[str, Any]:
    """Failure stages x exceptions: the cases where exact events are recoverable."""
    base = run_py(cfg, tmp / "base-a", True, -1, "enospc")
    assert not leak_moments(base, run_py(cfg, tmp / "base-b", False, -1, "enospc"))
    n = base["stages"]
    leaks = []
    dirty = []
    cases = 0
    for j in range(n):
        if full:
            excs: tuple[str, ...] = EXCS
        elif j % stride == offset % stride:
            excs = (EXCS[(j // stride) % 3],)
        else:
            continue
        for exc in excs:
            a = run_py(cfg, tmp / ("%d-%s-a" % (j, exc)), True, j, exc)
            b = run_py(cfg, tmp / ("%d-%s-b" % (j, exc)), False, j, exc)
            cases += 1
            if a["dirty"]:
                dirty.append((j, exc))
            bad = leak_moments(a, b)
            if bad:
                leaks.append((j, exc, a["failed"], bad))
    return {"stages": n, "cases": cases, "leaks": leaks, "dirty": dirty}


@pytest.mark.parametrize("kind,mode,scheme", CASES, ids=["-".join(c) for c in CASES])
def test_no_failure_stage_lets_an_intruder_recover_events(tmp_path: Path, kind: str, mode: str,
                                                          scheme: str) -> None:
    # CI samples the stages: every 3rd (tree, L arrays per write: every 6th), the offset
    # differing between kinds so that together they cover every stage of a mode and scheme
    offset = CASES.index((kind, mode, scheme)) + ("cms", "cs", "dcs").index(kind)
    r = sweep(cfg_for(kind, mode, scheme), tmp_path, offset, stride=6 if mode == "tree" else 3)
    assert r["stages"] >= 30
    assert not r["dirty"], "scratch buffer not all zeros after a failure: %r" % (r["dirty"],)
    assert not r["leaks"], "%d of %d failure cases leak exact events: %r" % (len(r["leaks"]), r["cases"],
                                                                             r["leaks"][:5])


STRETCH = [("cms", "window", "shadow"), ("cs", "keep", "refresh"), ("cms", "tree", "shadow"),
           ("dcs", "window", "refresh")]


@pytest.mark.parametrize("kind,mode,scheme", STRETCH, ids=["-".join(c) for c in STRETCH])
def test_a_flash_that_stays_full_never_lets_events_through(tmp_path: Path, kind: str, mode: str,
                                                           scheme: str) -> None:
    """The flash stays full for 8 or 25 stages (several persists and a commit fail in a
    row, then space is back): still no linear recovery, scratch all zeros."""
    cfg = cfg_for(kind, mode, scheme)
    n = len(_stages(cfg, tmp_path / "st"))
    for j in range(3, n, 17):
        for ln in (8, 25):
            a = json.loads(fs.dump(cfg, str(tmp_path / ("a%d-%d" % (j, ln))), "seed-1", True, j, "enospc", ln))
            b = json.loads(fs.dump(cfg, str(tmp_path / ("b%d-%d" % (j, ln))), "seed-1", False, j, "enospc", ln))
            assert a["failed"] is not None and not a["dirty"]
            assert not leak_moments(a, b), (j, ln, a["failed"])


def test_the_check_has_power_on_the_old_failed_persist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the persist of the code before the failed-write fix (a failed write wipes
    its draw, RAM goes on equal to the partial copy on flash) is caught exactly."""
    from pansketch.agent import storage
    from pansketch.agent.recorder import Recorder

    def old_persist(self, now=None):  # type: ignore[no-untyped-def]
        if self._pending is not None:
            return False
        self._fresh()
        try:
            storage.write_state(self.state_path, self._fps[0], self.seq, self.elo, self.ehi, self.part, self.nz,
                                self.counters)
        except OSError:
            self._wipe()
            return False
        self._add_fresh()
        if now is not None:
            self.last_persist = now
        return True

    monkeypatch.setattr(Recorder, "persist", old_persist)
    cfg = cfg_for("cms", "window", "refresh")
    base = run_py(cfg, tmp_path / "x", True, -1, "enospc")
    # the counters of the 2nd persist half written, then ENOSPC
    mid = [s for s, kind, path in _stages(cfg, tmp_path / "y") if kind == "mid" and "state" in path][1]
    a = run_py(cfg, tmp_path / "a", True, mid, "enospc")
    b = run_py(cfg, tmp_path / "b", False, mid, "enospc")
    assert a["failed"][1] == "mid" and base["stages"] > 0
    assert leak_moments(a, b)


# -- kind dbits: no additive noise; after a failed commit the bits start afresh ---------------
class _Streams:
    """An Rng whose bit flips, fresh bits and output noise come from three separate
    replayed streams: two runs with the same number of items stay in step."""

    def __init__(self) -> None:
        from pansketch.agent.rng import DeterministicSource, Rng

        self.flip = Rng(DeterministicSource("flip"))
        self.bits = Rng(DeterministicSource("bits"))
        self.out = Rng(DeterministicSource("out"))

    def bernoulli(self, num: int, den: int) -> bool:
        return self.flip.bernoulli(num, den)

    def randbits(self, k: int) -> int:
        return self.bits.randbits(k)

    def randbelow(self, m: int) -> int:
        return self.out.randbelow(m)

    def wipe(self) -> None:
        pass


DBITS = {"device": "dev-f", "salt": "fleet-salt-1", "kind": "dbits", "d": 6, "w": 64, "mode": "window",
         "window_s": 600, "epoch_s": 600, "mechanism": "dlap", "budget": "1/2"}


def _dbits_run(root: Path, first: list[str], fail_at: int, exc: str) -> tuple[list[int], dict[int, bytes]]:
    from pansketch.agent.params import Params
    from pansketch.agent.recorders import make

    fl = fs.Flash(fail_at, exc)
    fl.install()
    try:
        rec = make(Params(DBITS), str(root), fs.T0, rng=_Streams(), log=lambda m: None)
        for x in first:
            rec.add(x)
        rec.tick(fs.T0 + 600)  # the commit (fails at fail_at)
        for i in range(30):
            rec.add("later-%d" % i)
        rec.tick(fs.T0 + 1200)
        bits = list(rec.counters)
    finally:
        fs.Flash.uninstall()
    out = {}
    for n in sorted(os.listdir(root / "outbox")):
        if n.endswith(".cbor"):
            out[int(n[:10])] = (root / "outbox" / n).read_bytes()
    return bits, out


def test_dbits_failed_commit_starts_fresh_bits(tmp_path: Path) -> None:
    """Two runs whose items before a failed commit differ (same number, so the streams
    stay in step): after the failure the bits and every later release are identical,
    i.e. nothing the device keeps or publishes later depends on the items the stale
    .tmp counted. A commit that succeeded is the control: its releases differ."""
    xs = ["x-%d" % i for i in range(40)]
    ys = ["y-%d" % i for i in range(40)]
    ok_a = _dbits_run(tmp_path / "ok-a", xs, -1, "enospc")
    ok_b = _dbits_run(tmp_path / "ok-b", ys, -1, "enospc")
    assert ok_a[1][0] != ok_b[1][0]  # the control: the first release counts the first items
    stages = _dbits_stages(tmp_path / "st", xs)
    assert len(stages) >= 6
    for s, kind, path in stages:
        if not (path.endswith(".tmp.new") or "released" in path or path.endswith(".tmp")):
            continue
        if "0000000000" not in path and "released" not in path:
            continue
        for exc in ("enospc", "memory"):
            a = _dbits_run(tmp_path / ("a%d%s" % (s, exc)), xs, s, exc)
            b = _dbits_run(tmp_path / ("b%d%s" % (s, exc)), ys, s, exc)
            assert a == b, "stage %d (%s %s, %s): later state depends on the items before the failure" % (
                s, kind, path, exc)


def _dbits_stages(root: Path, xs: list[str]) -> list[tuple[int, str, str]]:
    fl = fs.Flash(-1)
    fl.install()
    try:
        from pansketch.agent.params import Params
        from pansketch.agent.recorders import make

        rec = make(Params(DBITS), str(root), fs.T0, rng=_Streams(), log=lambda m: None)
        for x in xs:
            rec.add(x)
        n0 = fl.stage
        rec.tick(fs.T0 + 600)
        return [st for st in fl.stages if st[0] >= n0]
    finally:
        fs.Flash.uninstall()


# -- the same runs in the MicroPython Unix port ---------------------------------------------
MP_CASES = [("cms", "window", "refresh"), ("cs", "keep", "shadow"), ("cms", "tree", "refresh"),
            ("dcs", "window", "shadow")]


def _mp_dump(binary: Path, cfg: dict[str, Any], cwd: Path, events: bool, fail_at: int, exc: str) -> dict[str, Any]:
    cwd.mkdir(parents=True, exist_ok=True)
    code = ("import sys\nsys.path.insert(0, %r)\nfrom tests.support import failpaths_scenario as fs\n"
            "print('@' + fs.dump(%r, 'dev', 'seed-1', %r, %d, %r))\n"
            % (str(fs_root(cwd.parent)), cfg, events, fail_at, exc))
    p = subprocess.run([str(binary), "-X", "heapsize=4M", "-c", code], cwd=cwd, capture_output=True, text=True,
                       timeout=120)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("@")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-2000:]
    return json.loads(lines[-1][1:])


def fs_root(tmp: Path) -> Path:
    """The folder the VM imports from: ``pansketch/`` holding the repository's agent/ and firmware/
    (as a board holds them) beside its tests/."""
    repo = Path(__file__).resolve().parent.parent
    root = tmp / "src"
    if not root.exists():
        (root / "pansketch").mkdir(parents=True)
        for name in ("agent", "firmware"):
            (root / "pansketch" / name).symlink_to(repo / name)
        (root / "tests").symlink_to(repo / "tests")
    return root


def _strip(res: dict[str, Any]) -> dict[str, Any]:
    out = dict(res)
    out["sessions"] = [[s[0].rsplit("/dev/", 1)[-1] if "/dev/" in s[0] else s[0].split("dev/", 1)[-1], s[1], s[2]]
                       for s in res["sessions"]]
    return out


@pytest.mark.parametrize("kind,mode,scheme", MP_CASES, ids=["-".join(c) for c in MP_CASES])
def test_failure_paths_on_the_micropython_unix_port(mpunix: Path, tmp_path: Path, kind: str, mode: str,
                                                    scheme: str) -> None:
    """The main failure paths on the real MicroPython VM: a full flash (ENOSPC) half-way
    through the counters of a state write, a MemoryError after the counters of a release
    (before its trailer), an EIO at the marker. The VM's views are identical to CPython's
    (same arrays, same flash writes, same releases) and none recovers an event."""
    cfg = cfg_for(kind, mode, scheme)
    stages = _stages(cfg, tmp_path / "st")
    want = []
    for sel, exc in ((lambda k, p: k == "mid" and p.endswith("state.bin.new"), "enospc"),
                     (lambda k, p: k == "post" and p.endswith(".tmp.new"), "memory"),
                     (lambda k, p: k == "open" and p.endswith("released.new"), "eio")):
        hits = [s for s, k, p in stages if sel(k, p)]
        assert hits, (kind, mode, scheme)
        want.append((hits[len(hits) // 2], exc))
    for j, exc in want:
        a = _mp_dump(mpunix, cfg, tmp_path / ("mp%d%s-a" % (j, exc)), True, j, exc)
        b = _mp_dump(mpunix, cfg, tmp_path / ("mp%d%s-b" % (j, exc)), False, j, exc)
        assert a["failed"] is not None and a["dirty"] == 0
        assert not leak_moments(a, b), "stage %d (%s) leaks on MicroPython" % (j, exc)
        py = json.loads(fs.dump(cfg, str(tmp_path / ("py%d%s" % (j, exc)) / "dev"), "seed-1", True, j, exc))
        assert _strip(py)["views"] == a["views"] and _strip(py)["sessions"] == _strip(a)["sessions"]
        assert py["published"] == a["published"]


# -- tree boot never reuses a release key --------------------------------------------------
def _keys(root: Path) -> list[tuple[int, int, int, int]]:
    import cbor2

    out = []
    for n in sorted(os.listdir(root / "outbox")):
        if n.endswith(".cbor"):
            m = cbor2.loads((root / "outbox" / n).read_bytes())
            out.append((m["lvl"], m["elo"], m["ehi"], m["part"]))
    return out


@pytest.mark.parametrize("scheme", ["refresh", "shadow"])
def test_tree_boot_after_a_flush_never_reuses_a_release_key(tmp_path: Path, scheme: str) -> None:
    """State written in epoch e; the node of e is released at its end; a flush in e+1
    releases (e+1, e+2, part 0); power cut before the next persist. Boot reads the older
    state (level 0 at e, released) and must not pick (e+1, e+2, part 0) again."""
    from pansketch.agent.params import Params
    from pansketch.agent.recorders import make
    from pansketch.agent.rng import DeterministicSource, Rng

    cfg = cfg_for("cms", "tree", scheme)
    cfg["persist_s"] = 86400  # no persist at the tick: boot finds the state of t0 + 100
    p = Params(cfg)
    t0 = fs.T0
    rec = make(p, str(tmp_path), t0, rng=Rng(DeterministicSource("k1")), log=lambda m: None)
    rec.add("a")
    assert rec.persist(t0 + 100)
    rec.add("b")
    assert rec.tick(t0 + 600) == 1  # level 0 [e, e+1) released
    rec.add("c")
    assert rec.flush(t0 + 700) == 3  # (e+1, e+2, 0), and levels 1, 2 early
    before = _keys(tmp_path)
    del rec  # power cut: RAM gone, state.bin is the one written at t0 + 100
    rec = make(p, str(tmp_path), t0 + 750, rng=Rng(DeterministicSource("k2")), log=lambda m: None)
    rec.add("d")
    rec.flush(t0 + 800)
    rec.add("e")
    rec.tick(t0 + 4 * 600)
    keys = _keys(tmp_path)
    assert keys[:len(before)] == before and len(keys) > len(before)
    assert len(keys) == len(set(keys)), "a release key was reused: %r" % (keys,)


def test_failed_commit_adds_one_draw_and_nz_counts_it(tmp_path: Path) -> None:
    """A failed commit (marker write fails after the .tmp was written in full) adds one
    fresh internal draw before the next event: the next release's nz is one higher, and
    under shadow the flash track R - M is unchanged by it (the draw goes into R and M)."""
    import cbor2

    from pansketch.agent import storage
    from pansketch.agent.params import Params
    from pansketch.agent.recorders import make
    from pansketch.agent.rng import DeterministicSource, Rng

    for scheme in ("refresh", "shadow"):
        nzs = []
        for fail in (False, True):
            root = tmp_path / ("%s%d" % (scheme, fail))
            p = Params(cfg_for("cms", "window", scheme))
            rec = make(p, str(root), fs.T0, rng=Rng(DeterministicSource("nz")), log=lambda m: None)
            rec.add("a")
            real = storage.write_marker
            if fail:
                def bad(*a: Any) -> None:
                    raise OSError(28, "ENOSPC")
                storage.write_marker = bad  # type: ignore[assignment]
            try:
                track = list(rec.shadow) if rec.shadow is not None else None
                r0 = [a - m for a, m in zip(rec.counters, rec.shadow)] if track else None
                assert rec.tick(fs.T0 + 600) == (0 if fail else 1)
                if fail and r0 is not None:
                    assert [a - m for a, m in zip(rec.counters, rec.shadow)] == r0
            finally:
                storage.write_marker = real
            rec.add("b")
            rec.tick(fs.T0 + 1200)
            rels = sorted(n for n in os.listdir(root / "outbox") if n.endswith(".cbor"))
            nzs.append(cbor2.loads((root / "outbox" / rels[-1]).read_bytes())["nz"])
        assert nzs[1] == nzs[0] + 1, (scheme, nzs)


# -- failed commits: no event is seen twice (the 2-epsilon case is not an exact recovery) ----
def _gauss_view(cfg: dict[str, Any], root: Path, events: Any, fail_at: int) -> tuple[dict[str, Any], list[Any]]:
    fs.SAMPLES[:] = []
    fs.RECORD[0] = True
    try:
        res = json.loads(fs.dump(cfg, str(root), "seed-1", events, fail_at, "enospc"))
    finally:
        fs.RECORD[0] = False
    return res, list(fs.SAMPLES)


def gauss_loss(cfg: dict[str, Any], tmp: Path, fail_at: int, ops: list[int]) -> float:
    """max over event times and intrusion moments of Δᵀ Σ⁺ Δ · v_out: the privacy loss of
    the intruder's whole view for one event, with the noise taken as Gaussian of the
    draws' variances (mechanism dgauss: variance = num/den), relative to one output draw.

    The noise-coefficient matrix A (views x draws) is solved exactly from the run without
    events (every draw is one batch of one value per cell; more cells than batches), so
    Σ = A D Aᵀ. A sound design has every event in coordinates with private noise whose
    1/variance sum to at most 1/v_out (docs/PRIVACY.md lemma): the value is <= 1. An
    event seen twice with independent noise (a failed commit without a fresh draw) gives 2;
    an exact recovery gives infinity."""
    from pansketch.agent.params import Params

    p = Params(cfg)
    n = p.cells
    v_out = p.noise.num / p.noise.den
    b, samples = _gauss_view(cfg, tmp / "b", False, fail_at)
    assert len(samples) % n == 0
    nb = len(samples) // n
    z = np.array([s[2] for s in samples], dtype=np.float64).reshape(nb, n)
    var = np.array([samples[t * n][0] / samples[t * n][1] for t in range(nb)])
    worst = 0.0
    for j in ops:
        a, _ = _gauss_view(cfg, tmp / ("a%d" % j), j, fail_at)
        for k in range(j, len(a["views"]) + 1):
            va = _collect(a, k)
            vb = _collect(b, k)
            rows = []
            deltas = []
            for x, y in zip(va, vb):
                m = len(y)
                sol = np.linalg.lstsq(z[:, :m].T, np.array(_signed(y), dtype=np.float64), rcond=None)[0]
                coef = np.round(sol)
                assert m > nb and np.array_equal(coef @ z[:, :m], np.array(_signed(y))), "A not exact"
                rows.append(coef)
                deltas.append(np.array(_signed(x), dtype=np.int64) - np.array(_signed(y), dtype=np.int64))
            amat = np.array(rows)
            sigma = amat @ np.diag(var) @ amat.T
            m0 = min(len(d) for d in deltas)
            for c in range(m0):
                d = np.array([dd[c] for dd in deltas], dtype=np.float64)
                if not d.any():
                    continue
                y = np.linalg.lstsq(sigma, d, rcond=None)[0]
                if np.abs(sigma @ y - d).max() > 1e-6:
                    return float("inf")  # the event is outside the noise's range: exact recovery
                worst = max(worst, float(d @ y) * v_out)
    return worst


GAUSS = [("cms", "window", "refresh"), ("cms", "window", "shadow"), ("cs", "keep", "shadow")]


@pytest.mark.parametrize("kind,mode,scheme", GAUSS, ids=["-".join(c) for c in GAUSS])
def test_failed_commit_never_shows_an_event_twice(tmp_path: Path, kind: str, mode: str, scheme: str) -> None:
    """A commit that fails at any stage of the .tmp or the marker: the whole view's loss
    for one event, at every intrusion moment and event time, stays at one output draw's
    (<= 1). Without the fresh draw after the failure it is 2 (the 2ε of the failed-commit bug)."""
    cfg = cfg_for(kind, mode, scheme)
    cfg["mechanism"] = "dgauss"
    base = gauss_loss(cfg, tmp_path / "none", -1, [2, 4])
    assert base <= 1 + 1e-6
    stages = [s for s, k, path in _stages(cfg, tmp_path / "st")
              if (".tmp" in path or "released" in path) and k in ("open", "mid", "post", "flush")]
    first = [s for s in stages if s < stages[0] + 12]  # the first commit's stages (and its marker)
    for s in first:
        got = gauss_loss(cfg, tmp_path / ("f%d" % s), s, [2, 4])  # an event before the failure, one after
        assert got <= 1 + 1e-6, "failure at stage %d: loss %.3f x one output draw" % (s, got)
