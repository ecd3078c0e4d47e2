"""Failure paths of the device core under a keep-every-byte flash model.

Runs on CPython and on the MicroPython Unix port (MicroPython subset: no
f-strings, no dataclasses). Used by tests/test_failpaths.py.

The flash model (:class:`Flash`) replaces ``open`` for writing inside
``pansketch.agent.storage`` (every state, marker and release write goes through
``storage.write_atomic``) and wraps ``storage.rename``. It keeps every byte
ever handed to a file -- partial writes, files removed or renamed over
afterwards -- which is what raw NOR/NAND flash, littlefs/FAT free blocks and
a deleted file's sectors give an intruder (docs/PRIVACY.md "Failed writes").

Failure injection: the writes of one run are cut into *stages*; stage
``fail_at`` raises ``exc`` (OSError ENOSPC/EIO or MemoryError) once:

* ``open``   -- before the file is created;
* ``pre``    -- before a counters array (tree: each level's array) is written;
* ``mid``    -- half of a counters array written, then the failure;
* ``post``   -- the array written, the next chunk (trailer / rest of the release) not;
* ``flush``  -- everything written, the flush fails;
* ``rename`` -- the file complete, the rename fails (``write_atomic``'s, and
  the outbox's ``.tmp`` -> ``.cbor`` after the marker).

The marker file is a write of its own, so "at the marker" is its ``open``.

Noise injection: ``pansketch.agent.noise.NoiseSpec.sample`` is replaced by a wide
uniform draw from the run's (deterministic) Rng, so a run with events and
one without, on the same seed and the same failure, hold the same noise
everywhere: their difference in any array is the exact event part of it.
"""

import array

from pansketch.agent import noise, storage

try:
    import builtins
except ImportError:  # pragma: no cover
    import __builtin__ as builtins  # noqa: F401

_OPEN = builtins.open
_RENAME = storage.rename
_SAMPLE = noise.NoiseSpec.sample
_FSYNC = storage._fsync
WIDE = 1 << 20


SAMPLES = []  # (variance num, den, value) of every draw while recording (CPython side of the tests)
RECORD = [False]


def _wide_sample(self, rng):
    v = rng.randbelow(2 * WIDE) - WIDE
    if RECORD[0]:
        SAMPLES.append((self.num, self.den, v))
    return v


class Injected(Exception):
    pass


class Flash:
    """Every write session: [path, op, [(cells or None, intended_len, written_bytes)]]."""

    def __init__(self, fail_at=-1, exc="enospc", fail_len=1):
        self.fail_len = fail_len  # > 1: the flash stays full for that many stages
        self.sessions = []
        self.stage = 0
        self.stages = []  # (stage index, kind, path) as they happen
        self.fail_at = fail_at
        self.exc = exc
        self.op = 0
        self.failed = None

    def _raise(self):
        if self.exc == "memory":
            raise MemoryError("injected")
        if self.exc == "eio":
            raise OSError(5, "EIO (injected)")
        raise OSError(28, "ENOSPC (injected)")

    def point(self, kind, path):
        """A stage: True if the failure is injected here."""
        s = self.stage
        self.stage += 1
        self.stages.append((s, kind, path))
        if self.fail_at <= s < self.fail_at + self.fail_len:
            if self.failed is None:
                self.failed = (s, kind, path)
            return True
        return False

    def open(self, path, mode="r", *args):
        if "w" not in mode:
            return _OPEN(path, mode, *args)
        if self.point("open", path):
            self._raise()
        f = _OPEN(path, mode, *args)
        sess = [path, self.op, []]
        self.sessions.append(sess)
        return _File(self, f, sess)

    def rename(self, src, dst):
        if self.point("rename", dst):
            self._raise()
        return _RENAME(src, dst)

    def install(self):
        storage.open = self.open
        storage.rename = self.rename
        storage._fsync = None  # the model keeps every byte anyway; a real fsync only costs time
        noise.NoiseSpec.sample = _wide_sample

    @staticmethod
    def uninstall():
        try:
            del storage.open
        except (AttributeError, KeyError):
            pass
        storage.rename = _RENAME
        noise.NoiseSpec.sample = _SAMPLE
        storage._fsync = _FSYNC


