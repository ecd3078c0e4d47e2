"""Negative controls of the audit: the device core with deliberately broken noise.

Test-only hooks (never a user option): each control is a context manager
that monkeypatches the *real* agent modules for the duration of a test, so
the audit runs the same code path it audits in production, with one
defect. ``tests/test_audit.py`` requires the audit to flag every one of them
(ε lower bound above the claim).

* ``output-noise-skipped``  -- ``Recorder._release`` publishes state, no Z_out;
* ``internal-noise-skipped`` -- ``Recorder._open`` starts from zeros, no Z_int;
* ``fresh-draw-skipped``     -- ``Recorder.persist`` adds no fresh draw Y;
* ``scale-halved``           -- the calibration returns half the scale
  (dlap t/2; dgauss sigma/2);
* ``scratch-not-wiped``      -- intruder view, bug 1: ``_add_fresh`` leaves the draw in ``relbuf``;
* ``rng-tail-kept``          -- intruder view, bug 2: ``Rng.wipe`` keeps the buffer and its tail;
* ``event-count-kept``       -- the Recorder keeps an exact count of events in RAM (not an
  array: caught by the metadata test, which compares every non-array attribute).

Failed writes (:data:`FAULT_CONTROLS`, the failure paths as they were before the fix, audited
with the fault scenarios and the keep-every-byte flash):

* ``failed-persist-no-fresh-draw``   -- a failed state write wipes the fresh draw and counts on;
* ``failed-commit-same-accumulator`` -- a failed commit deletes the .tmp and counts on, no fresh draw.

Under ``persist_noise = "shadow"`` (:data:`SHADOW_CONTROLS`, audited with
:data:`SHADOW_CFG`):

* ``shadow-g-skipped``       -- a persist writes S = R - M but never adds the fresh G
  to the shadow M: R - M - S = the exact events since the persist;
* ``shadow-refresh-scale``   -- the internal noise (Z_int, the G's) is drawn at the
  refresh calibration ``p.noise`` instead of ``p.inoise`` (2x the arrays): an event
  before the intrusion is then in two coordinates each at the full budget, loss 2 eps.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from pansketch.agent import accum, calibrate, noise
from pansketch.agent.noise import NoiseSpec, wrap32
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import Rng


@contextlib.contextmanager
def _patch(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _skip_noise_in(method: str, cls: type = Recorder, module: object = accum) -> Iterator[None]:
    """add_noise does nothing while cls.<method> runs (``module``: where cls finds add_noise)."""
    depth = [0]
    real_add = module.add_noise  # type: ignore[attr-defined]
    real_method = getattr(cls, method)

    real_draw = module.draw_into  # type: ignore[attr-defined]

    def add_noise(arr, spec, rng, start=0, stop=None):  # type: ignore[no-untyped-def]
        if depth[0]:
            return
        real_add(arr, spec, rng, start, stop)

    def draw_into(arr, spec, rng):  # type: ignore[no-untyped-def]
        if depth[0]:
            noise.zero(arr)  # the "draw" is all zeros
            return
        real_draw(arr, spec, rng)

    def wrapped(self, *a, **kw):  # type: ignore[no-untyped-def]
        depth[0] += 1
        try:
            return real_method(self, *a, **kw)
        finally:
            depth[0] -= 1

    with _patch(module, "add_noise", add_noise), _patch(module, "draw_into", draw_into), \
            _patch(cls, method, wrapped):
        yield


@contextlib.contextmanager
def _scale_halved() -> Iterator[None]:
    real = calibrate.noise_for

    def noise_for(mech, budget, d, clip=1, arrays=1):  # type: ignore[no-untyped-def]
        s = real(mech, budget, d, clip, arrays)
        # dlap: t -> t/2; dgauss: sigma -> sigma/2, i.e. sigma^2 -> sigma^2/4
        return NoiseSpec(s.mech, s.num, s.den * (2 if s.mech == "dlap" else 4))

    with _patch(calibrate, "noise_for", noise_for):
        yield


@contextlib.contextmanager
def _dbits_scale_halved() -> Iterator[None]:
    """Kind dbits with its randomness at twice the budget: the bits' bias eps/4 -> eps/2 (a bit's
    ratios 1 +- eps instead of 1 +- eps/2) and the release's count noise at t/2 (calibration)."""
    from pansketch.agent import dbits

    real_init = dbits.DensityBits.__init__

    def init(self, levels, m, prefix, eps, bits):  # type: ignore[no-untyped-def]
        real_init(self, levels, m, prefix, eps, bits)
        self.p_num, self.p_den = eps[1] + eps[0], 2 * eps[1]  # Bern(1/2 + eps/2)

    with _scale_halved(), _patch(dbits.DensityBits, "__init__", init):
        yield


