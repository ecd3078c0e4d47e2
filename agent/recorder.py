"""Pan-private recording: noisy state, clock-aligned releases, crash safety.

Implements the ``window`` and ``keep`` release modes of docs/ARCHITECTURE.md:

* time is cut into epochs of ``epoch_s`` seconds, numbered absolutely
  (epoch k = [k*epoch_s, (k+1)*epoch_s) in UTC seconds); a window is
  ``window_s / epoch_s`` consecutive epochs. ``window`` mode is the case of
  one epoch per window. Boundaries follow the clock, never the event count.
* the accumulator of the open epoch starts as internal noise Z_int
  (one independent draw per cell), so the state an intruder can read is
  exact counts + noise;
* persisting must not let RAM minus the flash copy -- or two stale copies
  a copy-on-write filesystem leaves in free blocks -- be the exact events
  in between. Two schemes (``persist_noise``, docs/PRIVACY.md):

  - ``refresh``: the snapshot is written and then a fresh independent draw
    is added to the accumulator in RAM (also after a restart, before
    counting resumes); the release carries one more draw per persist;
  - ``shadow``: the accumulator R = Z_int + events is never written. A
    second array, the shadow M (pure noise: Z_int plus one fresh draw G
    per persist), gives the flash track: a persist writes S = R - M and
    then adds a fresh G to M, so consecutive snapshots differ by the
    events in between minus an independent G, and RAM minus flash by the
    later events minus the newest G. The release (R + Z_out) carries one
    internal draw, at half the budget, however many persists there were.
    A restart rebuilds R = S + fresh Z_int, so after one the release also
    carries the G draws inside S (one per persist before the restart);
* when the epoch closes, a release = state + Z_out (fresh noise, same
  scale) is committed to the outbox, and a new accumulator with fresh
  Z_int opens. This is the pan-private variant of intermittent-queries
  Algorithm 4 (use-and-keep): the host sums the per-epoch releases. The
  release's ``nz`` field counts the noise draws per cell it carries.

Commit protocol of one release with sequence number s (storage.py layout)::

    1. write outbox/s.tmp          (state + Z_out; the counters in RAM are untouched)
    2. write the "released" marker  s elo ehi part
    3. rename s.tmp -> s.cbor      (now visible to the publisher)
    4. open the next accumulator with fresh Z_int (persisted at the next persist)

A crash before 2 deletes s.tmp at restart: those bytes were never
published, the state is still on flash, and it is released later with a
new Z_out (nothing is re-drawn for released data); the deleted bytes stay
in an intruder's view, which the resume draw covers (docs/PRIVACY.md
"Failed writes and failed commits").
A crash after 2 finishes the rename and discards the old state, which the
marker says was released: a release is never generated twice. Events that
arrived after the last persisted state are lost in a power cut; events in
a persisted state never are. Release keys (elo, ehi, part) never repeat,
also when the clock is behind the last release.

If the outbox cannot be written (full flash, or it holds ``outbox_max``
releases the host has not acknowledged), the accumulator keeps counting
and its epoch range [elo, ehi) grows until a release succeeds.

A write that was attempted counts as written (docs/PRIVACY.md "Failed
writes and failed commits"): after a failed persist the draw is added as
after a good one; after a failed commit (its .tmp may be on flash) the
accumulator gets one fresh internal draw before it counts again
(``_renoise``; the release's ``nz`` counts it). Any exception, not only
OSError, takes these paths; the scratch buffer is wiped on all of them.
"""

from pansketch.agent import hashing, storage
from pansketch.agent.accum import Core
from pansketch.agent.noise import add_staged, wrap32, zero
from pansketch.agent.sketch import Sketch, new_counters


