"""Kind dbits (pan-private distinct count, agent/dbits.py): device, release, host estimator, coverage."""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction

import cbor2
import numpy as np
import pytest

from pansketch.agent.params import ParamError, Params
from pansketch.agent.recorders import make_recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools.query import distinct
from pansketch.host_tools.bench.kinds import dnpry_simulate
from pansketch.host_tools.ingest.decode import Rejected, decode
from pansketch.host_tools.query.merge import noise_variance
from pansketch.host_tools.store.sqlite import Store
from tests.support import mpvm
from tests.support.host import binom_lower, binom_upper

T0 = 200_000 * 3600
# reviewed attributes (docs/PRIVACY.md, "Distinct counts"): the bits (counters), the zeroed release scratch
# (relbuf), and clock/commit-driven or public values
REC_ATTRS = {"p", "root", "rng", "log", "outbox", "state_path", "marker_path", "relbuf", "sketch", "counters", "_fp",
             "_pending", "nz", "resumed", "last_persist", "seq", "elo", "ehi", "part",
             "_fps", "nzm", "sh",  # the Recorder's persist-scheme bookkeeping: public, constant for dbits
             "_redraw", "_unrenamed"}  # failed-commit flags: commit-driven (docs/PRIVACY.md "Failed writes and failed commits")
SK_ATTRS = {"kind", "d", "w", "prefix", "p_num", "p_den", "counters"}
CFG = {"device": "pi-1", "salt": "fleet-salt-1", "kind": "dbits", "d": 12, "w": 512, "mechanism": "dlap",
       "budget": "1", "mode": "keep", "window_s": 3600, "epoch_s": 600}


def test_params():
    p = Params(CFG)
    assert p.cells == 12 and (p.noise.num, p.noise.den) == (1, 1)
    for k, v in (("mechanism", "dgauss"), ("budget", "3"), ("w", 100), ("d", 31), ("clip", 2)):
        with pytest.raises(ParamError) as e:
            Params(dict(CFG, **{k: v}))
        assert e.value.key == k


def _run(root, items_per_epoch, seed=b"dbits-seed", persist=True):
    rec = make_recorder(Params(CFG), str(root), T0, rng=Rng(DeterministicSource(seed)), log=lambda m: None)
    for k, items in enumerate(items_per_epoch):
        if k % 2:
            rec.add_many(items)
        else:
            for x in items:
                rec.add(x)
        if persist:
            rec.persist(T0 + k * 600 + 300)
        rec.tick(T0 + (k + 1) * 600)
    return rec


def test_releases_decode_and_no_state_on_flash(tmp_path):
    items = [["mac-%d" % (i % (200 * (k + 1))) for i in range(3000)] for k in range(3)]
    rec = _run(tmp_path, items)
    assert not os.path.exists(tmp_path / "state.bin")  # the bit array never reaches flash
    assert not any(rec.relbuf) and not any(rec.rng._buf)
    st = Store(str(tmp_path / "db"))
    for f in sorted((tmp_path / "outbox").glob("*.cbor")):
        raw = f.read_bytes()
        m = cbor2.loads(raw)
        assert m["v"] == 2 and m["kind"] == "dbits" and m["nz"] == 2 and len(m["ctr"]) == 48
        st.insert(decode(raw, "pansketch/pi-1/release"))
        for bad, code in ((dict(mech="dgauss"), "schema"), (dict(ctr=m["ctr"] + b"\0\0\0\0"), "shape")):
            from pansketch.agent import cbor
            with pytest.raises(Rejected) as e:
                decode(cbor.dumps(dict(m, **bad)))
            assert e.value.code in (code, "noise")
    rels = st.releases(with_payload=True)
    assert len(rels) == 3
    for r, D in zip(rels, (200, 400, 600)):
        a = distinct.estimate([r], 0.99)
        assert a["lo"] <= D <= a["hi"], (a, D)
    total = distinct.estimate(rels, 0.99)
    assert total["lo"] <= 1200 <= total["hi"]
    # the ledger counts eps per release (sensitivity 1: one item, one count), not d * eps
    from pansketch.host_tools.store import ledger
    lg = ledger.build(rels)
    assert lg.device("pi-1").eps == Fraction(1)
    st.close()


