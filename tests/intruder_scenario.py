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

from agent import storage
from agent.params import Params
from agent.recorder import Recorder
from agent.rng import DeterministicSource, Rng

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
    if isinstance(v, (bytes, bytearray, array.array, list, tuple)):
        out = []
        for x in v:
            out.append(_plain(x))
        return out
    return "<%s>" % type(v).__name__


def _attrs(obj, skip):
    out = {}
    for k in obj.__dict__:
        if k not in skip:
            out[k] = _plain(obj.__dict__[k])
    return out


def snapshot(op, rec, n_events, root):
    flash = None
    buf = array.array("i", bytes(4 * rec.p.cells))
    try:
        if storage.read_state(storage.join(root, "state.bin"), rec._fp, buf) is not None:
            flash = list(buf)
    except Exception:
        flash = None
    return {
        "op": op,
        "events": n_events,
        "rec": _attrs(rec, ("p", "rng", "sketch", "log", "outbox")),
        "sketch": _attrs(rec.sketch, ("counters",)),
        "rng": _attrs(rec.rng, ("source",)),
        "flash": flash,
    }


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
    rng = Rng(DeterministicSource(seed))
    quiet = lambda m: None  # noqa: E731
    rec = Recorder(p, root, T0, rng=rng, log=quiet)
    stream = []
    snaps = [snapshot("boot", rec, 0, root)]

    def add(step):
        for x in events_for(step, p.kind):
            rec.add(x)
            stream.append(x)
        snaps.append(snapshot("add", rec, len(stream), root))

    add(1)
    rec.persist(T0 + 10)
    snaps.append(snapshot("persist", rec, len(stream), root))
    add(2)
    rec.persist(T0 + 20)
    snaps.append(snapshot("persist", rec, len(stream), root))
    add(3)
    # power cut and restart: RAM is gone, the device boots on its flash
    rec = Recorder(p, root, T0 + 30, rng=Rng(DeterministicSource(seed + "-boot")), log=quiet)
    snaps.append(snapshot("restart", rec, len(stream), root))
    add(4)
    rec.tick(T0 + 60)  # epoch end: release 0
    snaps.append(snapshot("release", rec, len(stream), root))
    add(5)
    rec.persist(T0 + 70)
    snaps.append(snapshot("persist", rec, len(stream), root))
    add(6)
    rec.flush(T0 + 80)  # early release (part 0), the epoch goes on as part 1
    snaps.append(snapshot("flush", rec, len(stream), root))
    add(7)
    rec.tick(T0 + 120)
    snaps.append(snapshot("release", rec, len(stream), root))
    add(8)
    return {"snaps": snaps, "stream": stream}


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
        from agent.tree import read_tree_state

        if read_tree_state(storage.join(root, "state.bin"), rec._fp, bufs) is not None:
            flash = []
            for b in bufs:
                flash.append(list(b))
    except Exception:
        flash = None
    return {
        "op": op,
        "events": n_events,
        "rec": _attrs(rec, ("p", "rng", "sketch", "log", "outbox")),
        "sketch": _attrs(rec.sketch, ("counters", "arrays")),
        "arrays": len(rec.sketch.arrays),
        "rng": _attrs(rec.rng, ("source",)),
        "flash": flash,
    }


def run_tree(root, seed, cfg=None):
    """A tree-mode device: adds, persists, a restart mid-node, node releases
    at epoch ends (levels 0, 1 and 2 close together at epoch 4), a flush."""
    from agent.recorders import make

    p = Params(cfg if cfg is not None else CFG_TREE)
    quiet = lambda m: None  # noqa: E731
    rec = make(p, root, T0, rng=Rng(DeterministicSource(seed)), log=quiet)
    stream = []
    snaps = [tree_snapshot("boot", rec, 0, root)]

    def add(step):
        for x in events_for(step):
            rec.add(x)
            stream.append(x)
        snaps.append(tree_snapshot("add", rec, len(stream), root))

    add(1)
    rec.persist(T0 + 10)
    snaps.append(tree_snapshot("persist", rec, len(stream), root))
    add(2)
    rec.tick(T0 + 60)  # leaf [0, 1)
    snaps.append(tree_snapshot("release", rec, len(stream), root))
    add(3)
    rec.persist(T0 + 70)
    snaps.append(tree_snapshot("persist", rec, len(stream), root))
    add(4)
    # power cut and restart mid-node
    rec = make(p, root, T0 + 90, rng=Rng(DeterministicSource(seed + "-boot")), log=quiet)
    snaps.append(tree_snapshot("restart", rec, len(stream), root))
    add(5)
    rec.tick(T0 + 120)  # leaf [1, 2) and level-1 node [0, 2)
    snaps.append(tree_snapshot("release", rec, len(stream), root))
    add(6)
    rec.tick(T0 + 180)  # leaf [2, 3)
    snaps.append(tree_snapshot("release", rec, len(stream), root))
    add(7)
    rec.persist(T0 + 200)
    snaps.append(tree_snapshot("persist", rec, len(stream), root))
    add(8)
    rec.tick(T0 + 240)  # leaf [3, 4), [2, 4), root [0, 4)
    snaps.append(tree_snapshot("release", rec, len(stream), root))
    add(9)
    rec.flush(T0 + 250)  # early release of all three open nodes; they go on as part 1
    snaps.append(tree_snapshot("flush", rec, len(stream), root))
    add(10)
    return {"snaps": snaps, "stream": stream}
