"""Tree mode: pan-private continual observation over a dyadic tree of epochs.

docs/ARCHITECTURE.md "Release modes", item 3; the binary mechanism of
lazy-sketch-continual-observation (GaussBM) made pan-private as in Dwork
et al. 2010: every array an intruder can read starts with internal noise,
every release adds fresh output noise.

* Epochs are the leaves (epoch k = UTC seconds [k*epoch_s, (k+1)*epoch_s)).
  A node of level l covers the 2**l epochs [a, a + 2**l) with a = 0 mod
  2**l, in *absolute* epoch numbering, so the trees of all devices align and
  the host can add nodes of different devices. There are L = ``levels``
  levels 0..H (H = L - 1); the root (level H) is the horizon of 2**H epochs,
  ``window_s = epoch_s * 2**H``; a new tree starts after it (the next root).
* At any time exactly one node per level is open: the one containing the
  current epoch. Its accumulator starts as one draw of internal noise per
  cell. An event is added to all L open accumulators (one hash, d*L cell
  additions: pansketch.agent.sketch.Sketch.arrays).
* When a node ends (the clock passes its last epoch) it is released once:
  state + fresh output noise, through the outbox exactly as in the other
  modes (write .tmp, marker, rename), and the next node of its level opens
  with fresh internal noise. At the end of epoch e, the nodes of levels
  0..t close, t = the number of trailing one bits of e: 2 releases per epoch
  on average, at most L.
* Persist writes all L accumulators into one state file, then adds a fresh
  draw to every accumulator that keeps counting (its ``nz`` grows by one),
  as in the other modes: RAM minus any flash copy is events plus a full draw.
  Under ``persist_noise = "shadow"`` (agent/recorder.py, docs/PRIVACY.md)
  each level also keeps a shadow M (pure noise): the file gets R - M per
  level and the fresh draw goes into M, so a node's release carries one
  internal draw (at 2L arrays) however many persists it lived through.
  The scheme is recorded per level in the state file and changes only when
  a level opens its next node (a config change never strands a node).
* If the outbox cannot be written (full flash, or ``outbox_max`` releases
  the host has not acknowledged), the closed node keeps its accumulator
  (it takes no more events: a node's range never grows, the host relies on
  aligned power-of-two ranges) and its release is retried at every tick. Its
  level counts nothing until then: the next node of that level opens, with
  fresh noise, only once the release is committed, so it misses the events
  in between (like events lost in a power cut; the leaves and the other
  levels still hold them). Releases that follow a failed one wait for it
  (one failure stops the tick), so the outbox order stays by level.

Memory: L accumulators of d*w int32 plus ONE shared scratch array (release
copy, or a fresh draw staged before it touches an accumulator), all zeros
between calls; under shadow, L shadow arrays more.

Crash safety: the marker file lists the releases boot may need ("seq elo
ehi part" per line, at most 2L + 1: see ``_keep``). At boot a node of the
state file whose key is listed was released after the state was written:
it is not resumed (nothing is released twice) and the next node of its
level opens.
The other nodes resume from flash and get a fresh draw before counting
again (no noise is re-drawn for anything released). A released node's
level continues as a part above every part the marker lists for that
range: a flush after the state write may have released it already.

Failures: a persist that fails in any way counts as written (every
counting level gets its draw as after a good write); a failed commit keeps
the closed node, which counts nothing more, so its retry needs no fresh
draw (docs/PRIVACY.md "Failed writes and failed commits").
"""

import hashlib
import struct

from pansketch.agent import hashing, storage
from pansketch.agent.accum import Core
from pansketch.agent.noise import add_staged, wrap32, zero
from pansketch.agent.sketch import Sketch, new_counters

OPEN = 0  # counting
CLOSED = 1  # ended, release not committed yet (outbox full): no events
PENDING = 2  # released; the next node's noise is not drawn yet: no events
STALE = 3  # persisted, but the fresh draw after the write failed: no events until it succeeds
REBUILD = 4  # shadow level resumed from flash: holds the snapshot S; needs Z_int' and a new shadow


