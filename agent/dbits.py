"""Pan-private distinct count (kind ``dbits``): the density estimator of Dwork,
Naor, Pitassi, Rothblum and Yekhanin, "Pan-private streaming algorithms"
(ICS 2010), with hashed buckets and geometric levels.

State: K levels (``d``) of m bits (``w``, a multiple of 8), packed in one
bytearray (level k, bucket j = bit (k*m + j) % 8 of byte (k*m + j) // 8).

* Internal randomness: every bit starts as Bern(1/2) (random bytes from the
  CSPRNG).
* An arrival of item x: one SHA-256 (hash version 1 under the prefix
  ``salt prefix + "/dbits"``, two rows): row 0's 30-bit value v gives the
  level k = min(trailing zeros of v, K - 1) (P = 2^-(k+1), the last level
  takes the rest); row 1's value mod m gives the bucket j. The bit (k, j)
  is re-drawn from Bern(1/2 + eps/4) (eps = the budget; exact rational
  draw). Repeats of x re-draw the same bit, so the state depends on x only
  through whether x appeared. The likelihood ratios of a bit, present vs
  absent, are 1 + eps/2 (a 1) and 1 - eps/2 (a 0), so the reverse ratio
  2/(2 - eps) is the binding one: eps-DP in both directions needs
  2/(2 - eps) <= e^eps, i.e. eps <= 1.5936 (pansketch.agent.params.dbits_eps_ok,
  checked exactly in integers; Params refuses larger budgets).
* Release: per level the count of one-bits plus fresh discrete Laplace noise
  of scale 1/eps (an item arriving after an intrusion changes one count by
  at most 1), K int32 counters. Fixed size, clock timing, outbox commit
  protocol: pansketch.agent.recorder (this class is a Recorder with another state).
* Persist: the bit array is **never written to flash**. A bit changes only
  when an item of its bucket arrives, so an older copy and a newer one
  would differ exactly at the touched buckets (docs/PRIVACY.md "Distinct
  counts"); a restart therefore starts the epoch's bits afresh (the events
  before it are lost for the distinct count; the release says so by its
  part/epoch key like any early release).

Host estimator: host_tools/query/distinct.py.
"""

from pansketch.agent import hashing
from pansketch.agent.noise import add_noise
from pansketch.agent.params import DBITS_EPS_MAX, dbits_eps_ok
from pansketch.agent.recorder import Recorder
from pansketch.agent.sketch import new_counters
from pansketch.agent import storage

MAX_LEVELS = 30


def dbits_prefix(prefix):
    return prefix + b"/dbits"


def slot(stream, levels, m):
    """(level, bucket) of an item's hash stream (two rows)."""
    v = stream[0] | (stream[1] << 8) | (stream[2] << 16) | ((stream[3] & 0x3F) << 24)
    k = 0
    while k < levels - 1 and not (v >> k) & 1:
        k += 1
    u = stream[4] | (stream[5] << 8) | (stream[6] << 16) | ((stream[7] & 0x3F) << 24)
    return k, u % m


