"""Run the real device core on a scenario and record everything an intruder can read.

Nothing here re-implements the device: :func:`run` drives
:class:`pansketch.agent.recorder.Recorder` (the module a board runs) through the
scenario's operations, on a real directory (``state.bin``, ``released``,
``outbox/``), and after every operation records

* every attribute of the Recorder, its Sketch and its Rng (the "RAM"):
  ``array('i')`` attributes as integer arrays (the accumulator, the scratch
  buffer, and any array a future version adds), byte buffers as bytes (the
  Rng's CSPRNG buffer), everything else as its ``repr``;
* every file image written so far (:class:`FlashLog`: a copy-on-write flash
  that keeps every byte ever written -- each ``state.bin.new``, each outbox
  ``.tmp``, also when the write failed part way or the file was removed;
  a write that was attempted counts as written);

and at the end every release, read back from the outbox with ``cbor2`` (the
bytes a broker would receive). The CSPRNG bytes each ``Rng`` reads are
recorded (:class:`RecordingSource`), so :func:`decode_draws` can replay them
through the device's own samplers and name every noise draw.

A run may draw noise of several distributions (``persist_noise = "shadow"``:
the internal noise at the calibration of 2x the arrays, the output noise at
that of the arrays). While :func:`run` drives the device, the auditor wraps
``NoiseSpec.sample`` (audit-only instrumentation, restored afterwards; the
device code is unchanged) and records, per Rng instance, the distribution of
every sample actually drawn (:attr:`Run.specs`, run-length encoded). The
replay then uses each draw's own distribution. Wrapping the sampler rather
than ``add_noise`` records what was really drawn, also when a negative
control patches ``add_noise`` to skip a draw.
"""

from __future__ import annotations

import array
import builtins
import copy
import errno
import math
import os
import struct
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pansketch.agent import hashing, noise, storage
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.recorders import make
from pansketch.agent.rng import NoEntropyError, Rng

from pansketch.host_tools import cborscan
from pansketch.host_tools.audit.scenarios import Scenario

# Recorder/Sketch/Rng attributes that are objects, not data (they are walked
# separately or hold no state of the data: config, log function, file paths).
_SKIP = {"p", "rng", "sketch", "log", "outbox", "source"}
_PROPERTY_STORE = {"_counters": "counters", "_arrays": "arrays"}  # CPython's Sketch keeps these behind properties


