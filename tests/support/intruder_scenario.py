"""A device run with an intruder's snapshot after every operation.

Runs unchanged on CPython and in the MicroPython VM (MicroPython subset:
no f-strings, typing or dataclasses). ``run(root, seed)`` drives a
``Recorder`` through adds, persists, a restart and releases (window
boundary, early flush and epoch end) and returns one snapshot per
operation: every attribute of the Recorder, its Sketch and its Rng (the
byte source excepted: tests inject a deterministic one, a device's
``os.urandom`` holds no buffer of ours), plus the ``state.bin`` counters on
flash at that moment. tests/test_intruder_view.py decides what an
intruder can compute from them (docs/PRIVACY.md, "The intruder's view").
"""

import array

from pansketch.agent import storage
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng

T0 = 200000 * 3600
CFG = {"device": "dev-x", "salt": "fleet-salt-1", "kind": "cms", "d": 4, "w": 32, "mode": "keep",
       "window_s": 600, "epoch_s": 60, "mechanism": "dlap", "budget": "1/2", "persist_s": 86400}
# the same scenario for kind dcs (agent/dcs.py): 5 levels x 4 x 8, level 0 hashed, levels 1-4 exact-indexed
CFG_DCS = {"device": "dev-x", "salt": "fleet-salt-1", "kind": "dcs", "b": 4, "map": [2, 1, 10], "d": 4, "w": 8,
           "mode": "keep", "window_s": 600, "epoch_s": 60, "mechanism": "dlap", "budget": "1/2", "persist_s": 86400}

# the same two under persist_noise = "shadow" (the accumulator is never written; a pure-noise
# shadow gives the flash track, agent/recorder.py)
CFG_SHADOW = dict(CFG)
CFG_SHADOW["persist_noise"] = "shadow"
CFG_DCS_SHADOW = dict(CFG_DCS)
CFG_DCS_SHADOW["persist_noise"] = "shadow"


def _plain(v):
    """JSON-able copy of an attribute value (arrays and byte buffers as int lists)."""
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, (bytes, bytearray, array.array, list, tuple, memoryview)):
        out = []
        for x in v:
            out.append(_plain(x))
        return out
    return "<%s>" % type(v).__name__


# CPython's Sketch keeps these behind properties (agent/sketch.py, Sketch._bind)
_PROPERTY_STORE = {"_counters": "counters", "_arrays": "arrays"}


def _attrs(obj, skip):
    out = {}
    for k in obj.__dict__:
        name = _PROPERTY_STORE.get(k, k)
        if name not in skip:
            out[name] = _plain(obj.__dict__[k])
    return out


def _view(op, rec, n_events, flash, sketch_skip):
    return {
        "op": op,
        "events": n_events,
        "rec": _attrs(rec, ("p", "rng", "sketch", "log", "outbox")),
        "sketch": _attrs(rec.sketch, sketch_skip),
        "rng": _attrs(rec.rng, ("source",)),
        "flash": flash,
    }


def snapshot(op, rec, n_events, root):
    flash = None
    buf = array.array("i", bytes(4 * rec.p.cells))
    try:
        if storage.read_state(storage.join(root, "state.bin"), rec._fp, buf) is not None:
            flash = list(buf)
    except Exception:
        flash = None
    return _view(op, rec, n_events, flash, ("counters",))


class _Run:
    """A recorder driven through a scenario, with a snapshot (``snap``) after every operation."""

    def __init__(self, rec, root, snap, kind="cms"):
        self.rec = rec
        self.root = root
        self.snap = snap
        self.kind = kind
        self.stream = []
        self.snaps = [snap("boot", rec, 0, root)]

    def note(self, op):
        self.snaps.append(self.snap(op, self.rec, len(self.stream), self.root))

    def add(self, step):
        for x in events_for(step, self.kind):
            self.rec.add(x)
            self.stream.append(x)
        self.note("add")

    def op(self, name, fn, t):
        """fn(t): a persist, tick or flush of the recorder."""
        fn(t)
        self.note(name)

    def result(self):
        return {"snaps": self.snaps, "stream": self.stream}


def _quiet(m):
    pass