def test_interval_coverage_by_simulation():
    """95% intervals miss at most the 99.9% point of Binomial(N, 0.05) (fixed seeds)."""
    g = np.random.default_rng(2024)
    m, K, eps = 1024, 16, 1.0
    ov = noise_variance("dlap", 1, 1)
    misses = total = 0
    for D in (30, 100, 1000, 10_000, 100_000, 1_000_000):
        for t in range(40):
            d, v = distinct.estimate_release(dnpry_simulate(D, m, K, eps, g), m, eps, ov)
            z = 1.959964
            misses += not (d - z * math.sqrt(v) <= D <= d + z * math.sqrt(v))
            total += 1
    assert misses <= binom_upper(total, 0.05, 0.999), (misses, total)


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed")
def test_dbits_identical_on_micropython(tmp_path):
    setup = """
from pansketch.agent.params import Params
from pansketch.agent.recorders import make_recorder
from pansketch.agent.rng import Rng, DeterministicSource
CFG = %r
rec = make_recorder(Params(CFG), "/flash/dev", %d, rng=Rng(DeterministicSource(b"dbits-seed")), log=lambda m: None)
def step(k):
    items = ["mac-%%d" %% (i %% (50 * (k + 1))) for i in range(300)]
    if k %% 2:
        rec.add_many(items)
    else:
        for x in items:
            rec.add(x)
    rec.persist(%d + k * 600 + 300)
    rec.tick(%d + (k + 1) * 600)
""" % (CFG, T0, T0, T0)
    mp = tmp_path / "mp"
    view = ("print('@attrs', ' '.join(sorted(k for k in rec.__dict__)))\n"
            "print('@sk', ' '.join(sorted(k for k in rec.sketch.__dict__)))\n"
            "print('@zero', any(rec.relbuf), any(rec.rng._buf), rec.rng._pos == len(rec.rng._buf))")
    got = mpvm.run([setup, "step(0)", "step(1)", "step(2)", view], heap=256 * 1024, flash=mp).check().values()
    # the intruder's view on the board: the reviewed attributes (test_intruder_view_dbits), zero scratch buffers
    assert got["attrs"].split() == sorted(REC_ATTRS) and got["sk"].split() == sorted(SK_ATTRS)
    assert got["zero"] == "False False True"
    cp = tmp_path / "cp"
    _run(cp, [["mac-%d" % (i % (50 * (k + 1))) for i in range(300)] for k in range(3)])
    a = sorted(p.relative_to(mp / "dev") for p in (mp / "dev").rglob("*") if p.is_file())
    b = sorted(p.relative_to(cp) for p in cp.rglob("*") if p.is_file())
    assert a == b and len([f for f in b if str(f).startswith("outbox/")]) == 3
    for f in b:
        assert (mp / "dev" / f).read_bytes() == (cp / f).read_bytes(), f