def _add_fresh_unwiped(self):  # type: ignore[no-untyped-def]
    """Recorder._add_fresh before the intruder-view fix: the staged draw stays in relbuf."""
    a = self.counters
    b = self.relbuf
    for i in range(len(a)):
        a[i] = wrap32(a[i] + b[i])
    self.nz += 1


CONTROLS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "output-noise-skipped": lambda: _skip_noise_in("_release"),
    "internal-noise-skipped": lambda: _skip_noise_in("_open"),
    "fresh-draw-skipped": lambda: _skip_noise_in("persist"),
    "scale-halved": _scale_halved,
    "scratch-not-wiped": lambda: _patch(Recorder, "_add_fresh", _add_fresh_unwiped),
    "rng-tail-kept": lambda: _patch(Rng, "wipe", lambda self: None),
}

# the hook patches the names the recorders call (agent/accum.py draws every noise array of both)
assert noise.add_noise is accum.add_noise and noise.draw_into is accum.draw_into


def _tree_controls() -> dict[str, Callable[[], contextlib.AbstractContextManager[None]]]:
    """The same defects in tree mode (agent/tree.py's TreeRecorder)."""
    from pansketch.agent import tree

    return {
        "tree-output-noise-skipped": lambda: _skip_noise_in("_release", tree.TreeRecorder),
        "tree-fresh-draw-skipped": lambda: _skip_noise_in("_retry", tree.TreeRecorder),
        # not "scale halved": halving t with L = 2 levels doubles the per-node
        # epsilon only up to the claim; beating it needs the evidence of all L
        # nodes summed, and the distinguisher tests one combination of arrays
    }


TREE_CONTROLS = _tree_controls()


def _add_counting(real):  # type: ignore[no-untyped-def]
    def add(self, item, weight=1):  # type: ignore[no-untyped-def]
        self.events = getattr(self, "events", 0) + 1  # an exact event count in RAM (docs/ARCHITECTURE.md forbids it)
        return real(self, item, weight)

    return add


CONTROLS["event-count-kept"] = lambda: _patch(Recorder, "add", _add_counting(Recorder.add))

# The calibration error of 2x, per kind: the same hook (dbits: its bits too), each kind's audit must flag it.
# Small configurations (w = 8; strhh 3 rows x 4 levels = 12 touched cells, dcs 2 x 5 = 10): the CI size.
# dbits at eps = 3/4 (its real code path costs a run per trial; at 1/2 the doubled bias needs ~4x the trials).
KIND_CFGS: dict[str, dict[str, object]] = {
    "cms": dict(CFG_BASE := {"device": "audit", "salt": "audit-salt-1", "w": 8, "mode": "window", "window_s": 600,
                             "mechanism": "dlap", "budget": "1/2", "persist_s": 86400}, kind="cms", d=2),
    "cs": dict(CFG_BASE, kind="cs", d=4),
    "dcs": dict(CFG_BASE, kind="dcs", d=2, b=4, map=[1, 1, 0]),
    "strhh": dict(CFG_BASE, kind="strhh", d=3, len=4),
    "tree": dict({k: v for k, v in CFG_BASE.items() if k != "window_s"}, kind="cms", d=2, mode="tree", levels=2),
    "dbits": dict(CFG_BASE, kind="dbits", d=4, budget="3/4"),
}
KIND_HALVED: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    k: (_dbits_scale_halved if k == "dbits" else _scale_halved) for k in KIND_CFGS}


