"""Calibration: privacy budget -> noise parameters, and back.

Unit of privacy: one event (add/remove). With weights clipped to
[-c, c], one event moves each of the d rows of each of the L arrays it
touches by at most c (docs/ARCHITECTURE.md "Threat model and unit of privacy"), so

    L1 sensitivity  Delta1   = L * d * c
    L2 sensitivity  Delta2^2 = L * d * c^2

and (docs/ARCHITECTURE.md "Noise"; Canonne, Kamath & Steinke 2020):

    discrete Laplace, eps-DP:    scale  t       = Delta1 / eps
    discrete Gaussian, rho-zCDP: sigma^2        = Delta2^2 / (2 rho)

The discrete Laplace bound is the standard geometric mechanism; the
discrete Gaussian bound is CKS 2020 Theorem 14 (multivariate discrete
Gaussian: rho = Delta2^2 / (2 sigma^2) exactly as for the continuous one).
The same scale is used for the internal noise (state) and for the output
noise (release): each event is then hidden by one full-scale noise against
every release plus one intrusion (docs/PRIVACY.md).

L is 1 in the ``window`` and ``keep`` modes and the number of dyadic levels
in ``tree`` mode. All values are exact fractions (num, den) of integers.
"""

from pansketch.agent.noise import NoiseSpec

MODES = ("window", "keep", "tree")
MECHANISMS = ("dlap", "dgauss")


def gcd(a, b):
    while b:
        a, b = b, a % b
    return a if a >= 0 else -a


def reduce(num, den):
    if den == 0:
        raise ZeroDivisionError("zero denominator")
    if den < 0:
        num, den = -num, -den
    g = gcd(num, den) or 1
    return (num // g, den // g)


def parse_ratio(value):
    """Exact fraction from an int, a decimal string ('0.25', '1e-2') or 'a/b'.

    Floats are refused: '0.1' as a float is not 1/10. Returns (num, den).
    """
    if isinstance(value, bool):
        raise ValueError("expected a number, not a bool")
    if isinstance(value, int):
        return (value, 1)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return reduce(int(value[0]), int(value[1]))
    if not isinstance(value, str):
        raise ValueError("give privacy parameters as strings or integers, not %s" % type(value).__name__)
    s = value.strip()
    if "/" in s:
        a, b = s.split("/", 1)
        return reduce(int(a.strip()), int(b.strip()))
    exp = 0
    low = s.lower()
    if "e" in low:
        mant, e = low.split("e", 1)
        exp = int(e)
        s = mant
    neg = s.startswith("-")
    if neg or s.startswith("+"):
        s = s[1:]
    if "." in s:
        ip, fp = s.split(".", 1)
    else:
        ip, fp = s, ""
    if not (ip + fp) or not (ip + fp).isdigit():
        raise ValueError("not a decimal number: %r" % (value,))
    num = int(ip + fp) if (ip + fp) else 0
    den = 10 ** len(fp)
    if exp > 0:
        num *= 10 ** exp
    elif exp < 0:
        den *= 10 ** (-exp)
    if neg:
        num = -num
    return reduce(num, den)


def ratio_str(r):
    return "%d" % r[0] if r[1] == 1 else "%d/%d" % (r[0], r[1])


def sensitivity(d, clip, arrays=1):
    """(Delta1, Delta2^2) for one event touching ``arrays`` arrays of d rows."""
    return (arrays * d * clip, arrays * d * clip * clip)


def noise_for(mech, budget, d, clip=1, arrays=1):
    """The NoiseSpec for a budget (eps for 'dlap', rho for 'dgauss').

    ``budget`` is anything :func:`parse_ratio` accepts. The same spec is
    used for internal and for output noise.
    """
    bn, bd = parse_ratio(budget)
    if bn <= 0:
        raise ValueError("privacy budget must be positive")
    l1, l2sq = sensitivity(d, clip, arrays)
    if mech == "dlap":
        num, den = reduce(l1 * bd, bn)  # t = Delta1 / eps
    elif mech == "dgauss":
        num, den = reduce(l2sq * bd, 2 * bn)  # sigma^2 = Delta2^2 / (2 rho)
    else:
        raise ValueError("unknown mechanism %r (use 'dlap' or 'dgauss')" % (mech,))
    return NoiseSpec(mech, num, den)


def guarantee(spec, d, clip=1, arrays=1):
    """The budget a NoiseSpec gives, as (name, (num, den)).

    'dlap' -> ('eps', Delta1 / t); 'dgauss' -> ('rho', Delta2^2 / (2 sigma^2)).
    """
    l1, l2sq = sensitivity(d, clip, arrays)
    if spec.mech == "dlap":
        return ("eps", reduce(l1 * spec.den, spec.num))
    return ("rho", reduce(l2sq * spec.den, 2 * spec.num))


def zcdp_to_approx_dp(rho, delta):
    """eps such that rho-zCDP implies (eps, delta)-DP (host-side reporting).

    Bun & Steinke 2016 Prop. 1.3: eps = rho + 2 sqrt(rho ln(1/delta)).
    Floats are fine here: this is a report, not the noise path.
    """
    import math

    if isinstance(rho, tuple):
        rho = rho[0] / rho[1]
    if not (0 < delta < 1):
        raise ValueError("delta must be in (0, 1)")
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


def arrays_touched(mode, levels=1):
    """L for a mode: 1 for window/keep, the number of tree levels for tree."""
    if mode not in MODES:
        raise ValueError("unknown mode %r (use one of %s)" % (mode, ", ".join(MODES)))
    return levels if mode == "tree" else 1