def test_intruder_view_dbits(tmp_path):
    """Every attribute reviewed (docs/PRIVACY.md); scratch and RNG buffers zero between calls; nothing on
    flash but releases and the marker; the target's bit is a fresh Bern(1/2 + eps/4) draw, not a record."""
    rec = _run(tmp_path, [["target", "x"], ["target"]])
    assert set(rec.__dict__) == REC_ATTRS
    assert set(rec.sketch.__dict__) == SK_ATTRS
    assert not any(rec.relbuf) and not any(rec.rng._buf) and rec.rng._pos == len(rec.rng._buf)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert all(f == "released" or f.startswith("outbox/") for f in files), files
    # the target's bit over many independent devices: Bern(3/4) when present, Bern(1/2) when absent
    ones_present = ones_absent = 0
    n = 400
    for s in range(n):
        p = Params(dict(CFG, d=2, w=8))
        r = make_recorder(p, str(tmp_path / ("r%d" % s)), T0, rng=Rng(DeterministicSource(b"s%d" % s)),
                          log=lambda m: None)
        pos = r.sketch.position("target")
        bit = lambda: (r.counters[pos >> 3] >> (pos & 7)) & 1  # noqa: E731
        ones_absent += bit()
        r.add("target")
        r.add("target")
        ones_present += bit()
    # binomial tolerances at 4 sd
    assert abs(ones_absent / n - 0.5) < 4 * math.sqrt(0.25 / n)
    assert abs(ones_present / n - 0.75) < 4 * math.sqrt(0.1875 / n)


# -- the calibration of the bits, both directions -----------------------------------------------------------

def _exp_above(eps: Fraction, x: Fraction) -> bool:
    """Whether e^eps >= x, decided with exact rational bounds on e^eps (Taylor sum below, + tail above)."""
    s, term, k = Fraction(0), Fraction(1), 0
    while True:
        s += term
        k += 1
        term = term * eps / k
        tail = term * 2  # eps <= 2 < k + 1 from k = 2 on: the tail is below twice the next term
        if k > 2 and s >= x:
            return True
        if k > 2 and s + tail < x:
            return False


def _bit_ratios(sk) -> list[Fraction]:
    """The exact likelihood ratios of one bit of the device's mechanism, present vs absent, both ways:
    absent = Bern(1/2), present = Bern(p) with p = the device's own p_num/p_den (the draw rng.bernoulli uses)."""
    p = Fraction(sk.p_num, sk.p_den)
    half = Fraction(1, 2)
    out = []
    for present, absent in ((p, half), (1 - p, half)):  # bit 1, bit 0
        out += [present / absent, absent / present]
    return out