def _persist_shadow_no_g(self, now):  # type: ignore[no-untyped-def]
    """Recorder._persist_shadow with the fresh G (staged in relbuf) never added to M."""
    a = self.counters
    m = self.shadow
    b = self.relbuf
    for i in range(len(m)):
        m[i] = wrap32(a[i] - m[i])
    from pansketch.agent import storage

    storage.write_state(self.state_path, self._fps[1], self.seq, self.elo, self.ehi, self.part, self.nzm, m)
    for i in range(len(m)):
        m[i] = wrap32(a[i] - m[i])  # M back as it was: no fresh G
        b[i] = 0
    self.nzm += 1
    if now is not None:
        self.last_persist = now
    return True


def _internal_at_refresh_scale():  # type: ignore[no-untyped-def]
    from pansketch.agent.params import Params

    return _patch(Params, "internal_noise", lambda self, shadow: self.noise)


SHADOW_CONTROLS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "shadow-g-skipped": lambda: _patch(Recorder, "_persist_shadow", _persist_shadow_no_g),
    "shadow-refresh-scale": _internal_at_refresh_scale,
}


# -- failed writes: the failure paths as they were (the negative controls of the fault scenarios) ----------------

def _persist_before_issue18(self, now=None):  # type: ignore[no-untyped-def]
    """Recorder.persist before the failed-write fix (refresh): a failed write wipes the fresh draw and the
    device counts on with the accumulator that may already be on flash (RAM - partial copy =
    exact events since)."""
    from pansketch.agent import storage

    if self._pending is not None:
        return False
    try:
        self._fresh()
    except Exception as exc:
        self.log("cannot draw noise (%r); state not persisted" % (exc,))
        return False
    try:
        storage.write_state(self.state_path, self._fps[0], self.seq, self.elo, self.ehi, self.part, self.nz,
                            self.counters)
    except OSError as exc:
        self._wipe()
        self.log("cannot persist state (%s); counting continues in RAM" % (exc,))
        return False
    self._add_fresh()
    if now is not None:
        self.last_persist = now
    return True


def _release_before_issue18(self, next_epoch, next_part, now=None):  # type: ignore[no-untyped-def]
    """Recorder._release before the failed-write fix: a failed commit deletes the .tmp (state + Z_out, on flash
    all the same) and keeps counting into the same accumulator with no fresh draw."""
    from pansketch.agent import release, storage

    rel = self.relbuf
    try:
        self._stage_release(rel)
    except Exception as exc:
        self._wipe()
        self.log("cannot draw the output noise of release %d (%r); retrying" % (self.seq, exc))
        return False
    s = self.seq
    tmp = self.outbox.path(s, ".tmp")
    nz = self.nz + 1
    inoise = self.p.internal_noise(self.sh)
    try:
        if self.outbox.full():
            raise OSError("outbox holds its limit of %d releases" % self.outbox.limit)
        storage.write_atomic(
            tmp, lambda write: release.encode_to(self.p, s, self.elo, self.ehi, self.part, rel, write, nz, 0, inoise))
        storage.write_marker(self.marker_path, s, self.elo, self.ehi, self.part)
    except OSError as exc:
        self._wipe()
        storage.remove(tmp)
        if next_part == 0 and next_epoch + 1 > self.ehi:
            self.ehi = next_epoch + 1
        self.log("cannot write release %d (%s); epochs now [%d, %d)" % (s, exc, self.elo, self.ehi))
        return False
    storage.rename(tmp, self.outbox.path(s))
    self.seq = s + 1
    if now is not None:
        self.last_persist = now
    try:
        self._open(next_epoch, next_part)
    except Exception as exc:
        self.log("release %d committed, but the next accumulator's noise failed (%r); retrying" % (s, exc))
    return True