def events_for(step, kind="cms"):
    """The events of one step: the target item three times and a few others
    (for kind dcs: readings, the target 13.5 and a few values in [10, 18))."""
    if kind == "dcs":
        out = ["13.5", "13.5", "13.5"]
        for i in range(step % 3 + 1):
            out.append("%d.25" % (10 + (step * 7 + i) % 8))
        return out
    out = ["target", "target", "target"]
    for i in range(step % 3 + 1):
        out.append("item-%d" % ((step * 7 + i) % 5))
    return out


def run(root, seed, cfg=None):
    p = Params(cfg if cfg is not None else CFG)
    r = _Run(Recorder(p, root, T0, rng=Rng(DeterministicSource(seed)), log=_quiet), root, snapshot, p.kind)
    r.add(1)
    r.op("persist", r.rec.persist, T0 + 10)
    r.add(2)
    r.op("persist", r.rec.persist, T0 + 20)
    r.add(3)
    # power cut and restart: RAM is gone, the device boots on its flash
    r.rec = Recorder(p, root, T0 + 30, rng=Rng(DeterministicSource(seed + "-boot")), log=_quiet)
    r.note("restart")
    r.add(4)
    r.op("release", r.rec.tick, T0 + 60)  # epoch end: release 0
    r.add(5)
    r.op("persist", r.rec.persist, T0 + 70)
    r.add(6)
    r.op("flush", r.rec.flush, T0 + 80)  # early release (part 0), the epoch goes on as part 1
    r.add(7)
    r.op("release", r.rec.tick, T0 + 120)
    r.add(8)
    return r.result()


# -- tree mode (agent/tree.py) -------------------------------------------------
CFG_TREE = {"device": "dev-t", "salt": "fleet-salt-1", "kind": "cms", "d": 4, "w": 32, "mode": "tree",
            "levels": 3, "epoch_s": 60, "mechanism": "dlap", "budget": "1/2", "persist_s": 86400}
CFG_TREE_SHADOW = dict(CFG_TREE)
CFG_TREE_SHADOW["persist_noise"] = "shadow"


def tree_snapshot(op, rec, n_events, root):
    """Every attribute of a TreeRecorder, its Sketch and Rng, and every
    accumulator of the state file on flash at that moment."""
    flash = None
    bufs = []
    for _ in range(rec.p.levels):
        bufs.append(array.array("i", bytes(4 * rec.p.d * rec.p.w)))
    try:
        from pansketch.agent.tree import read_tree_state

        if read_tree_state(storage.join(root, "state.bin"), rec._fp, bufs) is not None:
            flash = []
            for b in bufs:
                flash.append(list(b))
    except Exception:
        flash = None
    v = _view(op, rec, n_events, flash, ("counters", "arrays"))
    v["arrays"] = len(rec.sketch.arrays)
    return v


def run_tree(root, seed, cfg=None):
    """A tree-mode device: adds, persists, a restart mid-node, node releases
    at epoch ends (levels 0, 1 and 2 close together at epoch 4), a flush."""
    from pansketch.agent.recorders import make

    p = Params(cfg if cfg is not None else CFG_TREE)
    r = _Run(make(p, root, T0, rng=Rng(DeterministicSource(seed)), log=_quiet), root, tree_snapshot)
    r.add(1)
    r.op("persist", r.rec.persist, T0 + 10)
    r.add(2)
    r.op("release", r.rec.tick, T0 + 60)  # leaf [0, 1)
    r.add(3)
    r.op("persist", r.rec.persist, T0 + 70)
    r.add(4)
    # power cut and restart mid-node
    r.rec = make(p, root, T0 + 90, rng=Rng(DeterministicSource(seed + "-boot")), log=_quiet)
    r.note("restart")
    r.add(5)
    r.op("release", r.rec.tick, T0 + 120)  # leaf [1, 2) and level-1 node [0, 2)
    r.add(6)
    r.op("release", r.rec.tick, T0 + 180)  # leaf [2, 3)
    r.add(7)
    r.op("persist", r.rec.persist, T0 + 200)
    r.add(8)
    r.op("release", r.rec.tick, T0 + 240)  # leaf [3, 4), [2, 4), root [0, 4)
    r.add(9)
    r.op("flush", r.rec.flush, T0 + 250)  # early release of all three open nodes; they go on as part 1
    r.add(10)
    return r.result()