def test_dbits_randomized_response_is_eps_dp_both_ways():
    """For every budget Params accepts, every likelihood ratio of the bit the device really draws is <= e^eps
    (exactly, rationals); every budget it refuses has one above e^eps. Fails for the old 'eps <= 2' rule
    (at eps = 2 a 0-bit has ratio infinity) and for any p whose ratios exceed e^eps."""
    grid = sorted({Fraction(k, 100) for k in range(1, 201)} | {Fraction(k, 10000) for k in range(15900, 15975)}
                  | {Fraction(1, 7), Fraction(3, 2), Fraction(159362, 100000), Fraction(159363, 100000)})
    accepted = refused = 0
    for eps in grid:
        cfg = dict(CFG, budget="%d/%d" % (eps.numerator, eps.denominator), d=2, w=8)
        worst = Fraction(2) / (2 - eps) if eps < 2 else None  # 1 / (2 (1 - p)), the 0-bit's reverse ratio
        sound = worst is not None and _exp_above(eps, worst)
        try:
            p = Params(cfg)
        except ParamError as e:
            assert not sound, eps
            assert e.key == "budget" and "1.5936" in str(e), str(e)
            refused += 1
            continue
        assert sound, eps
        from pansketch.agent.dbits import DensityBits

        sk = DensityBits(p.d, p.w, b"x", p.budget, bytearray(p.d * p.w // 8))
        for r in _bit_ratios(sk):
            assert _exp_above(eps, r), (eps, r)
        accepted += 1
    assert accepted >= 150 and refused >= 40
    # the limit is where the reverse ratio crosses e^eps: 1.59362 accepted, 1.59363 refused
    assert Params(dict(CFG, budget="159362/100000")).budget == (79681, 50000)
    with pytest.raises(ParamError):
        Params(dict(CFG, budget="159363/100000"))
    # a DensityBits built around Params still refuses (defence in depth)
    from pansketch.agent.dbits import DensityBits

    with pytest.raises(ValueError, match="1.5936"):
        DensityBits(2, 8, b"x", (2, 1), bytearray(2))


def test_dbits_budget_refused_by_the_agent_cli(tmp_path, capsys):
    """A dbits config above the limit: one line naming the limit, exit 2, nothing created."""
    from pansketch.agent.pi.daemon import main

    conf = tmp_path / "agent.toml"
    conf.write_text('[device]\nid = "pi-1"\nsalt = "fleet-salt-1"\n[sketch]\nkind = "dbits"\nd = 12\nw = 512\n'
                    '[privacy]\nmechanism = "dlap"\nbudget = "2"\nmode = "keep"\nwindow_s = 3600\nepoch_s = 600\n'
                    '[storage]\ndir = "%s"\n' % (tmp_path / "st"))
    assert main(["check", "--config", str(conf)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "privacy.budget" in err[0] and "eps <= 1.5936" in err[0], err
    assert not (tmp_path / "st").exists()
    conf.write_text(conf.read_text().replace('budget = "2"', 'budget = "3/2"'))
    assert main(["check", "--offline", "--config", str(conf)]) == 0


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed")
def test_dbits_limit_identical_on_micropython():
    """The integer test gives the same answers on the board's VM (no floats on the path)."""
    cases = [(1, 1), (3, 2), (159362, 100000), (159363, 100000), (8, 5), (2, 1), (1, 1000), (199, 100)]
    code = ("from pansketch.agent.params import dbits_eps_ok\n"
            "print('@ok', ' '.join(str(int(dbits_eps_ok(a, b))) for a, b in %r))" % (cases,))
    got = mpvm.run(code).check().values()
    from pansketch.agent.params import dbits_eps_ok

    assert got["ok"] == " ".join(str(int(dbits_eps_ok(a, b))) for a, b in cases) == "1 1 1 0 0 0 1 0"


def test_interval_coverage_at_eps_half_both_sides():
    """eps = 1/2 (the default budget), 16 x 1024 bits, up to 10^6 distinct: the bootstrap
    variance (distinct.boot_variance) keeps misses within the 0.1%..99.9% points of
    Binomial(N, 0.05); the delta-method variance alone missed 10-13% from 3e5 on."""
    g = np.random.default_rng(77)
    m, K = 1024, 16
    ov = noise_variance("dlap", 2, 1)
    misses = total = 0
    for D in (10_000, 300_000, 1_000_000):
        for _ in range(100):
            d, _v = distinct.estimate_release(dnpry_simulate(D, m, K, 0.5, g), m, 0.5, ov)
            sd = math.sqrt(distinct.boot_variance(d, K, m, (1, 2), 2.0, ov))
            misses += not (d - 1.959964 * sd <= D <= d + 1.959964 * sd)
            total += 1
    assert binom_lower(total, 0.05, 0.999) <= misses <= binom_upper(total, 0.05, 0.999), (misses, total)


def test_host_reads_p_from_the_device():
    assert distinct.device_p(16, 1024, (1, 2)) == Fraction(5, 8)
    assert distinct.device_p(16, 1024, (1, 1)) == Fraction(3, 4)


def test_neyman_interval_covers_at_every_n_and_eps(monkeypatch):
    """release_interval (maximum likelihood + Neyman interval from the device's simulated sampling
    distribution) on exact simulations of the device's bits (dnpry_simulate, not the host's own
    simulator): at eps = 1/2 and 3/2 and n = 30 and 3000 (a 10 x 256 sketch and 800 simulations per
    band, so the run is short), misses of each side stay within the 0.1%..99.9% points of
    Binomial(N, 0.025). The inverse-variance estimate +- z sd it replaced missed low too rarely at
    small n and too often at large n."""
    from scipy.stats import binom

    monkeypatch.setattr(distinct, "NEY_DRAWS", 800)
    monkeypatch.setattr(distinct, "_ney_cache", {})
    m, K = 256, 10
    g = np.random.default_rng(31)
    low = high = total = 0
    for en, ed in ((1, 2), (3, 2)):
        ov = noise_variance("dlap", ed, en)
        for D in (30, 3000):
            for _ in range(70):
                d, lo, hi = distinct.release_interval(dnpry_simulate(D, m, K, en / ed, g), K, m, (en, ed), ed / en, ov)
                assert lo <= d <= hi
                low += D < lo
                high += D > hi
                total += 1
    lo_b, hi_b = int(binom.ppf(0.001, total, 0.025)), int(binom.ppf(0.999, total, 0.025))
    assert lo_b <= low <= hi_b and lo_b <= high <= hi_b, (low, high, total, lo_b, hi_b)


def test_mle_has_no_collapse_at_large_n():
    """At 2e6 distinct and eps = 1/2 the former inverse-variance average fell to ~4e5 in 2.5% of
    releases (a self-consistent wrong weighting); the maximum-likelihood estimate's 1st percentile
    stays above half the truth."""
    m, K = 1024, 16
    g = np.random.default_rng(5)
    ov = noise_variance("dlap", 2, 1)
    p = float(distinct.device_p(K, m, (1, 2)))
    sims = distinct.simulate_device(2_000_000, K, m, p, 2.0, 400, g)
    est = distinct.mle_many(sims, m, p, ov)
    old = np.array([distinct.estimate_release(c, m, 0.5, ov)[0] for c in sims])
    assert np.quantile(est, 0.01) > 1_000_000, np.quantile(est, 0.01)
    assert np.quantile(old, 0.01) < 1_000_000  # what it replaces


def test_device_path_covers(tmp_path):
    """Recorder -> release bytes -> decode -> store -> query distinct, a short version of
    python -m pansketch.host_tools.bench.accuracy --dbits-device 40: 12 releases of 1,500 distinct items, misses
    at most the 99.9% point of Binomial(12, 0.05)."""
    from scipy.stats import binom

    from pansketch.host_tools.bench.accuracy import dbits_device_path

    rows = dbits_device_path(12, Ds=(1500,), K=12, m=256, workdir=str(tmp_path))
    misses = round(12 * (1 - rows[0]["coverage"]))
    assert misses <= int(binom.ppf(0.999, 12, 0.05)), rows


def test_sampling_bands_outlive_the_process(tmp_path, monkeypatch):
    """A `query distinct` process simulated ~10 sampling bands (0.3-0.5 s each) on every call: the
    bands go to a cache file, and a later process answers from it with the same interval, without
    simulating. A malformed file is no cache (the bands are simulated again, same answer), and a
    directory that cannot be written is no error."""
    import subprocess
    import sys

    code = ("import time; from pansketch.host_tools.query import distinct as D; t = time.perf_counter(); "
            "print(D.neyman_interval(5000.0, 10, 256, (1, 2), 2.0, 8.0), D._disk_new, "
            "len(D._ney_cache), flush=True)")

    def run(cache):
        env = dict(os.environ, PANSKETCH_CACHE_DIR=str(cache))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return out.stdout.split(")")[0] + ")"

    first = run(tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("dbits-bands-2000-"), files
    n_bands = len(json.loads(files[0].read_text()))
    assert n_bands >= 5
    # the second process finds every band in the file: nothing is simulated (simulate_device fails)
    env_code = code.replace("import time;", "import time; import pansketch.host_tools.query.distinct as X; "
                            "X.simulate_device = None;")
    env = dict(os.environ, PANSKETCH_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", env_code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(")")[0] + ")" == first
    files[0].write_text("{not json")
    assert run(tmp_path) == first
    assert len(json.loads(files[0].read_text())) == n_bands  # rewritten whole
    ro = tmp_path / "ro"
    ro.write_text("a file where the directory should be")
    assert run(ro / "sub") == first