@contextlib.contextmanager
def _dbits_old_limit() -> Iterator[None]:
    """dbits before the exact ε limit: any eps <= 2 accepted (the 0-bit's reverse ratio 2/(2 - eps) unbounded)."""
    from pansketch.agent import dbits, params

    old = lambda num, den: 0 < num <= 2 * den  # noqa: E731
    with _patch(params, "dbits_eps_ok", old), _patch(dbits, "dbits_eps_ok", old):
        yield


@contextlib.contextmanager
def _retried_opens_unnoised() -> Iterator[None]:
    """The accumulator opened right after a release whose range grew (a failed commit or a full
    outbox, then the retry) starts from zeros: no Z_int, so an intrusion in that window reads the
    events since exactly. Every other accumulator is noised as usual."""
    real_open = Recorder._open
    skip = [0]
    real_draw = accum.draw_into

    def draw_into(arr, spec, rng):  # type: ignore[no-untyped-def]
        if skip[0]:
            noise.zero(arr)
            return
        real_draw(arr, spec, rng)

    def _open(self, epoch, part):  # type: ignore[no-untyped-def]
        # at entry elo/ehi still name the range just released (unset at boot)
        grown = getattr(self, "ehi", None) is not None and self.ehi - self.elo > 1
        skip[0] += int(grown)
        try:
            return real_open(self, epoch, part)
        finally:
            skip[0] -= int(grown)

    with _patch(accum, "draw_into", draw_into), _patch(Recorder, "_open", _open):
        yield


FAULT_CONTROLS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "failed-persist-no-fresh-draw": lambda: _patch(Recorder, "persist", _persist_before_issue18),
    "failed-commit-same-accumulator": lambda: _patch(Recorder, "_release", _release_before_issue18),
    "retried-accumulator-unnoised": _retried_opens_unnoised,
}
FAULT_CONTROL_SCENARIOS = {
    "failed-persist-no-fresh-draw": ["persist-fail-mid-counters", "persist-fail-before-trailer"],
    "failed-commit-same-accumulator": ["commit-fail-at-marker", "commit-fail-at-close"],
    "retried-accumulator-unnoised": ["retry-grown-next", "retry-grown-next-at-close"],
}

DESCRIPTIONS = {
    "output-noise-skipped": "release = state, no Z_out",
    "internal-noise-skipped": "accumulator opens at zero, no Z_int",
    "fresh-draw-skipped": "no fresh draw Y after a persist",
    "scale-halved": "calibration returns t/2 (dgauss: σ/2)",
    "scratch-not-wiped": "intruder view, bug 1: Y stays in `relbuf`",
    "rng-tail-kept": "intruder view, bug 2: `Rng` keeps its buffer and tail",
    "event-count-kept": "an exact event count attribute in RAM",
    "shadow-g-skipped": "shadow: a persist never adds the fresh G to M (R − M − S = exact events)",
    "shadow-refresh-scale": "shadow: Z_int and the G's at `p.noise` (L arrays), not `p.inoise` (2L)",
    "failed-persist-no-fresh-draw": "failed write: a failed state write wipes its draw, RAM counts on (partial copy kept)",
    "failed-commit-same-accumulator": "failed commit: a failed commit deletes the .tmp and counts on with no fresh draw",
    "retried-accumulator-unnoised": "the accumulator after a retried release with a grown range opens at zero",
}
SCENARIOS = ["before-persist", "after-last-persist"]
CFG = {"device": "audit", "salt": "audit-salt-1", "kind": "cms", "d": 2, "w": 4, "mode": "window",
       "window_s": 600, "mechanism": "dlap", "budget": "1/2", "persist_s": 86400}
SHADOW_CFG = dict(CFG, persist_s=60, persist_noise="shadow")
SHADOW_SCENARIOS = ["before-persist", "between-persists", "after-last-persist"]