# -- the tree-mode state file (docs/FORMAT.md section 6) --------------------
TREE_MAGIC = b"PSKT"
TREE_VERSION = 1
# magic, version, levels, pad, fingerprint(8), seq, ncells per array
_THDR = "<4sBB2x8sII"
_THDR_LEN = struct.calcsize(_THDR)
# per level: node start epoch, part, noise draws, status (0 open, 1 closed awaiting its release),
# persist scheme (0 refresh: the accumulator; 1 shadow: accumulator - shadow); files written before
# the scheme byte existed have 0 there
_TLVL = "<qIIBB2x"
_TLVL_LEN = struct.calcsize(_TLVL)


def write_tree_state(path, fingerprint, seq, nodes, arrays):
    """Persist all L node accumulators (only ever noisy) in one file.

    ``nodes`` is a list of (elo, part, nz, status, shadow) per level,
    ``arrays`` the L counter arrays (the snapshot R - M for a shadow level).
    Header, level table, L*ncells int32, SHA-256.
    """
    n = len(arrays[0])
    hdr = struct.pack(_THDR, TREE_MAGIC, TREE_VERSION, len(arrays), fingerprint, seq, n)
    tab = b""
    for (elo, part, nz, status, sh) in nodes:
        tab += struct.pack(_TLVL, elo, part, nz, status, sh)
    h = hashlib.sha256(hdr)
    h.update(tab)
    for a in arrays:
        h.update(a)

    def body(write):
        write(hdr)
        write(tab)
        for a in arrays:
            write(a)
        write(h.digest())

    storage.write_atomic(path, body)


def read_tree_state(path, fingerprint, arrays):
    """Load a tree state into the preallocated ``arrays``.

    Returns (seq, [(elo, part, nz, status, shadow) per level]) or None; raises
    StateError if the file is corrupt or was made with other parameters.
    """
    storage.recover(path, _tree_complete)
    if not storage.exists(path):
        return None
    f = open(path, "rb")
    try:
        hdr = f.read(_THDR_LEN)
        if len(hdr) != _THDR_LEN:
            raise storage.StateError("state file %s is truncated" % path)
        magic, ver, levels, fp, seq, n = struct.unpack(_THDR, hdr)
        if magic != TREE_MAGIC or ver != TREE_VERSION:
            raise storage.StateError("state file %s has an unknown format" % path)
        if fp != fingerprint or levels != len(arrays) or n != len(arrays[0]):
            raise storage.StateError(
                "state file %s was written with different parameters; "
                "restore the old config or move the directory away" % path
            )
        tab = f.read(_TLVL_LEN * levels)
        if len(tab) != _TLVL_LEN * levels:
            raise storage.StateError("state file %s is truncated" % path)
        h = hashlib.sha256(hdr)
        h.update(tab)
        for a in arrays:
            if f.readinto(a) != 4 * n:
                raise storage.StateError("state file %s is truncated" % path)
            h.update(a)
        trailer = f.read(32)
        if len(trailer) != 32 or f.read(1):
            raise storage.StateError("state file %s is truncated" % path)
    finally:
        f.close()
    if h.digest() != trailer:
        raise storage.StateError("state file %s fails its checksum" % path)
    nodes = []
    for i in range(levels):
        elo, part, nz, status, sh = struct.unpack_from(_TLVL, tab, i * _TLVL_LEN)
        nodes.append((elo, part, nz, status, sh))
    return (seq, nodes)


def _tree_body(hdr):
    levels = hdr[5]
    return _TLVL_LEN * levels + 4 * struct.unpack(_THDR, hdr)[-1] * levels


def _tree_complete(path):
    """True if a tree state file is whole (storage.complete)."""
    return storage.complete(path, _THDR_LEN, TREE_MAGIC, _tree_body)


