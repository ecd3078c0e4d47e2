"""The accumulator and commit core shared by every recorder (docs/ARCHITECTURE.md "Release modes").

pansketch.agent.recorder.Recorder (window and keep: one accumulator) and
pansketch.agent.tree.TreeRecorder (tree: one accumulator per level) both subclass
:class:`Core`; what differs between them (how many accumulators, their keys,
how a persist is written and when its fresh draw comes) stays in the
subclass, which passes the core the arrays and the persist scheme of the
accumulator at hand (True: shadow, agent/recorder.py).

What the core does the same way for both:

* the directories, the outbox and the boot-time recovery of uncommitted
  ``.tmp`` files (kept and renamed if the marker lists them, else deleted);
* one scratch buffer ``relbuf``, all zeros between calls (it is part of the
  intruder's view, docs/PRIVACY.md): every noise draw is staged there and
  wiped on every path, also when the draw fails part way;
* the internal noise of a new accumulator (Z_int; under shadow also
  M = Z_int + G_0) and the shadow rebuild after a restart;
* steps 1-3 of the commit protocol of a release (state + fresh Z_out to
  ``outbox/s.tmp``, the marker, the rename), with "a write that was attempted
  counts as written" left to the caller, which knows what a failed commit
  means for its accumulator (docs/PRIVACY.md "Failed writes and failed commits").

Every draw goes through this module's ``draw_into`` and ``add_noise`` (the
audit's negative controls, tests/support/audit_controls.py, patch them here).
"""

from pansketch.agent import release, storage
from pansketch.agent.noise import add_noise, add_staged, draw_into, wrap32, zero
from pansketch.agent.rng import Rng


def _log(msg):
    print("pansketch: " + msg)


class Core:
    """The shared part of the recorders (no attributes of its own: the subclass's
    attributes are the whole intruder's view, tests/test_intruder_view.py)."""

    def _setup(self, params, root, now, rng, log, outbox_max):
        self.p = params
        self.root = root
        self.rng = rng if rng is not None else Rng()
        self.log = log if log is not None else _log
        storage.makedirs(root)
        self.outbox = storage.Outbox(root, outbox_max)
        self.state_path = storage.join(root, "state.bin")
        self.marker_path = storage.join(root, "released")
        self._unrenamed = False  # a committed release's rename failed: finished at the next tick
        self.last_persist = now

    def _recover(self, last):
        """Boot: a .tmp whose seq the marker lists (<= ``last``) was committed: finish its
        rename; any other was never published: delete it."""
        for s in self.outbox.uncommitted():
            if last is not None and s <= last:
                storage.rename(self.outbox.path(s, ".tmp"), self.outbox.path(s))
            else:
                storage.remove(self.outbox.path(s, ".tmp"))

    # -- noise ---------------------------------------------------------
    def _wipe(self):
        """Zero the scratch buffer in place (no allocation)."""
        zero(self.relbuf)

    def _fresh(self, sh=None):
        """Fill the scratch buffer with one fresh independent internal noise draw per cell,
        at the scale of persist scheme ``sh`` (None: the Recorder's open accumulator's,
        ``self.sh``). On failure (no entropy, low memory) the partial draw is wiped."""
        draw_into(self.relbuf, self.p.internal_noise(self.sh if sh is None else sh), self.rng)

    def _shadow_pair(self, m, acc=None):
        """Shadow scheme: relbuf = a fresh Z_int and the shadow ``m`` = a fresh G
        (zeroed first); if either draw fails, both are wiped before the exception
        leaves. Then, for a new accumulator (``acc`` None), M = Z_int + G_0 and
        relbuf keeps Z_int for the caller to swap in (the old shadow left RAM);
        after a restart (``acc`` holds the snapshot S = R - M from flash), R = S +
        Z_int' and M = Z_int' + G', so R - M = S - G' and the next snapshot again
        differs from this one by events minus a fresh G; relbuf is wiped."""
        self._fresh(True)
        try:
            draw_into(m, self.p.internal_noise(True), self.rng)
        except BaseException:
            self._wipe()
            raise
        b = self.relbuf
        if acc is not None:
            add_staged(b, acc, m)
            return
        for i in range(len(m)):
            m[i] = wrap32(m[i] + b[i])

    # -- releases ------------------------------------------------------
    def _stage_release(self, rel, src=None):
        """rel = the state ``src`` (None: the Recorder's accumulator) + fresh Z_out (one draw per cell)."""
        c = self.counters if src is None else src
        for i in range(len(c)):
            rel[i] = c[i]
        add_noise(rel, self.p.noise, self.rng)  # fresh Z_out

    def _commit(self, lv, src, elo, ehi, part, nz, inoise, marks=None):
        """Steps 1-2 of the commit protocol for release ``self.seq``: stage
        the state ``src`` (see _stage_release) + Z_out, write it to ``outbox/<seq>.tmp``, then the marker (the
        one line of this release, or the lines ``marks``).

        Exactly one Z_out draw per cell, whatever the counts (the sum wraps
        mod 2**32, never raises): the release's noise and its timing do not
        depend on the data. The staged copy is wiped on every path.

        Returns (None, True) when committed; (None, False) when the output
        noise could not be drawn (logged; nothing was written); else (err,
        tried): the writes failed with ``err`` (not raised: the caller's
        bookkeeping comes first), and ``tried`` says whether a file write was
        attempted (False: the outbox was full), which counts as written.
        """
        rel = self.relbuf
        s = self.seq
        try:
            self._stage_release(rel, src)
        except BaseException as exc:  # NoEntropyError, MemoryError: nothing was written
            self._wipe()
            if not isinstance(exc, Exception):
                raise
            self.log("cannot draw the output noise of release %d (%r); retrying" % (s, exc))
            return None, False
        tried = False
        err = None
        try:
            if self.outbox.full():
                raise OSError("outbox holds its limit of %d releases" % self.outbox.limit)
            tried = True
            storage.write_atomic(
                self.outbox.path(s, ".tmp"),
                lambda write: release.encode_to(self.p, s, elo, ehi, part, rel, write, nz, lv, inoise))
            if marks is None:
                storage.write_marker(self.marker_path, s, elo, ehi, part)
            else:
                storage.write_markers(self.marker_path, marks)
        except BaseException as exc:
            err = exc
        self._wipe()  # the staged release leaves RAM on every path
        return err, tried

    def _rename(self, s):
        """Step 3: make committed release s visible to the publisher. The marker says
        it was committed, so a failed rename is finished at the next tick (or boot)."""
        try:
            storage.rename(self.outbox.path(s, ".tmp"), self.outbox.path(s))
        except BaseException as exc:
            self._unrenamed = True
            if not isinstance(exc, Exception):
                raise
            self.log("release %d committed, but its rename failed (%r); retrying" % (s, exc))

    def _finish_rename(self):
        """At a tick: retry the rename of the last committed release if it failed."""
        if self._unrenamed:
            try:
                self.outbox.finish(self.seq)
                self._unrenamed = False
            except Exception:
                pass  # retried at the next tick

    def _failed(self, err, msg):
        """After the bookkeeping of a write: True if it succeeded; else log an
        Exception (the device goes on) or re-raise anything else."""
        if err is None:
            return True
        if not isinstance(err, Exception):
            raise err
        self.log(msg % (err,))
        return False
