"""Exact discrete Laplace and discrete Gaussian samplers.

Implements Canonne, Kamath & Steinke, "The Discrete Gaussian for
Differential Privacy" (NeurIPS 2020):

* Algorithm 1 -- Bernoulli(exp(-gamma)) for rational gamma >= 0;
* Algorithm 2 -- discrete Laplace with rational scale t = s_num/s_den,
  pmf(x) proportional to exp(-|x|/t);
* Algorithm 3 -- discrete Gaussian with rational variance parameter
  sigma^2 = n/d, pmf(x) proportional to exp(-x^2 / (2 sigma^2)).

Every step uses integers and rationals held as (numerator, denominator)
pairs, so there is no floating point anywhere on the noise path (Mironov
2012 showed how floating-point Laplace leaks). Randomness comes only from
:class:`pansketch.agent.rng.Rng`, i.e. from a cryptographic byte source.
"""


def isqrt(n):
    """floor(sqrt(n)) for an integer n >= 0 (Newton's method)."""
    if n < 0:
        raise ValueError("isqrt of negative number")
    if n < 2:
        return n
    x = n
    y = (x + 1) >> 1
    while y < x:
        x = y
        y = (x + n // x) >> 1
    return x


def bernoulli_exp(rng, num, den):
    """True with probability exp(-num/den), for num >= 0, den > 0.

    CKS 2020 Algorithm 1. For gamma = num/den <= 1 it draws
    A_k ~ Bernoulli(gamma/k) until one fails and returns whether the
    number of draws K was odd; for gamma > 1 it uses
    exp(-gamma) = exp(-1)^floor(gamma) * exp(-(gamma - floor(gamma))).
    """
    if num < 0 or den <= 0:
        raise ValueError("bernoulli_exp needs num >= 0 and den > 0")
    if num <= den:
        # A_k ~ Bernoulli(gamma/k) = [randbelow(den*k) < num] until one fails
        # (rng.randbelow(...) directly: a cached bound method allocates on MicroPython)
        k = 1
        dk = den
        while rng.randbelow(dk) < num:
            k += 1
            dk += den
        return (k & 1) == 1
    whole = num // den
    for _ in range(whole):
        if not _bexp1(rng):
            return False
    return bernoulli_exp(rng, num - whole * den, den)


def _bexp1(rng):
    """Bernoulli(exp(-1)): bernoulli_exp(rng, 1, 1) with the same draws."""
    k = 1
    while rng.randbelow(k) < 1:
        k += 1
    return (k & 1) == 1


def _wiped(sampler, rng, num, den, what):
    """One sample of ``sampler`` with the positive rational parameter num/den
    (else ValueError: ``what``). The Rng's byte buffer is wiped however it
    ends (a sample, an exception): the bytes it was drawn from never linger."""
    try:
        if num <= 0 or den <= 0:
            raise ValueError(what)
        return sampler(rng, num, den)
    finally:
        rng.wipe()


def discrete_laplace(rng, s_num, s_den=1):
    """One draw of the discrete Laplace distribution with scale t = s_num/s_den.

    P[X = x] is proportional to exp(-|x| / t). CKS 2020 Algorithm 2 with
    their (s, t) written as scale = t/s; here the scale is ``s_num/s_den``
    so the algorithm's t is ``s_num`` and its s is ``s_den``. The Rng's
    byte buffer is wiped when the sample is done (pansketch.agent.rng.Rng).
    """
    return _wiped(_dlap, rng, s_num, s_den, "discrete_laplace needs a positive rational scale")


def _dlap(rng, t, s):
    while True:
        u = rng.randbelow(t)
        if not bernoulli_exp(rng, u, t):
            continue
        v = 0
        while _bexp1(rng):
            v += 1
        x = u + t * v
        y = x // s
        negative = rng.randbelow(2) < 1
        if negative and y == 0:
            continue
        return -y if negative else y


def discrete_gaussian(rng, var_num, var_den=1):
    """One draw of the discrete Gaussian N_Z(0, sigma^2), sigma^2 = var_num/var_den.

    CKS 2020 Algorithm 3: propose Y ~ discrete Laplace with integer scale
    t = floor(sigma) + 1 and accept with probability
    exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)). With sigma^2 = n/d that exponent
    is (|Y| d t - n)^2 / (2 n d t^2), an exact rational. The Rng's byte
    buffer is wiped when the sample is done (pansketch.agent.rng.Rng).
    """
    return _wiped(_dgauss, rng, var_num, var_den, "discrete_gaussian needs a positive rational variance")


def _dgauss(rng, n, d):
    t = isqrt(n // d) + 1
    den = 2 * n * d * t * t
    while True:
        y = _dlap(rng, t, 1)
        a = (y if y >= 0 else -y) * d * t - n
        if bernoulli_exp(rng, a * a, den):
            return y


class NoiseSpec:
    """A noise distribution: mechanism name and its rational parameter.

    ``mech`` is ``"dlap"`` (parameter = scale t) or ``"dgauss"`` (parameter =
    variance sigma^2); ``num/den`` is the parameter as a reduced fraction.
    """

    __slots__ = ("mech", "num", "den")

    def __init__(self, mech, num, den=1):
        if mech not in ("dlap", "dgauss"):
            raise ValueError("unknown mechanism %r (use 'dlap' or 'dgauss')" % (mech,))
        if num <= 0 or den <= 0:
            raise ValueError("noise parameter must be positive")
        self.mech = mech
        self.num = num
        self.den = den

    def sample(self, rng):
        if self.mech == "dlap":
            return discrete_laplace(rng, self.num, self.den)
        return discrete_gaussian(rng, self.num, self.den)

    def __eq__(self, other):
        return (
            isinstance(other, NoiseSpec)
            and self.mech == other.mech
            and self.num * other.den == other.num * self.den
        )

    def __repr__(self):
        return "NoiseSpec(%r, %d, %d)" % (self.mech, self.num, self.den)


def wrap32(v):
    """v reduced to the int32 residue of v mod 2**32 (two's complement).

    Counters are elements of the group Z/2^32 (docs/PRIVACY.md, "Counters
    wrap"): every update, noise addition and release is a group operation,
    so nothing ever overflows, is refused or retried, and the release's
    value and timing never depend on how close the counts are to 2**31.
    """
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return v
    return ((v + 0x80000000) & 0xFFFFFFFF) - 0x80000000


def add_noise(arr, spec, rng, start=0, stop=None):
    """Add independent draws of ``spec`` to ``arr[start:stop]`` in place (mod 2**32).

    Every cell gets exactly one draw, whatever its value: a draw is never
    repeated or rejected because of the counts (the sum wraps, wrap32).
    """
    if stop is None:
        stop = len(arr)
    bulk = getattr(rng, "bulk_noise", None)  # the Pi daemon's numpy sampler (agent/pi/bulknoise.py)
    if bulk is not None and bulk(arr, spec, start, stop):
        return
    for i in range(start, stop):
        arr[i] = wrap32(arr[i] + spec.sample(rng))


def zero(arr):
    """Zero an array in place (no allocation): wiping a buffer the intruder could read."""
    for i in range(len(arr)):
        arr[i] = 0


def draw_into(arr, spec, rng):
    """arr = one fresh independent draw of ``spec`` per cell.

    The array is zeroed first and zeroed again if the draw fails (no
    entropy, low memory): a half draw is never left beside the state.
    """
    zero(arr)
    try:
        add_noise(arr, spec, rng)
    except BaseException:
        zero(arr)
        raise


def add_staged(staged, a, b=None):
    """a (and b) += the staged draw, mod 2**32, then zero the draw: it leaves RAM.

    Cannot fail once started (wrap32 never raises), so a draw is never
    half-applied.
    """
    if b is None:
        for i in range(len(a)):
            a[i] = wrap32(a[i] + staged[i])
            staged[i] = 0
        return
    for i in range(len(a)):
        z = staged[i]
        a[i] = wrap32(a[i] + z)
        b[i] = wrap32(b[i] + z)
        staged[i] = 0