class RecordingSource:
    """A byte source that keeps a copy of every byte it hands out (audit only)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.data = bytearray()

    def read(self, n: int) -> bytes:
        b = self.base.read(n)
        self.data += b
        return b


class ReplaySource:
    """Replays recorded bytes; short reads at the end make the Rng raise NoEntropyError."""

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.pos = 0

    def read(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


def _rng_state(rng: Rng) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in rng.__dict__.items() if k != "source"))


def spec_key(spec: Any) -> tuple:
    """A hashable, exact identity of a noise distribution (mechanism, reduced parameter)."""
    g = math.gcd(spec.num, spec.den)
    return (spec.mech, spec.num // g, spec.den // g)


SpecRuns = list  # [[spec, count], ...]: consecutive samples of one distribution, in draw order


@dataclass
class Decoded:
    """Noise draws of one Rng instance, in order, and the Rng state after each."""

    draws: list[int]
    states: list[tuple[int, tuple]]  # (bytes consumed, rng state) after 0, 1, ... draws
    specs: list[Any] = field(default_factory=list)  # the distribution of each draw (when recorded)


def decode_draws(spec: Any, data: bytes, specs: SpecRuns | None = None) -> Decoded:
    """Replay recorded CSPRNG bytes through the device's sampler (``spec.sample``).

    The samplers consume bytes in a fixed order, so this names every draw the
    device made, in order. Without ``specs`` every draw is replayed with
    ``spec`` until the bytes run out. With ``specs`` (the recorded run-length
    list of the distribution of each sample, :attr:`Run.specs`) exactly those
    samples are replayed, each with its own distribution; running out of bytes
    before that is an error (the recorded bytes do not explain the draws).
    """
    src = ReplaySource(data)
    rng = Rng(src)
    draws: list[int] = []
    states = [(0, _rng_state(rng))]
    per: list[Any] = []
    if specs is None:
        while True:
            try:
                x = spec.sample(rng)
            except NoEntropyError:
                break
            draws.append(x)
            per.append(spec)
            states.append((src.pos, _rng_state(rng)))
        return Decoded(draws, states, per)
    for sp, count in specs:
        for _ in range(count):
            x = sp.sample(rng)  # NoEntropyError: the bytes do not cover the recorded samples
            draws.append(x)
            per.append(sp)
            states.append((src.pos, _rng_state(rng)))
    return Decoded(draws, states, per)


class SpecRecorder:
    """Wraps ``NoiseSpec.sample`` while the device runs and records, per Rng
    instance (identified by its byte source), the distribution of every sample.

    Audit-only instrumentation: the class attribute is restored on exit, and
    the wrapped sampler is the device's own (same bytes, same draws).
    """

    def __init__(self) -> None:
        self.sources: list[Any] = []
        self.specs: list[SpecRuns] = []

    def add_source(self, src: Any) -> None:
        self.sources.append(src)
        self.specs.append([])

    def __enter__(self) -> "SpecRecorder":
        real = noise.NoiseSpec.sample
        self._real = real
        rec = self

        def sample(spec, rng):  # type: ignore[no-untyped-def]
            x = real(spec, rng)
            src = getattr(rng, "source", None)
            for i, s in enumerate(rec.sources):
                if s is src:
                    runs = rec.specs[i]
                    if runs and spec_key(runs[-1][0]) == spec_key(spec):
                        runs[-1][1] += 1
                    else:
                        runs.append([spec, 1])
                    break
            return x

        noise.NoiseSpec.sample = sample  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        noise.NoiseSpec.sample = self._real  # type: ignore[method-assign]


# -- the flash: every byte ever written --------------------------------------------

FAULT_TARGETS = ("state", "tmp", "marker")
# where a write fails (docs/PRIVACY.md "Empirical audit"); a "counters call" is a write of one
# whole array (4 * cells bytes: the state's counters, a tree level, a release's ctr)
FAULT_STAGES = ("before", "before-counters", "mid-counters", "after-counters", "before-trailer", "at-close")
FAULT_EXCS = ("enospc", "eio", "memory")


@dataclass
class Image:
    """One file as it reached flash: every byte written to it, in order, kept after a
    failure, a remove or a rename (a raw NOR/NAND or FAT/LittleFS free-block reader gets it)."""

    path: str  # relative to the state directory, as opened (e.g. "state.bin.new")
    data: bytearray
    failed: str = ""  # the exception that ended the write ("" if it completed)
    tail: bytes = b""  # the rest of the write call that failed: it may have reached flash too

    def attempted(self) -> bytes:
        """Every byte the device tried to write (docs/PRIVACY.md: a write that was attempted counts as written)."""
        return bytes(self.data) + self.tail


@dataclass(frozen=True)
class Fault:
    target: str  # "state" | "tmp" | "marker"
    stage: str
    exc: str = "enospc"

    def make(self) -> BaseException:
        if self.exc == "memory":
            return MemoryError("audit: injected MemoryError")
        code = errno.EIO if self.exc == "eio" else errno.ENOSPC
        return OSError(code, os.strerror(code))

    @classmethod
    def parse(cls, arg: str) -> "Fault":
        parts = arg.split(":")
        f = cls(parts[0], parts[1], parts[2] if len(parts) > 2 else "enospc")
        if f.target not in FAULT_TARGETS or f.stage not in FAULT_STAGES or f.exc not in FAULT_EXCS:
            raise ValueError("bad fault %r (target:stage[:exc] of %s, %s, %s)" % (arg, FAULT_TARGETS, FAULT_STAGES,
                                                                                FAULT_EXCS))
        return f


def _fault_matches(target: str, rel: str) -> bool:
    if target == "state":
        return rel.startswith("state.bin")
    if target == "tmp":
        return rel.endswith(".tmp") or rel.endswith(".tmp.new")
    return rel.startswith("released")


class LoggedFile:
    """A file opened for writing on the audited flash: every byte handed to ``write``
    that the failure plan lets through is kept in the Image (also if the write fails later)."""

    def __init__(self, f: Any, img: Image, fault: Fault | None, big: int) -> None:
        self._f = f
        self._img = img
        self._fault = fault
        self._big = big
        self._calls = 0
        self._seen_big = False
        self._after_big = False
        self._body: int | None = None  # a state file's length before its SHA-256 trailer

    def _fail(self, tail: bytes = b"") -> None:
        exc = self._fault.make()  # type: ignore[union-attr]
        self._img.failed = type(exc).__name__
        self._img.tail = tail
        self._fault = None
        raise exc

    def write(self, b: Any) -> int:
        data = bytes(b)
        ft = self._fault
        big = len(data) == self._big
        if ft is not None:
            st = ft.stage
            if st == "before" and self._calls == 0:
                self._fail(data)
            if st in ("before-counters", "mid-counters") and big and not self._seen_big:
                half = 0
                if st == "mid-counters":
                    half = (len(data) // 2) & ~3  # whole int32 words: half the array reaches flash
                    self._f.write(data[:half])
                    self._img.data += data[:half]
                self._fail(data[half:])
            if st == "after-counters" and self._after_big:
                self._fail(data)
            if st == "before-trailer" and self._body is not None and len(self._img.data) == self._body:
                self._fail(data)
        if self._calls == 0:
            self._body = _body_len(data)
        self._calls += 1
        self._after_big = self._seen_big or big  # the call after the first whole array
        self._seen_big = self._seen_big or big
        n = self._f.write(data)
        self._img.data += data
        return n

    def flush(self) -> None:
        if self._fault is not None and self._fault.stage == "at-close":
            self._fail()
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "LoggedFile":
        return self

    def __exit__(self, *a: Any) -> None:
        self.close()


def _body_len(first: bytes) -> int | None:
    """Bytes before the trailer of a state file, from its first write (the header); None otherwise."""
    from pansketch.agent import tree as tree_mod

    if first.startswith(storage.STATE_MAGIC) and len(first) >= storage._HDR_LEN:
        n = struct.unpack(storage._HDR, first[:storage._HDR_LEN])[-1]
        return storage._HDR_LEN + 4 * n
    if first.startswith(tree_mod.TREE_MAGIC) and len(first) >= tree_mod._THDR_LEN:
        f = struct.unpack(tree_mod._THDR, first[:tree_mod._THDR_LEN])
        L, n = f[2], f[-1]
        return tree_mod._THDR_LEN + L * tree_mod._TLVL_LEN + 4 * n * L
    return None


class FlashLog:
    """Copy-on-write flash for the audit: pansketch.agent.storage opens files through it
    (``storage.open`` shadows the builtin while a run lasts; audit-only, removed
    afterwards). Every file write becomes an :class:`Image`; armed faults make
    the next matching write fail at the chosen stage."""

    def __init__(self, root: str, big: int) -> None:
        self.root = root
        self.big = big
        self.images: list[Image] = []
        self.armed: list[Fault] = []
        self.fired: list[str] = []

    def open(self, path: str, mode: str = "r", *a: Any, **kw: Any) -> Any:
        f = builtins.open(path, mode, *a, **kw)
        if "w" not in mode and "a" not in mode:
            return f
        rel = path[len(self.root) + 1:] if path.startswith(self.root + "/") else path
        img = Image(rel, bytearray())
        self.images.append(img)
        fault = None
        for i, ft in enumerate(self.armed):
            if _fault_matches(ft.target, rel):
                fault = self.armed.pop(i)
                self.fired.append("%s:%s:%s" % (ft.target, ft.stage, ft.exc))
                break
        return LoggedFile(f, img, fault, self.big)


def _words(raw: bytes, n: int) -> np.ndarray:
    """n int32 LE cells from the bytes that reached flash; cells never written read 0."""
    k = min(len(raw) // 4, n)
    out = np.zeros(n, dtype=np.int64)
    if k:
        out[:k] = np.frombuffer(bytes(raw[:4 * k]), dtype="<i4").astype(np.int64)
    return out


def _cbor_ctr(data: bytes) -> tuple[int, int] | None:
    """(offset, length) of the ``ctr`` byte string of a (possibly partial) release encoding."""
    i = data.find(b"\x63ctr")
    if i < 0 or i + 4 >= len(data):
        return None
    j = i + 4
    h = data[j]
    if h >> 5 != 2:
        return None
    ai = h & 31
    if ai < 24:
        return j + 1, ai
    size = {24: 1, 25: 2, 26: 4, 27: 8}.get(ai)
    if size is None or j + 1 + size > len(data):
        return None
    return j + 1 + size, int.from_bytes(data[j + 1:j + 1 + size], "big")


def image_arrays(p: Params, img: Image) -> tuple[list[np.ndarray], tuple]:
    """The noisy arrays an intruder reads in one file image, and its other bytes (metadata).

    State files (pansketch.agent.storage, pansketch.agent.tree): header, then whole arrays of ``p.cells``
    int32 (one; L in tree mode), then a SHA-256 trailer (left out of the metadata: it
    is a function of the noisy arrays). Releases (``outbox/*.tmp`` and their renames):
    the CBOR ``ctr`` byte string. Marker files hold public keys only (metadata)."""
    from pansketch.agent import tree as tree_mod

    data = img.attempted()
    n = p.cells
    kind = img.path.split("/")[-1].split(".")[0] if "/" not in img.path else "outbox"
    if data.startswith(storage.STATE_MAGIC):
        hl = storage._HDR_LEN
        return [_words(data[hl:], n)], ("state", img.path, len(data), data[:hl], img.failed)
    if data.startswith(tree_mod.TREE_MAGIC):
        L = p.levels
        hl = tree_mod._THDR_LEN + L * tree_mod._TLVL_LEN
        arrs = [_words(data[hl + 4 * n * k:], n) for k in range(L)]
        return arrs, ("tree", img.path, len(data), data[:hl], img.failed)
    loc = _cbor_ctr(data)
    if loc is not None:
        off, ln = loc
        cells = ln // 4
        meta = data[:off] + data[off + ln:]
        return [_words(data[off:off + ln], cells)], ("release", img.path, len(data), meta, img.failed)
    return [], (kind, img.path, len(data), data, img.failed)


@dataclass
class Moment:
    """The device between two calls: what one intrusion reads from RAM."""

    label: str
    arrays: dict[str, np.ndarray]  # array('i') attributes (int64 copies)
    buffers: dict[str, bytes]  # byte-buffer attributes
    meta: dict[str, str]  # every other attribute, as repr
    n_flash: int  # state.bin versions written so far
    rng: Rng  # a copy of the Rng without its source (for prediction)
    instance: int  # which Rng instance (boots) is live
    consumed: int  # bytes that instance's source has handed out


@dataclass
class Run:
    moments: list[Moment]
    flash: list[np.ndarray]
    flash_meta: list[tuple]
    releases: list[np.ndarray]
    release_meta: list[dict[str, Any]]
    streams: list[bytes]
    cells: list[tuple[int, int]] = field(default_factory=list)  # (index, sign) of the target's cells
    specs: list[SpecRuns] | None = None  # per Rng instance: the distribution of every sample drawn
    errors: list[str] = field(default_factory=list)  # exceptions the device raised (the firmware goes on)
    fired: list[str] = field(default_factory=list)  # injected faults that triggered


def target_item(p: Params) -> str:
    """The target item of the neighbouring streams.

    cms/cs: an item whose row-0 cell is cell 0 (the first draw of every noise
    array); any item is a valid target, this one also exposes the Rng-buffer
    attack on a kept RNG tail (a kept tail predicts the next draw, which is cell 0's).
    dcs: the reading that maps to domain value 1 under the configured ``map``
    (it touches one node per level, b + 1 levels). dbits: any item.
    """
    if p.kind == "dcs":
        num, den, off = p.map
        return "%d" % (off + -(-den // num))  # smallest reading with floor((r - off) num / den) >= 1
    if p.kind in ("dbits", "strhh"):  # strhh: any item touches one node per prefix level
        return "audit-target-0"
    prefix = hashing.salt_prefix(p.salt)
    for i in range(100000):
        item = "audit-target-%d" % i
        if hashing.columns(prefix, item, p.d, p.w)[0][0] == 0:
            return item
    raise RuntimeError("no target item found")


def background_item(p: Params, i: int) -> str:
    """The i-th background event's item (a reading in the domain for dcs)."""
    if p.kind == "dcs":
        num, den, off = p.map
        return "%d" % (off + den * (2 + i % 5))
    return "audit-bg-%d" % (i % 5)


def target_cells(p: Params, item: str) -> list[tuple[int, int]]:
    """(cell, sign) of every counter the target's event moves (dbits: none, it moves a bit)."""
    if p.kind == "dbits":
        return []
    if p.kind == "dcs":
        from pansketch.agent.dcs import DyadicSketch

        z = array.array("i", bytes(4 * p.cells))
        DyadicSketch(p.b, p.d, p.w, hashing.salt_prefix(p.salt), p.clip, p.map, z).update(item, 1)
        return [(i, 1 if v > 0 else -1) for i, v in enumerate(z) if v]
    if p.kind == "strhh":
        from pansketch.agent.strhh import PrefixSketch

        z = array.array("i", bytes(4 * p.cells))
        PrefixSketch(p.b, p.d, p.w, hashing.salt_prefix(p.salt), p.clip, z).update(item, 1)
        return [(i, 1 if v > 0 else -1) for i, v in enumerate(z) if v]
    prefix = hashing.salt_prefix(p.salt)
    signed = p.kind == "cs"
    return [(r * p.w + c, s if signed else 1) for r, (c, s) in enumerate(hashing.columns(prefix, item, p.d, p.w))]


def _snapshot(label: str, rec: Recorder, n_flash: int, instance: int, src: RecordingSource, root: str) -> Moment:
    arrays: dict[str, np.ndarray] = {}
    buffers: dict[str, bytes] = {}
    meta: dict[str, str] = {}
    seen: set[int] = set()
    for name, obj in (("rec", rec), ("sketch", rec.sketch), ("rng", rec.rng)):
        for k, v in obj.__dict__.items():
            if k in _SKIP or id(v) in seen:
                continue
            if isinstance(v, list) and v and all(isinstance(x, memoryview) for x in v):
                continue  # views of an array already in the view, no bytes of their own (CPython's closure: agent/pi/fastupdate.py)
            seen.add(id(v))
            key = name + "." + _PROPERTY_STORE.get(k, k)
            if isinstance(v, array.array):
                arrays[key] = np.array(v, dtype=np.int64)
            elif isinstance(v, (list, tuple)) and v and all(isinstance(x, array.array) for x in v):
                for j, x in enumerate(v):  # e.g. one accumulator per open tree node
                    arrays["%s[%d]" % (key, j)] = np.array(x, dtype=np.int64)
            elif isinstance(v, (bytes, bytearray)):
                buffers[key] = bytes(v)
            elif hasattr(v, "digest") and hasattr(v, "copy"):
                meta[key] = "hash state, digest " + v.copy().hexdigest()  # what reading it reveals
            elif callable(v):
                continue  # bound methods (the CPython struct reader): code, not data
            else:
                meta[key] = repr(v).replace(root, "<root>")  # the directory is the auditor's choice
    r = copy.copy(rec.rng)
    r.__dict__ = {k: copy.deepcopy(v) for k, v in rec.rng.__dict__.items() if k != "source"}
    return Moment(label, arrays, buffers, meta, n_flash, r, instance, len(src.data))


def _now(t0: int, epoch_s: int, at: Any) -> int:
    return t0 + int(at * epoch_s)


def run(p: Params, sc: Scenario, world: int, source_for: Callable[[int], Any], workdir: str | None = None) -> Run:
    """Run scenario ``sc`` in world 0 (without the target event) or 1 (with it).

    ``source_for(i)`` gives the byte source of the i-th Rng instance (one per
    boot). Returns every array of the intruder's view.
    """
    base = workdir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(prefix="pansketch-audit-", dir=base)
    try:
        with SpecRecorder() as specs:
            r = _run(p, sc, world, source_for, root, specs)
        r.specs = specs.specs
        return r
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(p: Params, sc: Scenario, world: int, source_for: Callable[[int], Any], root: str,
         specs: SpecRecorder) -> Run:
    t0 = (1_700_000_000 // p.window_s) * p.window_s
    quiet = lambda m: None  # noqa: E731
    log = FlashLog(root, 4 * p.cells)
    storage.open = log.open  # type: ignore[attr-defined]  # every file write goes through the flash log
    try:
        return _drive(p, sc, world, source_for, root, specs, t0, quiet, log)
    finally:
        del storage.open  # type: ignore[attr-defined]


def _drive(p: Params, sc: Scenario, world: int, source_for: Callable[[int], Any], root: str,
           specs: SpecRecorder, t0: int, quiet: Callable[[str], None], log: FlashLog) -> Run:
    srcs = [RecordingSource(source_for(0))]
    specs.add_source(srcs[0])
    rec = make(p, root, t0, rng=Rng(srcs[0]), log=quiet, outbox_max=sc.outbox_max)
    item = target_item(p)
    fail_dir = None
    bg = 0
    errors: list[str] = []
    published: dict[int, bytes] = {}  # acknowledged releases (gone from the outbox, seen by the adversary)
    n_images = [len(log.images)]
    moments = [_snapshot("boot", rec, 0, 0, srcs[0], root)]
    for i, op in enumerate(sc.ops):
        now = _now(t0, p.epoch_s, op.at)
        try:
            if op.kind == "bg":
                for j in range(3):
                    rec.add(background_item(p, bg), 1)
                    bg += 1
            elif op.kind == "target":
                if world == 1:
                    rec.add(item, sc.sign * p.clip)
            elif op.kind == "persist":
                rec.persist(now)
            elif op.kind == "restart":
                srcs.append(RecordingSource(source_for(len(srcs))))
                specs.add_source(srcs[-1])
                rec = make(p, root, now, rng=Rng(srcs[-1]), log=quiet, outbox_max=sc.outbox_max)
            elif op.kind == "tick":
                rec.tick(now)
            elif op.kind == "flush":
                rec.flush(now)
            elif op.kind == "fault":
                log.armed.append(Fault.parse(op.arg))  # the next write of that file in the next op fails
            elif op.kind == "outbox_fail":
                # a directory where the release's temporary file must go: the
                # write fails with an OSError, as on a full flash (even as root)
                fail_dir = rec.outbox.path(rec.seq, ".tmp") + ".new"
                os.mkdir(fail_dir)
            elif op.kind == "ack":
                pend = rec.outbox.pending()
                if pend:
                    published[pend[0]] = rec.outbox.read(pend[0])
                    rec.outbox.ack(pend[0])
            elif op.kind == "outbox_heal":
                if fail_dir is not None:
                    os.rmdir(fail_dir)
                    fail_dir = None
        except Exception as exc:  # firmware/app.py's loop goes on after any exception of the core
            errors.append("%s@%s: %s" % (op.kind, op.at, type(exc).__name__))
        if op.kind != "fault":
            log.armed = []  # a fault applies to the op right after it only
        n_images.append(len(log.images))
        moments.append(_snapshot("after %s@%s" % (op.kind, op.at), rec, 0, len(srcs) - 1, srcs[-1], root))
    flash: list[np.ndarray] = []
    flash_meta: list[tuple] = []
    count_after: list[int] = []
    for img in log.images:
        arrs, meta = image_arrays(p, img)
        flash.extend(arrs)
        flash_meta.append(meta)
        count_after.append(len(flash))
    for m, k in zip(moments, n_images):
        m.n_flash = count_after[k - 1] if k else 0  # every array of every image written by then
    ob = storage.Outbox(root)
    releases: list[np.ndarray] = []
    rmeta: list[dict[str, Any]] = []
    for s in ob.pending():
        published[s] = ob.read(s)
    for s in sorted(published):
        m = cborscan.loads(published[s])  # bounded, byte-level checked (the release subset)
        releases.append(np.frombuffer(m["ctr"], dtype="<i4").astype(np.int64))
        rmeta.append({k: v for k, v in m.items() if k != "ctr"})
    return Run(moments, flash, flash_meta, releases, rmeta, [bytes(s.data) for s in srcs], target_cells(p, item),
               errors=errors, fired=list(log.fired))


def signature(r: Run) -> dict[str, str]:
    """Everything in the view that is not a noisy array: non-array attributes at
    every moment, release and state.bin metadata, and how many of each exist.
    On a sound device none of it depends on the event (only on the clock)."""
    sig: dict[str, str] = {"n_moments": str(len(r.moments)), "n_flash": str(len(r.flash)),
                           "n_releases": str(len(r.releases))}
    for i, m in enumerate(r.moments):
        for k, v in m.meta.items():
            sig["ram%d.%s" % (i, k)] = v
        sig["ram%d.arrays" % i] = ",".join(sorted(m.arrays))
    for j, fmeta in enumerate(r.flash_meta):
        sig["flash%d" % j] = repr(fmeta)
    sig["errors"] = ";".join(r.errors)
    sig["fired"] = ";".join(r.fired)
    for j, rmeta in enumerate(r.release_meta):
        for k, v in sorted(rmeta.items()):
            sig["release%d.%s" % (j, k)] = repr(v)
    return sig


def in_view(key: str, view: str) -> bool:
    """Whether a signature key is seen by a view (the release view sees releases only)."""
    return view == "intrusion" or key.startswith("release") or key == "n_releases"
