"""Run the real device core on a scenario and record everything an intruder can read.

Nothing here re-implements the device: :func:`run` drives
:class:`agent.recorder.Recorder` (the module a board runs) through the
scenario's operations, on a real directory (``state.bin``, ``released``,
``outbox/``), and after every operation records

* every attribute of the Recorder, its Sketch and its Rng (the "RAM"):
  ``array('i')`` attributes as integer arrays (the accumulator, the scratch
  buffer, and any array a future version adds), byte buffers as bytes (the
  Rng's CSPRNG buffer), everything else as its ``repr``;
* every version of ``state.bin`` written so far (a copy-on-write flash keeps
  stale copies: the intruder gets them all);

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
import copy
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import cbor2
import numpy as np

from agent import hashing, noise, storage
from agent.params import Params
from agent.recorder import Recorder
from agent.recorders import make
from agent.rng import NoEntropyError, Rng

from host_tools.audit.scenarios import Scenario

# Recorder/Sketch/Rng attributes that are objects, not data (they are walked
# separately or hold no state of the data: config, log function, file paths).
_SKIP = {"p", "rng", "sketch", "log", "outbox", "source"}


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


def target_item(p: Params) -> str:
    """A target item whose row-0 cell is cell 0 (the first draw of every noise array).

    Any item is a valid target; this one also exposes the Rng-buffer attack of
    issue 13 (a kept tail predicts the next draw, which is cell 0's).
    """
    prefix = hashing.salt_prefix(p.salt)
    for i in range(100000):
        item = "audit-target-%d" % i
        if hashing.columns(prefix, item, p.d, p.w)[0][0] == 0:
            return item
    raise RuntimeError("no target item found")


def target_cells(p: Params, item: str) -> list[tuple[int, int]]:
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
            seen.add(id(v))
            key = name + "." + k
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
    srcs = [RecordingSource(source_for(0))]
    specs.add_source(srcs[0])
    rec = make(p, root, t0, rng=Rng(srcs[0]), log=quiet, outbox_max=sc.outbox_max)
    item = target_item(p)
    flash: list[np.ndarray] = []
    flash_meta: list[tuple] = []
    last_flash = b""
    buf = array.array("i", bytes(4 * p.d * p.w))
    fail_dir = None
    bg = 0
    published: dict[int, bytes] = {}  # acknowledged releases (gone from the outbox, seen by the adversary)

    def read_flash() -> None:
        nonlocal last_flash
        path = storage.join(root, "state.bin")
        if not storage.exists(path):
            return
        raw = storage.read(path)
        if raw == last_flash:
            return
        last_flash = raw
        if p.mode == "tree":  # one file, one array per level (agent/tree.py)
            from agent.tree import read_tree_state

            bufs = [array.array("i", bytes(4 * p.d * p.w)) for _ in range(p.levels)]
            seq, nodes = read_tree_state(path, rec._fp, bufs)
            for b, node in zip(bufs, nodes):
                flash.append(np.array(b, dtype=np.int64))
                flash_meta.append((seq,) + tuple(node))
            return
        meta = storage.read_state(path, rec._fp, buf)
        flash.append(np.array(buf, dtype=np.int64))
        flash_meta.append(meta)

    moments = [_snapshot("boot", rec, 0, 0, srcs[0], root)]
    for i, op in enumerate(sc.ops):
        now = _now(t0, p.epoch_s, op.at)
        if op.kind == "bg":
            for j in range(3):
                rec.add("audit-bg-%d" % (bg % 5), 1)
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
        read_flash()
        moments.append(_snapshot("after %s@%s" % (op.kind, op.at), rec, len(flash), len(srcs) - 1, srcs[-1], root))
    ob = storage.Outbox(root)
    releases: list[np.ndarray] = []
    rmeta: list[dict[str, Any]] = []
    for s in ob.pending():
        published[s] = ob.read(s)
    for s in sorted(published):
        m = cbor2.loads(published[s])
        releases.append(np.frombuffer(m["ctr"], dtype="<i4").astype(np.int64))
        rmeta.append({k: v for k, v in m.items() if k != "ctr"})
    return Run(moments, flash, flash_meta, releases, rmeta, [bytes(s.data) for s in srcs], target_cells(p, item))


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
    for j, rmeta in enumerate(r.release_meta):
        for k, v in sorted(rmeta.items()):
            sig["release%d.%s" % (j, k)] = repr(v)
    return sig


def in_view(key: str, view: str) -> bool:
    """Whether a signature key is seen by a view (the release view sees releases only)."""
    return view == "intrusion" or key.startswith("release") or key == "n_releases"