class TreeRecorder(Core):
    """The device core in tree mode (same interface as pansketch.agent.recorder.Recorder;
    the outbox, the draws and the commit are pansketch.agent.accum.Core's)."""

    def __init__(self, params, root, now, rng=None, log=None, outbox_max=0):
        self._setup(params, root, now, rng, log, outbox_max)
        n = params.d * params.w
        L = params.levels
        # L accumulators (one per level) and one shared scratch buffer
        self.relbuf = new_counters(n)
        self.nodes = [new_counters(n) for _ in range(L)]
        # persist_noise shadow: one shadow per level (allocated when a level first needs one)
        self.shadows = [new_counters(n) if params.shadow else None for _ in range(L)]
        self.shs = [params.shadow] * L  # persist scheme of each level's node
        self.nzms = [0] * L  # draws per cell in R - M (shadow levels): the next snapshot's
        self.sketch = Sketch(params.kind, params.d, params.w, hashing.salt_prefix(params.salt), params.clip,
                             self.nodes[0])
        self.sketch.arrays = []
        self._fp = params.fingerprint()
        self.lo = [0] * L  # first epoch of each level's node (aligned to 2**l)
        self.parts = [0] * L
        self.nzs = [0] * L  # internal noise draws per cell in each accumulator
        self.status = [PENDING] * L
        self.marks = []  # (seq, elo, ehi, part) of releases boot may need (see _keep)
        self.state_seq = 0  # seq recorded in the last state file written
        self.state_keys = []  # (elo, ehi, part) of the nodes in the last state file written
        self.seq = 0
        self.resumed = False
        self._boot(now)

    # -- leaf view (what the daemon and firmware schedule on) -------------
    @property
    def elo(self):
        return self.lo[0]

    @property
    def ehi(self):
        return self.lo[0] + 1

    @property
    def part(self):
        return self.parts[0]

    @property
    def nz(self):
        return self.nzs[0]

    # -- helpers ---------------------------------------------------------
    def _arrays(self):
        """Point the sketch at the accumulators that count."""
        a = self.sketch.arrays
        del a[:]
        for lv in range(len(self.nodes)):
            if self.status[lv] == OPEN:
                a.append(self.nodes[lv])
        self.sketch.counters = self.nodes[0]

    def _shadow(self, lv):
        """Level lv's shadow M, allocated on first use."""
        if self.shadows[lv] is None:
            self.shadows[lv] = new_counters(len(self.relbuf))
        return self.shadows[lv]

    def _open(self, lv, cur=None):
        """Open level lv's next node (lo/parts already set): a fresh Z_int
        array swapped in (and, under shadow, M = Z_int + G_0); the old
        array (released data) and its shadow are overwritten."""
        if cur is not None and self.lo[lv] + (1 << lv) <= cur:
            # the target ended while its noise could not be drawn: start at the current node
            self.lo[lv] = cur - cur % (1 << lv)
            self.parts[lv] = 0
        sh = self.shs[lv] = self.p.shadow
        if not sh and self.shadows[lv] is not None:  # the config's scheme is refresh (migrated level)
            zero(self.shadows[lv])
            self.shadows[lv] = None
        if sh:
            self._shadow_pair(self._shadow(lv))  # relbuf = Z_int, M = Z_int + G_0
        else:
            self._fresh(False)
        self.nodes[lv], self.relbuf = self.relbuf, self.nodes[lv]
        self._wipe()
        self.nzs[lv] = 1
        self.nzms[lv] = 1
        self.status[lv] = OPEN
        self._arrays()

    def _retry(self, cur):
        """Draw the noise that failed earlier (new nodes, post-persist draws)."""
        for lv in range(len(self.nodes)):
            st = self.status[lv]
            try:
                if st == PENDING:
                    self._open(lv, cur)
                elif st == STALE:
                    # after a persist: refresh, nodes[lv] += one fresh draw; shadow, shadows[lv] += one
                    # fresh G (mod 2**32). The draw leaves RAM.
                    sh = self.shs[lv]
                    self._fresh(sh)
                    add_staged(self.relbuf, self.shadows[lv] if sh else self.nodes[lv])
                    if sh:
                        self.nzms[lv] += 1
                    else:
                        self.nzs[lv] += 1
                    self.status[lv] = OPEN
                    self._arrays()
                elif st == REBUILD:
                    # a shadow level resumed from flash (nodes[lv] = S): R = S + Z_int', M = Z_int' + G'
                    # (pansketch.agent.accum.Core._shadow_pair)
                    self._shadow_pair(self._shadow(lv), self.nodes[lv])
                    self.nzs[lv] += 1
                    self.nzms[lv] = self.nzs[lv]
                    self.status[lv] = OPEN
                    self._arrays()
            except Exception as exc:  # MemoryError, NoEntropyError: retry at the next tick
                self.log("cannot draw noise for level %d (%r); that level is not counting" % (lv, exc))

    @staticmethod
    def _next(lv, cur, elo, part):
        """(elo, part) of the node that follows the released (elo, part) at level lv."""
        if cur >= elo + (1 << lv):
            return (cur - cur % (1 << lv), 0)
        return (elo, part + 1)  # flush, or a clock behind the released node

    def _keep(self, marks, cur):
        """The marker lines boot can need, at most 2L + 1 (the file is
        rewritten at every release, so it must stay small):

        * releases of nodes in the last state file written (a node whose
          key is listed is not resumed: nothing is released twice);
        * per node range that has not ended (a flush, or a clock behind),
          its highest released part (the next part must be higher);
        * the last release (its seq; the clock-behind rule).
        """
        keep = []
        best = {}
        for m in marks:
            if (m[1], m[2], m[3]) in self.state_keys and m[0] >= self.state_seq:
                keep.append(m)
            elif cur is None or m[2] > cur:
                b = best.get((m[1], m[2]))
                if b is None or m[3] > b[3]:
                    best[(m[1], m[2])] = m
        for k in best:
            if best[k] not in keep:
                keep.append(best[k])
        if marks and marks[-1] not in keep:
            keep.append(marks[-1])
        keep.sort()
        return keep

    # -- start-up --------------------------------------------------------
    def _boot(self, now):
        marks = storage.read_markers(self.marker_path)
        last = marks[-1][0] if marks else None
        self._recover(last)
        cur = now // self.p.epoch_s
        L = len(self.nodes)
        st = read_tree_state(self.state_path, self._fp, self.nodes)
        if st is None:
            self.seq = last + 1 if last is not None else 0
            self.marks = self._keep(marks, cur)
            self.state_seq = self.seq
            e = cur
            for m in marks:
                if m[1] > e:
                    e = m[1]  # the clock is behind a release: count into the epoch it started at
            for lv in range(L):
                a = e - e % (1 << lv)
                part = 0
                for m in marks:
                    if m[1] == a and m[2] == a + (1 << lv) and m[3] >= part:
                        part = m[3] + 1
                self.lo[lv] = a
                self.parts[lv] = part
                self.status[lv] = PENDING
            for lv in range(L):
                for i in range(len(self.nodes[lv])):
                    self.nodes[lv][i] = 0
            self._retry(cur)
            return
        seq, tab = st
        self.state_seq = seq
        self.state_keys = [(tab[lv][0], tab[lv][0] + (1 << lv), tab[lv][1]) for lv in range(L)]
        released = [(m[1], m[2], m[3]) for m in marks if m[0] >= seq]
        self.marks = self._keep(marks, cur)
        self.seq = seq if last is None or last < seq else last + 1
        for lv in range(L):
            elo, part, nz, status, sh = tab[lv]
            if (elo, elo + (1 << lv), part) in released:
                a, np_ = self._next(lv, cur, elo, part)
                # a flush may have released the next node's key too, after this state was
                # written (a power cut before the next persist): never reuse a released key
                for m in marks:
                    if m[1] == a and m[2] == a + (1 << lv) and m[3] >= np_:
                        np_ = m[3] + 1
                self.lo[lv], self.parts[lv] = a, np_
                self.status[lv] = PENDING
            else:
                self.lo[lv] = elo
                self.parts[lv] = part
                self.nzs[lv] = nz
                self.shs[lv] = bool(sh)
                if sh and status == CLOSED:
                    # a closed shadow node counts nothing more: R = S as it is (RAM = flash
                    # shows nothing), an all-zero shadow so later persists write S again
                    if self.shadows[lv] is None:
                        self.shadows[lv] = new_counters(len(self.relbuf))
                    zero(self.shadows[lv])
                    self.nzms[lv] = nz
                    self.status[lv] = CLOSED
                elif sh:
                    self.status[lv] = REBUILD  # R = S + Z_int', a new shadow: before any event
                else:
                    # an open node keeps counting: it needs a fresh draw first (RAM != flash)
                    self.status[lv] = CLOSED if status == CLOSED else STALE
        self.resumed = True
        self.log("resumed tree state seq %d, leaf [%d, %d) part %d" % (self.seq, self.lo[0], self.lo[0] + 1,
                                                                       self.parts[0]))
        self._retry(cur)

    # -- events ----------------------------------------------------------
    def add(self, item, weight=1):
        self.sketch.update(item, weight)

    def add_view(self, text, view, weight=1):
        self.sketch.update_view(text, view, weight)

    def add_many(self, items, weights=None, adder=None):
        """Add a batch; ``adder(sketch, items, weights)`` may replace
        ``Sketch.update_many`` (the Pi daemon's numpy path, which also
        honours ``Sketch.arrays``)."""
        if adder is None:
            self.sketch.update_many(items, weights)
        else:
            adder(self.sketch, items, weights)

    # -- clock -----------------------------------------------------------
    def tick(self, now):
        """Release every node that has ended; persist when due.

        Returns the number of releases committed.
        """
        cur = now // self.p.epoch_s
        self._finish_rename()
        self._retry(cur)
        changed = False
        for lv in range(len(self.nodes)):
            if self.status[lv] == OPEN and self.lo[lv] + (1 << lv) <= cur:
                self.status[lv] = CLOSED
                changed = True
        if changed:
            self._arrays()
        n = self._release_nodes(now, cur, False)
        if now - self.last_persist >= self.p.persist_s:
            self.persist(now)
        return n

    def flush(self, now):
        """Release every node now (end of a batch input); each continues as its next part."""
        cur = now // self.p.epoch_s
        self._retry(cur)
        n = self._release_nodes(now, cur, True)
        # a node closed above whose release failed stays CLOSED; one still in its
        # time re-opens as its next part only after its release (retried at tick)
        return n

    def redate(self, elo, ehi, part, now=None):
        """Move every node to the one containing epoch ehi - 1 (events counted
        before the clock was set are dated to that epoch), then persist."""
        if not (0 <= elo < ehi):
            raise ValueError("epoch range must satisfy 0 <= elo < ehi")
        e = ehi - 1
        for lv in range(len(self.nodes)):
            self.lo[lv] = e - e % (1 << lv)
            self.parts[lv] = part
        self.persist(now)

    def _flip(self, limit=-1):
        """Every shadow level: M = R - M (an involution: twice gives M back).
        Between two flips M holds the snapshot S that goes to flash. Flips
        the first ``limit`` cells (in level order; -1: all); if it fails part
        way (MemoryError), the cells it flipped are flipped back before the
        exception leaves: M never keeps S."""
        k = 0
        try:
            for lv in range(len(self.nodes)):
                if self.shs[lv]:
                    a = self.nodes[lv]
                    m = self.shadows[lv]
                    for i in range(len(m)):
                        if k == limit:
                            return
                        m[i] = wrap32(a[i] - m[i])
                        k += 1
        except BaseException:
            if limit < 0:
                self._flip(k)
            raise

    def persist(self, now=None):
        """Write all L accumulators (R - M for a shadow level), then a fresh
        draw into each counting one (into its shadow for a shadow level).

        A write that was attempted counts as written (docs/PRIVACY.md
        "Failed writes"): after any failure the counting levels get their
        fresh draw exactly as after a good write. Only the bookkeeping of
        what boot will find (state_seq, state_keys, marks) waits for a good
        write. Returns True if the file was written."""
        for st in self.status:
            if st == PENDING or st == STALE or st == REBUILD:
                return False  # released data or an unrefreshed copy may not be written
        tab = []
        arrays = []
        for lv in range(len(self.nodes)):
            sh = self.shs[lv]
            tab.append((self.lo[lv], self.parts[lv], self.nzms[lv] if sh else self.nzs[lv],
                        1 if self.status[lv] == CLOSED else 0, 1 if sh else 0))
            arrays.append(self.shadows[lv] if sh else self.nodes[lv])
        if now is not None:
            self.last_persist = now  # an attempt is a persist: a full flash is retried after persist_s
        err = None
        flipped = False
        try:
            self._flip()
            flipped = True
            write_tree_state(self.state_path, self._fp, self.seq, tab, arrays)
        except BaseException as exc:
            err = exc
        if flipped:
            self._flip()
        for lv in range(len(self.nodes)):
            if self.status[lv] == OPEN:
                self.status[lv] = STALE  # no event may be counted between the write and the draw
        self._arrays()
        if err is None:
            self.state_seq = self.seq
            self.state_keys = []
            for lv in range(len(self.nodes)):
                self.state_keys.append((self.lo[lv], self.lo[lv] + (1 << lv), self.parts[lv]))
            self.marks = self._keep(self.marks, None)  # lines about older state files are not needed
        self._retry(None)
        return self._failed(err, "cannot persist state (%s); counting continues in RAM")

    # -- releases --------------------------------------------------------
    def _release_nodes(self, now, cur, flush):
        """Release every CLOSED node (flush: every OPEN one too, closed first) in level
        order, each followed by its level's next node; the first failure stops (outbox
        full or no noise: that node and the later ones are retried at the next tick).
        Returns the number of releases committed."""
        n = 0
        for lv in range(len(self.nodes)):
            st = self.status[lv]
            if st != CLOSED and not (flush and st == OPEN):
                continue
            if flush:
                self.status[lv] = CLOSED
                self._arrays()
            if not self._release(lv, now, cur):
                break
            n += 1
            try:
                self._open(lv, cur)
            except Exception as exc:
                self.log("release committed, but the noise of level %d's next node failed (%r); retrying"
                         % (lv, exc))
        return n

    def _release(self, lv, now, cur):
        """Commit node lv (state + Z_out; pansketch.agent.accum.Core._commit) to the outbox.
        True if committed; then the level's key moves on to its next node
        (PENDING) before the rename, so nothing can release or persist the
        released array again. Output noise: L arrays, both schemes."""
        s = self.seq
        elo = self.lo[lv]
        ehi = elo + (1 << lv)
        part = self.parts[lv]
        marks = self._keep(self.marks + [(s, elo, ehi, part)], cur)
        err, tried = self._commit(lv, self.nodes[lv], elo, ehi, part, self.nzs[lv] + 1, self.p.internal_noise(self.shs[lv]), marks)
        if err is not None:
            # The node is closed (it counts nothing more), so a stale .tmp = R + Z_out and
            # the later release R + Z_out' are both functions of R plus independent
            # output noise: no fresh draw is needed (docs/PRIVACY.md "Failed writes and failed commits").
            if not isinstance(err, Exception):
                raise err
            storage.remove(self.outbox.path(s, ".tmp"))
            self.log("cannot write release %d (%s); node [%d, %d) kept, retried at the next tick"
                     % (s, err, elo, ehi))
            return False
        if not tried:
            return False  # no output noise: retried at the next tick
        self.marks = marks
        self.seq = s + 1
        self.lo[lv], self.parts[lv] = self._next(lv, cur, elo, part)
        self.status[lv] = PENDING
        self._rename(s)  # committed (the marker says so): a failed rename is finished at the next tick or boot
        # the persist clock is not reset: the other levels keep counting and
        # must stay durable (every persist_s), unlike a window's fresh accumulator
        return True