class DensityBits:
    """Parameters and the bit array (``counters``); the recorder draws the randomness."""

    def __init__(self, levels, m, prefix, eps, bits):
        if not (1 <= levels <= MAX_LEVELS) or m < 8 or m % 8:
            raise ValueError("dbits needs 1 <= d (levels) <= %d and w (bits per level) a multiple of 8" % MAX_LEVELS)
        self.kind = "dbits"
        self.d = levels
        self.w = m
        self.prefix = dbits_prefix(prefix)
        if not dbits_eps_ok(eps[0], eps[1]):
            raise ValueError("dbits needs eps <= %s (eps-DP both ways)" % DBITS_EPS_MAX)
        # Bern(1/2 + eps/4) = (2 den + num) / (4 den)
        self.p_num = 2 * eps[1] + eps[0]
        self.p_den = 4 * eps[1]
        if len(bits) * 8 != levels * m:
            raise ValueError("bit array has the wrong size")
        self.counters = bits

    def position(self, item):
        k, j = slot(hashing.digest(self.prefix, item, 2), self.d, self.w)
        return k * self.w + j

    def ones(self, level):
        """Number of one-bits of a level."""
        b = self.counters
        lo = level * self.w // 8
        n = 0
        for i in range(lo, lo + self.w // 8):
            x = b[i]
            while x:
                x &= x - 1
                n += 1
        return n


class DistinctRecorder(Recorder):
    """pansketch.agent.recorder.Recorder for kind dbits: same clock, keys, outbox and
    commit protocol; the accumulator is the bit array (no state file)."""

    def _make_state(self, params):
        self.relbuf = new_counters(params.d)  # release counts, staged; all zeros between calls
        self.sketch = DensityBits(params.d, params.w, hashing.salt_prefix(params.salt), params.budget,
                                  bytearray(params.d * params.w // 8))
        self.counters = self.sketch.counters

    def _boot(self, now):
        storage.remove(self.state_path)  # never written by this kind; a stale file is not ours to resume
        Recorder._boot(self, now)

    def _new_bits(self):
        """Every bit afresh from Bern(1/2): all zero first (the old bits leave RAM),
        then random bytes; the Rng's buffer is wiped however the draw ends."""
        b = self.counters
        for i in range(len(b)):
            b[i] = 0
        rng = self.rng
        try:
            for i in range(len(b)):
                b[i] = rng.randbits(8)
        finally:
            rng.wipe()

    def _open(self, epoch, part):
        """Fresh Bern(1/2) bits for [epoch, epoch+1); counting waits until complete."""
        self._pending = (epoch, part)
        self._wipe()  # the staged release counts (published) leave the scratch buffer
        self._new_bits()  # the released epoch's bits leave RAM first
        self.elo = epoch
        self.ehi = epoch + 1
        self.part = part
        self.nz = 1
        self._pending = None
        self._redraw = False

    def _renoise(self):
        """A failed commit counts as written (docs/PRIVACY.md "Failed writes and failed commits"):
        the .tmp (this epoch's counts + Z_out) may be on flash, so the bits
        start afresh from Bern(1/2) before the next item, as after a restart
        (the items before are lost for the distinct count). Counting waits
        until the draw is complete."""
        self._redraw = True
        self._new_bits()
        self._redraw = False

    def persist(self, now=None):
        """Nothing is written (see the module docstring); the clock is noted."""
        if now is not None:
            self.last_persist = now
        return self._pending is None and not self._redraw

    def _stage_release(self, rel, src=None):
        sk = self.sketch
        for k in range(sk.d):
            rel[k] = sk.ones(k)
        add_noise(rel, self.p.noise, self.rng)  # fresh output noise, scale 1/eps

    def _arrive(self, pos):
        rng = self.rng
        try:
            bit = rng.bernoulli(self.sketch.p_num, self.sketch.p_den)
        finally:
            rng.wipe()
        i = pos >> 3
        mask = 1 << (pos & 7)
        b = self.counters
        if bit:
            b[i] = b[i] | mask
        else:
            b[i] = b[i] & (0xFF ^ mask)

    def add(self, item, weight=1):
        if self._pending is not None or self._redraw:
            self._ensure_open()
        if weight >= 1:
            self._arrive(self.sketch.position(item))

    def add_many(self, items, weights=None, adder=None):
        """Each distinct item of the batch re-draws its bit once (a re-draw of a
        re-draw has the same distribution). ``adder`` (the daemon's numpy path
        for cms/cs) does not apply."""
        if self._pending is not None or self._redraw:
            self._ensure_open()
        seen = {}
        i = 0
        for x in items:  # first-occurrence order: dict order differs between the VMs, the draws must not
            if (weights is None or weights[i] >= 1) and x not in seen:
                seen[x] = 1
                self._arrive(self.sketch.position(x))
            i += 1
        seen.clear()
