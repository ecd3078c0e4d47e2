"""Pan-private distinct count: a fixed-point form of pan-private-sketches.txt Alg. 1.

The paper keeps r random projections sk_j = sum_i a_i X_ij of the frequency
vector a, with X_ij drawn from a p-stable law (p small), starts every sk_j
with Laplace noise scaled to its sensitivity 2 Z ||X_j||_inf, and estimates
the distinct count D from median_j |sk_j|^p (Cormode et al.: for small p,
sum_i |a_i|^p is within (1 +- eps) of D when |a_i| <= Z).

This module is that algorithm in the MicroPython subset, with integers only:

* Projections. The paper's X_ij = stable(r1, r2, p) needs sin, cos and log
  (floats that differ between ports). Here p = 1/q for an integer q and
      X_ij = s_ij * (2^(b+F) // (v_ij + 1)) ** q
  where v_ij (the top b <= 30 bits of row j's 30-bit value) and the sign s_ij
  come from the hash stream of the item (pansketch.agent.hashing, hash version 1).
  With U = (v+1)/2^b uniform,
  |X| ~ 2^(Fq) * U^(-1/p): a symmetric Pareto(p) variable, which lies in the
  domain of attraction of the p-stable law (sums of many behave like
  (sum |a_i|^p)^(1/p) times a stable variable). The host calibrates the
  median of |sum|^p by simulating the very same integer projection
  (pansketch.host_tools.lab.algorithms.panprivate.distinct_scale).
* Bounded projections => bounded sensitivity. v >= 0, so every projection
  satisfies |X_ij| <= M = 2^((b+F) q), a public constant that holds for every
  possible item -- the paper's ||X_j||_inf over the universe, known exactly
  and in advance. One event with weight clipped to [-c, c] moves each sk_j by
  at most c*M (L1 sensitivity r*c*M over the r entries, docs/ARCHITECTURE.md's event
  unit); replacing all occurrences of an ID with total |a_i| <= Z (the
  paper's user-level unit) moves each sk_j by at most 2*Z*M. The discrete
  Laplace with scale r*Delta/eps on each entry is therefore eps-DP for the
  whole vector (geometric mechanism + composition over the r entries, as in
  the paper's alpha' = alpha*r).
* Noise. Exact discrete Laplace from pansketch.agent.noise (integer arithmetic on a
  cryptographic byte source) in place of continuous Laplace: same scale,
  same eps. Internal noise at initialisation (the state an intruder reads is
  always noisy) and fresh output noise on every :meth:`release` (docs/ARCHITECTURE.md "Release modes":
  without it, release minus state would reveal the events in between).

Integers exceed 31 bits (M has (b+F)*q bits), so MicroPython uses its
arbitrary-precision ints: one digest per event plus r big-int additions and
powers. Honest caveat, measured by ``pansketch repro panprivate``: since
|X| <= M, the noise floor in the |.|^p domain is about (r Delta/eps)^p * 2^b
in units of D, i.e. the additive error is of the order of 1/P(|X| = M) = 2^b,
while distinct counts above ~2^b lose the stable scaling -- the paper's
Theorem 5 treats max_j ||X_j||_inf as a constant, which a p-stable (or
Pareto) tail does not allow.
"""

from pansketch.agent import hashing
from pansketch.agent.levels import clip
from pansketch.agent.noise import discrete_laplace

UNITS = ("event", "user")


class DistinctSketch:
    """r integer projections with discrete Laplace noise (internal + output).

    ``q``: p = 1/q. ``vbits``: b. ``frac_bits``: F. ``unit``: 'event' (weights clipped to
    [-clip, clip]) or 'user' (caller guarantees |a_i| <= z per ID).
    ``eps`` is (num, den). ``counters`` restores a persisted (noisy) state.
    """

    def __init__(self, r, prefix, rng, eps, q=16, vbits=16, frac_bits=8, unit="event", clip=1, z=1,
                 counters=None):
        if r < 1 or q < 1 or frac_bits < 0 or not (1 <= vbits <= 30):
            raise ValueError("need r >= 1, q >= 1, frac_bits >= 0, 1 <= vbits <= 30")
        if unit not in UNITS:
            raise ValueError("unit must be 'event' or 'user'")
        en, ed = eps
        if en <= 0 or ed <= 0:
            raise ValueError("eps must be positive")
        self.r = r
        self.prefix = prefix
        self.rng = rng
        self.q = q
        self.drop = 30 - vbits
        self.shift = vbits + frac_bits
        self.clip = clip
        self.bound = 1 << (self.shift * q)  # M: |X_ij| <= M for every item
        if unit == "event":
            sens = clip * self.bound
        else:
            sens = 2 * z * self.bound
        # discrete Laplace scale t = r * sens / eps per entry
        self.scale_num = r * sens * ed
        self.scale_den = en
        if counters is None:
            counters = [discrete_laplace(rng, self.scale_num, self.scale_den) for _ in range(r)]
        elif len(counters) != r:
            raise ValueError("counters must have r entries")
        self.sk = list(counters)

    def projection(self, stream, j):
        """X_ij for row j of a hash stream (integer, |X| <= bound)."""
        v = hashing.row_value(stream, j) >> self.drop
        x = ((1 << self.shift) // (v + 1)) ** self.q
        return x * hashing.row_sign(stream, j)

    def update(self, item, weight=1):
        weight = clip(weight, self.clip)
        if not weight:
            return
        s = hashing.digest(self.prefix, item, self.r)
        sk = self.sk
        for j in range(self.r):
            sk[j] = sk[j] + weight * self.projection(s, j)

    def release(self):
        """The state plus fresh output noise (a new list; the state is unchanged)."""
        rng = self.rng
        return [v + discrete_laplace(rng, self.scale_num, self.scale_den) for v in self.sk]