class Recorder(Core):
    """The device core: count events into a noisy sketch, commit releases.

    ``params`` is an :class:`pansketch.agent.params.Params`; ``root`` a directory for
    the outbox and state; ``rng`` an :class:`pansketch.agent.rng.Rng` (default: system
    CSPRNG); ``now`` the current UTC time in seconds (int).

    Draw counts (all per cell): ``nz`` internal draws in the accumulator
    (the release carries nz + 1); under shadow, ``nzm`` draws in R - M,
    i.e. in the snapshot the next persist writes. ``sh`` is the persist
    scheme of the open accumulator: the configured one, or that of a state
    file written before the config changed (until its release).
    """

    def __init__(self, params, root, now, rng=None, log=None, outbox_max=0):
        self._setup(params, root, now, rng, log, outbox_max)  # pansketch.agent.accum.Core: outbox, paths, rng, log
        self._make_state(params)
        self._fps = (params.fingerprint(False), params.fingerprint(True))  # state.bin id per persist scheme
        self._fp = self._fps[1 if params.shadow else 0]
        self._pending = None  # (epoch, part) of an accumulator whose noise could not be drawn yet
        self._redraw = False  # a commit failed: the accumulator needs a fresh draw before it counts again
        self.nz = 0
        self.nzm = 0
        self.sh = params.shadow
        self.resumed = False  # True when boot continued a persisted accumulator
        self._boot(now)

    def _make_state(self, params):
        n = params.cells
        # Two preallocated arrays: the live accumulator and a scratch buffer
        # (release copy, or fresh noise staged before it touches the state).
        # The scratch buffer is all zeros whenever no method is running: it
        # is part of the intruder's view (docs/PRIVACY.md), and a staged draw
        # left in it would give counters - relbuf - state.bin = exact events.
        self.relbuf = new_counters(n)
        # shadow scheme: M, pure noise (Z_int + one G per persist); R - M is the flash track
        self.shadow = new_counters(n) if params.shadow else None
        if params.kind == "dcs":
            from pansketch.agent.dcs import DyadicSketch  # imported on demand: a board counting cs/cms keeps the heap

            self.sketch = DyadicSketch(params.b, params.d, params.w, hashing.salt_prefix(params.salt), params.clip,
                                       params.map, new_counters(n))
        elif params.kind == "strhh":
            from pansketch.agent.strhh import PrefixSketch  # on demand, as dcs

            self.sketch = PrefixSketch(params.b, params.d, params.w, hashing.salt_prefix(params.salt), params.clip,
                                       new_counters(n))
        else:
            self.sketch = Sketch(params.kind, params.d, params.w, hashing.salt_prefix(params.salt), params.clip,
                                 new_counters(n))
        self.counters = self.sketch.counters

    # -- start-up ------------------------------------------------------
    def _boot(self, now):
        marker = storage.read_marker(self.marker_path)
        self._recover(marker[0] if marker is not None else None)
        cur = now // self.p.epoch_s
        # a state written under the other persist scheme (config changed) is continued in
        # that scheme until its release: its draws are of that scheme's scale
        st = storage.read_state(self.state_path, self._fp, self.counters,
                                self._fps[0 if self.p.shadow else 1])
        if st is not None and (marker is None or st[0] > marker[0]):
            self.seq, self.elo, self.ehi, self.part, nz, other = st
            self.log("resumed state seq %d epochs [%d, %d) part %d" % st[:4])
            self.resumed = True
            self.sh = self.p.shadow != other
            if other:
                self.log("the state was written under persist_noise = %s; the config's scheme starts "
                         "with the next accumulator" % ("shadow" if self.sh else "refresh"))
            if self.sh:
                # counters hold the snapshot S = R - M: R = S + fresh Z_int', M = Z_int' + fresh G
                # (R - S = Z_int' + later events). The lost R's own Z_int is gone with the RAM;
                # the nz draws inside S stay in R.
                if self.shadow is None:  # the config's scheme is refresh: the state's own continues
                    self.shadow = new_counters(self.p.cells)
                self._shadow_pair(self.shadow, self.counters)
                self.nz = nz + 1
                self.nzm = nz + 1
                return
            # The flash copy must not equal the RAM state we now count into,
            # or RAM - flash would show the next events exactly: a fresh draw.
            self.nz = nz
            self._fresh()
            self._add_fresh()
            return
        self.seq = marker[0] + 1 if marker is not None else 0
        if marker is None:
            self._open(cur, 0)
            return
        if cur < marker[1]:
            self.log("the clock (epoch %d) is behind the last release [%d, %d); counting into epoch %d"
                     % (cur, marker[1], marker[2], marker[1]))
        epoch, part = self._next(cur, marker[1], marker[2], marker[3])
        self._open(epoch, part)

    @staticmethod
    def _next(cur, elo, ehi, part):
        """(epoch, part) of the accumulator that follows the released range.

        Keys (elo, ehi, part) never repeat: after the range's end a new
        epoch starts at part 0; before it (flush, or a clock that is behind)
        the next part of an epoch inside the range is used.
        """
        if cur >= ehi:
            return (cur, 0)
        return (cur if cur > elo else elo, part + 1)

    def _add_fresh(self):
        """counters += the staged fresh draw (mod 2**32), then wipe the draw.

        Cannot fail once started (wrap32 never raises), so the draw is
        never half-applied.
        """
        add_staged(self.relbuf, self.counters)
        self.nz += 1

    def _open(self, epoch, part):
        """Start a fresh accumulator for [epoch, epoch+1) holding only Z_int.

        The noise is drawn into the scratch buffer and swapped in only when
        complete; if drawing fails the open stays pending and nothing is
        counted (or persisted) until it succeeds: the old array is released
        data and a half-noised array would expose events.
        """
        self._pending = (epoch, part)
        self.sh = self.p.shadow
        if self.shadow is not None and not self.sh:  # the config's scheme is refresh (a migrated state was released)
            zero(self.shadow)
            self.shadow = None
        if self.sh:
            if self.shadow is None:
                self.shadow = new_counters(self.p.cells)
            self._shadow_pair(self.shadow)  # relbuf = Z_int, M = Z_int + G_0
        else:
            self._fresh(False)  # relbuf = Z_int
        self.counters, self.relbuf = self.relbuf, self.counters
        self.sketch.counters = self.counters
        self._wipe()  # the old accumulator (released data) leaves RAM
        self.elo = epoch
        self.ehi = epoch + 1
        self.part = part
        self.nz = 1
        self.nzm = 1
        self._pending = None
        self._redraw = False  # a new accumulator: no stale copy of it exists

    def _ensure_open(self):
        if self._pending is not None:
            self._open(self._pending[0], self._pending[1])
        if self._redraw:
            self._renoise()

    def _renoise(self):
        """After a failed commit (its .tmp counts as written: state + Z_out may
        be on flash): one fresh internal draw Y into the accumulator before it
        counts again, so the next release and the stale .tmp differ by events
        plus Y (docs/PRIVACY.md "Failed writes and failed commits"). Under shadow Y also goes
        into M, so R - M, the flash track, is unchanged. nz grows by one."""
        self._fresh()
        if self.sh:
            add_staged(self.relbuf, self.counters, self.shadow)
            self.nz += 1
        else:
            self._add_fresh()
        self._redraw = False

    def redate(self, elo, ehi, part, now=None):
        """Re-label the open accumulator's epoch range [elo, ehi) and persist.

        For a board that counted before its clock was set: once UTC is
        known, the accumulator must cover the epochs its events really fell
        in (timing stays clock-driven; the noise is untouched). The caller
        must not pick a range that was already released with this ``part``.
        """
        if not (0 <= elo < ehi):
            raise ValueError("epoch range must satisfy 0 <= elo < ehi")
        self._ensure_open()
        self.elo = elo
        self.ehi = ehi
        self.part = part
        self.persist(now)

    # -- events --------------------------------------------------------
    def add(self, item, weight=1):
        if self._pending is not None or self._redraw:
            self._ensure_open()
        self.sketch.update(item, weight)

    def add_view(self, text, view, weight=1):
        """One event whose item is the bytes in ``view`` (Sketch.update_view: kinds cs and cms)."""
        if self._pending is not None or self._redraw:
            self._ensure_open()
        self.sketch.update_view(text, view, weight)

    def add_many(self, items, weights=None, adder=None):
        """Add a batch; ``adder(sketch, items, weights)`` may replace
        ``Sketch.update_many`` with an equal but faster path (the Pi
        daemon's numpy one, agent/pi/batch.py)."""
        if self._pending is not None or self._redraw:
            self._ensure_open()
        if adder is None or self.p.kind in ("dcs", "strhh"):  # the numpy path knows cms/cs rows only
            self.sketch.update_many(items, weights)
        else:
            adder(self.sketch, items, weights)

    # -- clock ---------------------------------------------------------
    def tick(self, now):
        """Call often with the UTC time: releases closed epochs, persists.

        Returns the number of releases committed (0 or 1). A clock that goes
        backwards releases nothing until it passes the open range again.
        """
        self._finish_rename()
        if self._pending is not None or self._redraw:
            try:
                self._ensure_open()
            except Exception as exc:  # MemoryError, NoEntropyError: retry next tick
                self.log("cannot draw noise for the next accumulator (%r); not counting" % (exc,))
                return 0
        cur = now // self.p.epoch_s
        if cur >= self.ehi:
            return 1 if self._release(cur, 0, now) else 0
        if now - self.last_persist >= self.p.persist_s:
            self.persist(now)
        return 0

    def flush(self, now):
        """Release the open accumulator now (end of a batch input).

        If its epoch is still running, the next accumulator covers the same
        epoch as the next ``part``.
        """
        self._ensure_open()
        epoch, part = self._next(now // self.p.epoch_s, self.elo, self.ehi, self.part)
        return self._release(epoch, part, now)

    def persist(self, now=None):
        """Write the noisy state to flash so that it never differs from RAM
        or from an earlier copy by exact events (docs/PRIVACY.md).

        refresh: write the accumulator, then add a fresh draw to it in RAM;
        every snapshot and the RAM state differ by events *plus* an
        independent draw, and the release carries one more draw per cell
        (its ``nz`` field). shadow: write S = R - M, then add a fresh G to
        M; the accumulator R is untouched. In both, the fresh draw is made
        *before* the write, so a failed draw leaves flash as it was.

        A write that was attempted counts as written (docs/PRIVACY.md "Failed
        writes"): whatever ended it (ENOSPC, EIO, MemoryError, ...), some of
        its bytes may be on flash, so the draw is added exactly as after a
        good write. Returns True if the file was written; a failure is logged
        (an Exception) or re-raised after the bookkeeping (anything else).
        """
        if self._pending is not None or self._redraw:
            return False  # released data, or a copy not yet re-noised after a failed commit
        try:
            self._fresh()
        except Exception as exc:
            self.log("cannot draw noise (%r); state not persisted" % (exc,))
            return False
        if now is not None:
            self.last_persist = now  # an attempt is a persist: a full flash is retried after persist_s
        if self.sh:
            return self._persist_shadow(now)
        err = None
        try:
            storage.write_state(self.state_path, self._fps[0], self.seq, self.elo, self.ehi, self.part, self.nz,
                                self.counters)
        except BaseException as exc:
            err = exc
        self._add_fresh()  # written or maybe partly written: the copy on flash must not equal RAM
        return self._failed(err, "cannot persist state (%s); counting continues in RAM")

    def _persist_shadow(self, now=None):
        """relbuf holds a fresh G. M becomes S = R - M for the write (S is
        what flash gets, so holding it in RAM meanwhile shows nothing more),
        then M = R - S + G: the old shadow plus the fresh draw -- also when
        the write failed (it counts as written), and cell by cell as far as
        the flip got if the flip itself failed: M never keeps S."""
        a = self.counters
        m = self.shadow
        b = self.relbuf
        n = len(m)
        i = 0
        err = None
        try:
            while i < n:
                m[i] = wrap32(a[i] - m[i])
                i += 1
            storage.write_state(self.state_path, self._fps[1], self.seq, self.elo, self.ehi, self.part, self.nzm, m)
        except BaseException as exc:
            err = exc
        for j in range(n):
            if j < i:
                m[j] = wrap32(a[j] - m[j] + b[j])  # R - S + G = M + G
            else:
                m[j] = wrap32(m[j] + b[j])  # not flipped yet: M + G
            b[j] = 0
        self.nzm += 1
        return self._failed(err, "cannot persist state (%s); counting continues in RAM")

    # -- releases ------------------------------------------------------
    def _release(self, next_epoch, next_part, now=None):
        """Commit state + Z_out to the outbox (pansketch.agent.accum.Core._commit), then
        open the next accumulator.

        A failed commit (the .tmp or the marker write fails, in any way)
        counts as written: the accumulator gets a fresh internal draw before
        it counts again (``_renoise``) and keeps counting, its range growing.
        A full outbox writes nothing and costs no draw.
        """
        s = self.seq
        err, tried = self._commit(0, None, self.elo, self.ehi, self.part, self.nz + 1, self.p.internal_noise(self.sh))
        if err is not None:
            if tried:
                self._redraw = True  # before any further event (or persist) of this accumulator
            if not isinstance(err, Exception):
                raise err  # KeyboardInterrupt & co.: the fresh draw waits for the next add/tick/persist
            storage.remove(self.outbox.path(s, ".tmp"))
            if tried:
                try:
                    self._renoise()
                except Exception as exc:  # retried at every tick, add and persist until it succeeds
                    self.log("cannot draw noise after a failed commit (%r); not counting" % (exc,))
            if next_part == 0 and next_epoch + 1 > self.ehi:
                self.ehi = next_epoch + 1  # keep counting; release the longer range later
            return self._failed(err, "cannot write release %d (%%s); epochs now [%d, %d)" % (s, self.elo, self.ehi))
        if not tried:
            return False  # the output noise could not be drawn: retried
        self.seq = s + 1
        self._pending = (next_epoch, next_part)  # released: never persisted or counted into again
        if now is not None:
            self.last_persist = now
        self._rename(s)
        try:
            self._open(next_epoch, next_part)
        except Exception as exc:
            self.log("release %d committed, but the next accumulator's noise failed (%r); retrying" % (s, exc))
        return True