class _File:
    def __init__(self, flash, f, sess):
        self.fl = flash
        self.f = f
        self.sess = sess
        self.after_array = False

    def write(self, b):
        fl = self.fl
        path = self.sess[0]
        is_arr = isinstance(b, array.array)
        if is_arr:
            if fl.point("pre", path):
                fl._raise()
            if fl.point("mid", path):
                half = (len(b) // 2) * 4
                self.f.write(_raw(b)[:half])
                self.sess[2].append((list(b)[: len(b) // 2], len(b), half))
                fl._raise()
        elif self.after_array:
            if fl.point("post", path):
                fl._raise()
        self.after_array = is_arr
        n = self.f.write(b)
        self.sess[2].append((list(b) if is_arr else None, len(b), len(b)))
        return n

    def flush(self):
        if self.fl.point("flush", self.sess[0]):
            self.fl._raise()
        return self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def close(self):
        return self.f.close()


def _raw(a):
    out = bytearray(4 * len(a))
    for i in range(len(a)):
        v = a[i] & 0xFFFFFFFF
        out[4 * i] = v & 0xFF
        out[4 * i + 1] = (v >> 8) & 0xFF
        out[4 * i + 2] = (v >> 16) & 0xFF
        out[4 * i + 3] = (v >> 24) & 0xFF
    return bytes(out)


def _ram(rec):
    """The arrays of RAM an intruder reads: accumulator(s), shadow(s), scratch."""
    out = []
    if hasattr(rec, "nodes"):
        for a in rec.nodes:
            out.append(list(a))
        for m in rec.shadows:
            if m is not None:
                out.append(list(m))
    else:
        out.append(list(rec.counters))
        if getattr(rec, "shadow", None) is not None:
            out.append(list(rec.shadow))
    out.append(list(rec.relbuf))
    return out


def items(step, kind, events):
    if events is False or events is None:
        return []
    if events is not True:  # an int: one "target" event at that operation only
        return ["target"] if step == events else []
    if kind == "dcs":
        out = ["13.5", "13.5"]
        for i in range(step % 3 + 1):
            out.append("%d.25" % (10 + (step * 7 + i) % 8))
        return out
    out = ["target", "target"]
    for i in range(step % 3 + 1):
        out.append("item-%d" % ((step * 7 + i) % 11))
    return out


T0 = 1800 * 1000000  # aligned to every epoch length used here
EP = 600


def run(cfg, root, seed, events, fail_at=-1, exc="enospc", fail_len=1):
    """One run of a fixed schedule (adds, persists, releases, a flush) with
    the failure at stage ``fail_at``. Returns (views, flash, zero_ok):
    ``views`` = list of (op, RAM arrays after op); flash = the Flash."""
    from pansketch.agent.params import Params
    from pansketch.agent.recorders import make
    from pansketch.agent.rng import DeterministicSource, Rng

    p = Params(cfg)
    fl = Flash(fail_at, exc, fail_len)
    fl.install()
    views = []
    scratch_dirty = 0
    try:
        rec = make(p, root, T0, rng=Rng(DeterministicSource(seed)), log=lambda m: None)
        tree = p.mode == "tree"
        sched = [("p", 200), ("p", 400), ("r", 600), ("p", 800), ("f", 900), ("p", 1000), ("r", 1200),
                 ("p", 1400), ("r", 1800), ("p", 2000), ("r", 2400)]
        step = 0
        for what, dt in sched:
            step += 1
            fl.op = step
            for x in items(step, p.kind, events):
                rec.add(x)
            now = T0 + dt
            try:
                if what == "p":
                    rec.tick(now)  # persists when persist_s has passed since the last persist
                elif what == "f":
                    rec.flush(now)
                else:
                    if not tree:
                        rec.persist(now)  # as the firmware does before a commit
                    rec.tick(now)
            except Exception as e:  # noqa: F841  (a failure the core did not handle: the firmware's loop goes on)
                pass
            if any(rec.relbuf):
                scratch_dirty += 1
            views.append((step, _ram(rec)))
    finally:
        Flash.uninstall()
    import os

    fl.published = sorted(int(n[:10]) for n in os.listdir(storage.join(root, "outbox")) if n.endswith(".cbor"))
    return views, fl, scratch_dirty


def dump(cfg, root, seed, events, fail_at=-1, exc="enospc", fail_len=1):
    """run() as one JSON line (for the MicroPython side of the test)."""
    import json

    views, fl, dirty = run(cfg, root, seed, events, fail_at, exc, fail_len)
    sess = []
    for path, op, chunks in fl.sessions:
        sess.append([path, op, [c[0] for c in chunks if c[0] is not None]])
    return json.dumps({"views": views, "sessions": sess, "stages": len(fl.stages), "dirty": dirty,
                       "published": fl.published,
                       "failed": list(fl.failed) if fl.failed else None})