def power(trials: int = 100000, real_trials: int = 5000, kinds: list[str] | None = None,
          cfgs: dict[str, dict[str, object]] | None = None) -> None:
    """Print the power table of docs/PRIVACY.md ("Power"): per kind, the intrusion view's bound on the
    sound core and with the noise scale halved, and the time each audit took."""
    import time

    from pansketch.agent.params import Params
    from pansketch.host_tools.audit import engine

    cfgs = cfgs or POWER_CFGS
    print("| kind | touched cells | claimed ε | sound: ε lower bound | scale halved: ε lower bound | trials | "
          "time per audit | statistic (halved) |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in kinds or list(cfgs):
        cfg = cfgs[kind]
        names = ["no-persist"] if cfg["kind"] == "dbits" else ["before-persist", "after-last-persist"]
        out = []
        for ctl in (contextlib.nullcontext, KIND_HALVED[kind.split("-")[0]]):
            t = time.time()
            with ctl():
                p = Params(cfg)
                _, (r,) = engine.audit(p, views=["intrusion"], trials=trials, real_trials=real_trials,
                                       verify_trials=1, scenario_names=names)
            out.append((r, time.time() - t))
        (r0, t0), (r1, t1) = out
        from pansketch.host_tools.audit import device

        cells = len(device.target_cells(Params(cfg), device.target_item(Params(cfg)))) if cfg["kind"] != "dbits" else 1
        print("| %s | %d | %.3f | %.3f | **%.3f**%s | %d | %.0f s, %.0f s | `%s` |"
              % (kind, cells, r0.eps_claimed, r0.eps_lower, r1.eps_lower, "" if r1.flagged else " (not flagged)",
                 r1.trials, t0, t1, r1.statistic), flush=True)


# the power benchmark: the CI configurations, the strhh and dcs defaults (len 12 x 5 rows, b = 16 x 2 rows)
# and dbits at eps = 1/2
POWER_CFGS: dict[str, dict[str, object]] = dict(
    KIND_CFGS, **{"strhh-default": dict(CFG_BASE, kind="strhh", d=5, len=12),
                  "dcs-b16": dict(CFG_BASE, kind="dcs", d=2, b=16, map=[1, 1, 0]),
                  "dbits-1/2": dict(CFG_BASE, kind="dbits", d=4)})


def main() -> None:
    """Print the controls table of docs/PRIVACY.md ("Negative controls"); with --power, the power
    table ("Power": every kind, sound and with the noise scale halved)."""
    import sys

    from pansketch.agent.params import Params
    from pansketch.host_tools.audit import engine

    if "--power" in sys.argv[1:]:
        kinds = [a for a in sys.argv[1:] if not a.startswith("-")]
        power(kinds=kinds or None)
        return

    print("| control | defect | claimed ε | measured ε lower bound | trials | path | statistic |")
    print("|---|---|---|---|---|---|---|")
    runs = [(n, c, CFG, SCENARIOS) for n, c in CONTROLS.items()]
    runs += [(n, c, SHADOW_CFG, SHADOW_SCENARIOS) for n, c in SHADOW_CONTROLS.items()]
    runs += [(n, c, CFG, FAULT_CONTROL_SCENARIOS[n]) for n, c in FAULT_CONTROLS.items()]
    for name, ctl, cfg, names in runs:
        with ctl():
            p = Params(cfg)
            _, (r,) = engine.audit(p, views=["intrusion"], trials=100000, real_trials=1000, verify_trials=3,
                                   scenario_names=names)
        print("| `%s` | %s | %.1f | **%.2f** | %d | %s | %s: `%s` (fp %d, fn %d) |"
              % (name, DESCRIPTIONS[name], r.eps_claimed, r.eps_lower, r.trials, r.path, r.scenario.split(" (")[0],
                 r.statistic, r.fp, r.fn), flush=True)


if __name__ == "__main__":
    main()
