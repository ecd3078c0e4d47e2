"""Parse and validate one release message (format v2 and v1, agent/release.py).

Checks, in order; the first failure raises :class:`Rejected` with a short
``code`` and a human ``reason`` (logged and kept in the rejections table):

=========  =================================================================
code       meaning
=========  =================================================================
size       payload larger than ``max_bytes`` (checked before decoding)
cbor       not the CBOR subset of a release, found at the byte level
           before any object is built (pansketch.host_tools.cborscan): truncated,
           trailing bytes, indefinite lengths, reserved heads, lengths beyond
           the message, duplicate or non-text map keys, too deep, too many
           items; decided over the whole message before ``type``
type       tags (any), floats or simple values the device encoder never
           writes (byte level: no tag reaches a CBOR object decoder)
version    ``v`` missing (the top-level item is not a map, or has no ``v``)
           or not a version this host understands (1, 2: docs/FORMAT.md §2.1)
schema     missing/unknown field, wrong type, value out of range
shape      ``len(ctr) != 4*d*w`` (kind dcs: 4*(b+1)*d*w; strhh: 4*b*d*w; dbits: 4*d)
encoding   not the deterministic CBOR agent/cbor.py writes (so equal
           content always has equal bytes)
topic      the topic is not exactly the configured filter (default
           ``pansketch/+/release``) with a valid device id, or its device
           level differs from ``dev``
fleet      parameters differ from the fleet config (salt id, kind, d, w,
           mechanism)
noise      ``nout`` is not the noise that ``budget`` calibrates to
           (pansketch.agent.calibrate.noise_for), or ``nint`` is neither that nor
           (v2) the calibration for 2L arrays (the shadow persist
           scheme): a release may not claim a budget its noise does not
           give
=========  =================================================================

Versions: v2 (current devices) has the key ``lvl`` and allows mode
``tree``; v1 (older devices) has no ``lvl`` and only window/keep. Tree
nodes must be dyadic: ``ehi - elo == 2**lvl``, ``elo % 2**lvl == 0``,
``lvl <= L - 1`` (the root is the horizon) and ``win_s == ep_s * 2**(L-1)``
(``win`` is then the tree's index). In window/keep mode ``L == 1`` (``b + 1``
for kind dcs, ``b`` for strhh) and ``lvl == 0``. Kinds dcs (keys ``b``, ``map``),
strhh (key ``b``) and dbits exist only in v2 and never in tree mode (tree nodes
are cms/cs sketches). Every bound is a constant below; docs/FORMAT.md section
2.3 lists them and tests/test_format_limits.py compares the two.

``nz`` (2 <= nz <= MAX_NZ) is the number of independent noise draws per
cell of ``ctr``: nz - 1 draws of the internal noise ``nint`` (the initial
one plus, under the refresh persist scheme, a fresh one after every
persist and every restart, so a copy of the state on flash never differs
from a later one by the exact events alone; under shadow, the G draws of
the flash track a restart carried in) and one draw of the output noise ``nout``.
Kind dbits keeps nothing on flash: exactly nz = 2. A release with nz < 2
would claim less than the internal + output noise every release carries.

Per-device consistency with earlier releases and key conflicts need the
store and are checked in :mod:`pansketch.host_tools.store.write` (codes ``device`` and
``conflict``).
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any, Optional

import cbor2

from pansketch.agent import calibrate, cbor, hashing
from pansketch.agent.params import DBITS_EPS_MAX, MAX_LEVELS, dbits_eps_ok
from pansketch.host_tools import cborscan
# the validated release and the refusal live with the store that keeps them; re-exported here
from pansketch.host_tools.store.records import STATE_FIELDS, Rejected, Release, SketchShape  # noqa: F401

FIELDS_V1 = ("v", "dev", "seq", "mode", "kind", "d", "w", "hv", "salt", "clip", "mech", "budget", "nint",
             "nout", "nz", "L", "win_s", "ep_s", "win", "elo", "ehi", "part", "ctr")
FIELDS = FIELDS_V1 + ("lvl",)  # format v2
VERSIONS = {1: FIELDS_V1, 2: FIELDS}
MAX_EPOCH = 1 << 53  # keeps every epoch index and epoch*ep_s exact in SQLite and float
MAX_U32 = 0xFFFFFFFF
MAX_NZ = 1_000_000  # noise draws per cell (internal draws + 1 output draw)
MAX_SPAN = 1 << 20  # epochs one release may cover (a range grows only while a device's flash is full)
SUPPORTED_MODES = ("window", "keep", "tree")
MODES_BY_VERSION = {1: ("window", "keep"), 2: SUPPORTED_MODES}
SUPPORTED_VERSIONS = (1, 2)
# format version 2 (docs/FORMAT.md): every release has ``lvl``; kind dcs adds ``b`` and ``map``
FIELDS_V2 = FIELDS
KIND_FIELDS = {"dcs": ("b", "map"), "strhh": ("b",)}
V2_KINDS = ("cms", "cs", "dcs", "dbits", "strhh")
STRHH_L = (3, 64)  # pansketch.agent.strhh.MIN_L, MAX_L: kind strhh's b = item bytes = levels
STRHH_MIN_D = 3  # pansketch.agent.params: the host's descent needs a median of >= 2 rows above its threshold
DBITS_NZ = 2  # a dbits release carries its bits' initial draw and one output draw, never more (agent/dbits.py)
DBITS_MAX_D = 30  # dbits levels K
DBITS_W_MULTIPLE = 8  # dbits w (bits per level) is a multiple of this: the device packs each level in bytes
MAX_D = 32
MAX_W = 1 << 24
MAX_CLIP = 1 << 20
MAX_L = 4096
MAX_LVL = 63
MAX_SECONDS = 366 * 86400  # longest epoch, and longest window outside tree mode
MAX_DCS_B = 62
TREE_KINDS = ("cms", "cs")  # pansketch.agent.params refuses tree mode with dcs/dbits (docs/FORMAT.md)
MAX_MAP = 1 << 62
RATIO_BOUNDS = (1, 1 << 63)  # budget/nint/nout num and den: positive, below 2^63 (stored as signed 64-bit)



def _int(m: dict[str, Any], k: str, lo: int, hi: int) -> int:
    v = m[k]
    if type(v) is not int:  # not bool either (a subclass of int)
        raise Rejected("schema", "field %r must be an integer, got %s" % (k, type(v).__name__))
    if not lo <= v <= hi:
        raise Rejected("schema", "field %r = %d out of range [%d, %d]" % (k, v, lo, hi))
    return v


def _str(m: dict[str, Any], k: str, allowed: Optional[tuple[str, ...]] = None) -> str:
    v = m[k]
    if type(v) is not str:  # cborscan builds plain str
        raise Rejected("schema", "field %r must be a text string, got %s" % (k, type(v).__name__))
    if allowed is not None and v not in allowed:
        raise Rejected("schema", "field %r = %r is not one of %s" % (k, v, ", ".join(allowed)))
    return v


def _ratio(m: dict[str, Any], k: str) -> tuple[int, int]:
    v = m[k]
    if type(v) is not list or len(v) != 2 or type(v[0]) is not int or type(v[1]) is not int:
        raise Rejected("schema", "field %r must be a pair [num, den] of integers" % k)
    n, d = v
    lo, hi = RATIO_BOUNDS
    if not (lo <= n < hi and lo <= d < hi):
        raise Rejected("schema", "field %r = %d/%d must be a positive fraction with num, den < 2^63" % (k, n, d))
    if math.gcd(n, d) != 1:  # devices write reduced fractions (pansketch.agent.calibrate); one value, one encoding
        raise Rejected("schema", "field %r = %d/%d is not a reduced fraction" % (k, n, d))
    return (n, d)


DEVICE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # docs/FORMAT.md section 1; pansketch.agent.params.DEVICE_CHARS
SALT_ID = re.compile(r"[0-9a-f]{16}")
DEFAULT_TOPIC = "pansketch/+/release"


def valid_device(dev: str) -> bool:
    """The device id rules of pansketch.agent.params.Params: 1-64 ASCII letters, digits, '.', '_', '-'."""
    return type(dev) is str and DEVICE_ID.fullmatch(dev) is not None


def topic_device(topic: str, topic_filter: str = DEFAULT_TOPIC) -> Optional[str]:
    """The device level of ``topic`` if it is exactly ``topic_filter`` (``<prefix>/+/release``) with a
    valid device id in the device level (the level before ``release``); None otherwise.

    Every other level must equal the filter's (a ``+`` there matches any one
    level, a final ``#`` any rest): ``x/y/pansketch/dev-a/release`` is not a
    release topic of ``pansketch/+/release``. One regular expression per
    filter (:func:`_topic_pattern`): splitting the topic and comparing level
    by level cost 1.3 us per release.
    """
    if type(topic) is not str or len(topic) > 1024:
        return None
    rx = _TOPIC_RX.get(topic_filter, False)
    if rx is False:
        rx = _topic_pattern(topic_filter)
        if len(_TOPIC_RX) >= 64:  # filters come from configuration: a handful; bounded anyway
            _TOPIC_RX.clear()
        _TOPIC_RX[topic_filter] = rx
    if rx is None:
        return None
    m = rx.fullmatch(topic)
    return m.group(1) if m is not None else None


_TOPIC_RX: dict[str, Any] = {}  # topic filter -> its compiled pattern (None: matches no release topic)


def _topic_pattern(topic_filter: str) -> Optional["re.Pattern[str]"]:
    """The pattern of :func:`topic_device` for one filter: literal levels as they are, ``+`` any one
    level (``/`` excluded, empty included), the device level a device id (group 1), then ``release``.
    None for a filter no topic matches: one ending in ``#`` (hostconfig requires ``/release``), one
    not ending in ``release``, or a fixed device level that is not a valid device id."""
    want = topic_filter.split("/")
    if len(want) < 2 or want[-1] != "release":
        return None
    if want[-2] != "+" and not valid_device(want[-2]):
        return None
    levels = ["[^/]*" if w == "+" else re.escape(w) for w in want[:-2]]
    levels.append("([A-Za-z0-9._-]{1,64})" if want[-2] == "+" else "(%s)" % re.escape(want[-2]))
    levels.append("release")
    return re.compile("/".join(levels))


def canonical_with_offset(m: dict[str, Any]) -> tuple[bytes, int]:
    """pansketch.agent.cbor encoding of the release map and the offset of the ``ctr`` bytes in it."""
    keys = sorted((cbor.dumps(k), k) for k in m)
    out = bytearray(cbor._head(5, len(keys)))
    off = -1
    for kb, k in keys:
        out += kb
        if k == "ctr":
            out += cbor._head(2, len(m[k]))
            off = len(out)
            out += m[k]
        else:
            out += cbor.dumps(m[k])
    return bytes(out), off


_ORDER = sorted(FIELDS, key=cbor.dumps)  # pansketch.agent.cbor writes map keys sorted by their encoded bytes
_CTR_AT = _ORDER.index("ctr")
_BEFORE = _ORDER[:_CTR_AT]
_AFTER = _ORDER[_CTR_AT + 1:]
_CTR_KEY = cbor.dumps("ctr")


def _plain(v: Any) -> bool:
    """Values whose cbor2 encoding is pansketch.agent.cbor's: str, int in (-2^63, 2^63), lists of such ints."""
    if type(v) is int:
        return -(1 << 63) < v < (1 << 63)
    if type(v) is str:
        return True
    if type(v) is list:
        return all(type(x) is int and -(1 << 63) < x < (1 << 63) for x in v)
    return False


def canonical_offset(m: dict[str, Any], payload: bytes) -> int:
    """Offset of the ``ctr`` bytes if ``payload`` is the pansketch.agent.cbor encoding of ``m``, else -1.

    Fast path for a map with exactly the release fields: the parts before
    and after the counters are encoded by cbor2's C encoder in pansketch.agent.cbor's
    key order (for str, int and int lists both write the same shortest-form
    definite-length bytes; tests/test_host_decode.py checks the two paths
    agree); anything else goes through :func:`canonical_offset_ref`.
    """
    if len(m) == len(FIELDS) and isinstance(m.get("ctr"), bytes):
        try:
            before = {k: m[k] for k in _BEFORE}
            after = {k: m[k] for k in _AFTER}
        except KeyError:
            return canonical_offset_ref(m, payload)
        if all(_plain(v) for v in before.values()) and all(_plain(v) for v in after.values()):
            n = len(m["ctr"])
            pre = cbor._head(5, len(FIELDS)) + cbor2.dumps(before)[1:] + _CTR_KEY + cbor._head(2, n)
            post = cbor2.dumps(after)[1:]
            off = len(pre)
            if len(payload) != off + n + len(post) or not payload.startswith(pre) or not payload.endswith(post):
                return -1
            return off
    return canonical_offset_ref(m, payload)


def canonical_offset_ref(m: dict[str, Any], payload: bytes) -> int:
    """Offset of the ``ctr`` bytes if ``payload`` is the pansketch.agent.cbor encoding of ``m``, else -1.

    Equivalent to ``canonical_with_offset(m) == (payload, off)`` without
    re-encoding or copying the counters: the map head, every other key and
    value, the ``ctr`` key and its byte-string head are encoded and compared
    with the payload before and after the counter bytes. The counter bytes
    themselves need no comparison: ``m`` was decoded from ``payload``, and
    when everything before them is byte-identical the decoder read ``ctr``
    from exactly ``payload[off:off + len(ctr)]``.
    """
    keys = sorted((cbor.dumps(k), k) for k in m)
    pre = bytearray(cbor._head(5, len(keys)))
    post = bytearray()
    off = -1
    n = 0
    for kb, k in keys:
        part = pre if off < 0 else post
        part += kb
        if k == "ctr":
            v = m[k]
            if not isinstance(v, bytes):
                return -1
            n = len(v)
            pre += cbor._head(2, n)
            off = len(pre)
        else:
            part += cbor.dumps(m[k])
    if off < 0 or len(payload) != off + n + len(post):
        return -1
    if not payload.startswith(pre) or not payload.endswith(post):
        return -1
    return off


_NOISE: dict[tuple[Any, ...], Any] = {}
_NOISE_MAX = 1024  # distinct calibrations remembered (a fleet has a handful; hostile input cannot grow it)


def _noise_for(mech: str, budget: tuple[int, int], d: int, clip: int, arrays: int) -> Any:
    """pansketch.agent.calibrate.noise_for, remembered (the same few calibrations for every release of a fleet)."""
    key = (mech, budget, d, clip, arrays)
    spec = _NOISE.get(key)
    if spec is None:
        spec = calibrate.noise_for(mech, budget, d, clip, arrays)  # ValueError: not remembered
        if len(_NOISE) >= _NOISE_MAX:
            _NOISE.clear()
        _NOISE[key] = spec
    return spec


def decode(payload: bytes, topic: Optional[str] = None, max_bytes: int = 1 << 20,
           fleet: Any = None, topic_filter: str = DEFAULT_TOPIC, sha256: Optional[str] = None) -> Release:
    """Validate ``payload`` (received on ``topic``) and return the :class:`Release` (see :func:`decode_state`)."""
    if isinstance(payload, memoryview):
        if payload.format != "B" or payload.ndim != 1:
            payload = payload.cast("B")
    else:
        payload = bytes(payload)
    return Release.from_state(decode_state(payload, topic, max_bytes, fleet, topic_filter, sha256), payload)


# every field name of every version and kind: cborscan's one-pass reader of the common case
_KNOWN = cborscan.key_table(FIELDS + tuple(k for ks in KIND_FIELDS.values() for k in ks))
# the key sets of v1, v2 and v2 with each kind's extra fields, by map size (all different), with their
# types as devices write them: cborscan's regular-expression reader of the common case
_TYPES = {"dev": "t", "mode": "t", "kind": "t", "salt": "t", "mech": "t", "budget": "u2", "nint": "u2",
          "nout": "u2", "map": "u3", "ctr": "b"}
# the fields that differ between the releases of one device (the rest are its parameters: Scan.same)
_PER_RELEASE = ("dev", "seq", "elo", "ehi", "win", "part", "ctr")
_TEMPLATES = {len(ks): cborscan.Template([(k, _TYPES.get(k, "u")) for k in ks],
                                         same=[k for k in ks if k not in _PER_RELEASE])
              for ks in (FIELDS_V1, FIELDS) + tuple(FIELDS + extra for extra in KIND_FIELDS.values())}
assert len(_TEMPLATES) == 2 + len(KIND_FIELDS), "one template per map size"

# the key sets of a release by (format version, kind): one comparison for a well-formed map
_KEYSETS = {(v, k): frozenset(VERSIONS[v] + (KIND_FIELDS.get(k, ()) if v == 2 else ())) for v in VERSIONS
            for k in V2_KINDS}


def _release_fields(obj: Any) -> int:
    """The map, its version and its key set (:func:`decode_state`'s first checks); the version."""
    if type(obj) is not dict:  # no field 'v' to read: refused as an unknown format (docs/FORMAT.md 2.4)
        raise Rejected("version", "release must be a CBOR map with field 'v' (format version), got %s"
                       % type(obj).__name__)
    if "v" not in obj:
        raise Rejected("version", "field 'v' (format version) is missing")
    v = obj["v"]
    if isinstance(v, bool) or not isinstance(v, int) or v not in VERSIONS:
        raise Rejected("version", "unsupported release format version %r (this host reads v1 and v2)" % (v,))
    fields = VERSIONS[v]
    k0 = obj.get("kind")
    ks = _KEYSETS.get((v, k0)) if type(k0) is str else None
    if v == 2:
        fields = fields + (KIND_FIELDS.get(k0, ()) if isinstance(k0, str) else ())
    same = ks is not None and obj.keys() == ks  # the release's fields exactly: no loops over the keys
    for k in (() if same else obj):
        if not isinstance(k, str):
            raise Rejected("schema", "map key %r is not a text string" % (k,))
        if k not in fields:
            raise Rejected("schema", "unknown field %r (format v%d)" % (k, v))
    for k in (() if same else fields):
        if k not in obj:
            raise Rejected("schema", "missing field %r" % k)

    return v


def _parameters(obj: Any, v: int) -> tuple[Any, ...]:
    """The release's parameters, each checked alone and against the others (mode, kind, shape, hashing,
    salt, mechanism, budget and noise fractions, tree and epoch lengths)."""
    mode = _str(obj, "mode")
    if mode not in MODES_BY_VERSION[v]:
        raise Rejected("schema", "mode %r is not supported in format v%d (%s)"
                       % (mode, v, ", ".join(MODES_BY_VERSION[v])))
    kind = _str(obj, "kind", V2_KINDS if v == 2 else ("cms", "cs"))
    if mode == "tree" and kind not in TREE_KINDS:
        raise Rejected("schema", "tree mode supports kinds cms and cs, got %r" % kind)
    b = 0
    dmap: Optional[tuple[int, int, int]] = None
    if kind == "dcs":
        b = _int(obj, "b", 1, MAX_DCS_B)
        mv = obj["map"]
        if (not isinstance(mv, list) or len(mv) != 3 or any(isinstance(x, bool) or not isinstance(x, int) for x in mv)
                or not (0 < mv[0] < MAX_MAP and 0 < mv[1] < MAX_MAP and -MAX_MAP < mv[2] < MAX_MAP)):
            raise Rejected("schema", "field 'map' must be [scale_num, scale_den, offset] with 0 < scale < 2^62, "
                                     "|offset| < 2^62")
        dmap = (mv[0], mv[1], mv[2])
    elif kind == "strhh":
        b = _int(obj, "b", STRHH_L[0], STRHH_L[1])
    levels = b + 1 if kind == "dcs" else (b if kind == "strhh" else 1)  # sketch levels (not tree levels)
    d = _int(obj, "d", STRHH_MIN_D if kind == "strhh" else 1, MAX_D)
    w = _int(obj, "w", 2, MAX_W)
    hv = _int(obj, "hv", 0, MAX_U32)
    if hv != hashing.HASH_VERSION:
        raise Rejected("schema", "unsupported hash version %d (this host hashes with v%d)" % (hv, hashing.HASH_VERSION))
    salt = _str(obj, "salt")
    if SALT_ID.fullmatch(salt) is None:
        raise Rejected("schema", "field 'salt' must be a 16-hex-digit salt id")
    clip = _int(obj, "clip", 1, MAX_CLIP)
    mech = _str(obj, "mech", calibrate.MECHANISMS)
    budget = _ratio(obj, "budget")
    nint = _ratio(obj, "nint")
    nout = _ratio(obj, "nout")
    nz = obj["nz"]
    if type(nz) is not int:
        raise Rejected("schema", "field 'nz' must be an integer, got %s" % type(nz).__name__)
    if not 2 <= nz <= MAX_NZ:
        raise Rejected("schema", "field 'nz' = %d out of range [2, %d]: every cell carries at least one "
                       "internal and one output noise draw" % (nz, MAX_NZ))
    L = _int(obj, "L", 1, MAX_L)
    lvl = _int(obj, "lvl", 0, MAX_LVL) if v >= 2 else 0
    win_s = _int(obj, "win_s", 1, MAX_EPOCH if mode == "tree" else MAX_SECONDS)
    ep_s = _int(obj, "ep_s", 1, MAX_SECONDS)
    if mode == "tree":
        if L > MAX_LEVELS:
            raise Rejected("schema", "tree with L = %d levels (at most %d)" % (L, MAX_LEVELS))
        if win_s != ep_s << (L - 1):
            raise Rejected("schema", "tree mode needs win_s = ep_s * 2^(L-1) (the horizon) = %d, got %d"
                           % (ep_s << (L - 1), win_s))
        if lvl > L - 1:
            raise Rejected("schema", "node level %d above the root of an L = %d tree" % (lvl, L))
    elif lvl != 0:
        raise Rejected("schema", "lvl = %d but mode %r has no tree levels" % (lvl, mode))
    if win_s % ep_s:
        raise Rejected("schema", "ep_s = %d does not divide win_s = %d" % (ep_s, win_s))
    if mode == "window" and ep_s != win_s:
        raise Rejected("schema", "window mode needs ep_s == win_s, got %d and %d" % (ep_s, win_s))
    return (mode, kind, b, dmap, levels, d, w, hv, salt, clip, mech, budget, nint, nout, nz, L, lvl, win_s, ep_s)


def _check_dbits(kind: str, mech: str, budget: tuple[int, int], clip: int, w: int, d: int, nz: int) -> None:
    """Kind dbits: the parameters its bits need to be eps-DP, and its one internal + one output draw."""
    if kind == "dbits":
        # eps above the root of 2/(2 - eps) = e^eps: the device's bits would not be eps-DP both ways
        # (pansketch.agent.params refuses it; decided exactly by dbits_eps_ok)
        if (mech != "dlap" or not dbits_eps_ok(budget[0], budget[1]) or clip != 1 or w % DBITS_W_MULTIPLE
                or d > DBITS_MAX_D):
            raise Rejected("schema", "kind dbits needs mech dlap, 2/(2 - eps) <= e^eps (eps <= %s...), clip 1, "
                           "w a multiple of %d, d <= %d" % (DBITS_EPS_MAX, DBITS_W_MULTIPLE, DBITS_MAX_D))
        if nz != DBITS_NZ:
            raise Rejected("schema", "kind dbits has nz = %d noise draws per count, got %d" % (DBITS_NZ, nz))


def _check_arrays(mode: str, kind: str, L: int, levels: int) -> None:
    """``L``: the arrays one event touches in this mode and kind (tree mode: checked with the tree)."""
    if mode != "tree" and L != calibrate.arrays_touched(mode) * levels:
        raise Rejected("schema", "L = %d but mode %r with kind %r touches %d array(s) per event"
                       % (L, mode, kind, calibrate.arrays_touched(mode) * levels))


def _check_noise(v: int, kind: str, mech: str, budget: tuple[int, int], d: int, clip: int, L: int,
                 nint: tuple[int, int], nout: tuple[int, int]) -> None:
    """``nout`` and ``nint`` are the calibrated noise of the budget (docs/PRIVACY.md)."""
    try:
        spec = _noise_for(mech, budget, 1, 1, 1) if kind == "dbits" else _noise_for(mech, budget, d, clip, L)
    except (ValueError, ZeroDivisionError) as exc:
        raise Rejected("noise", "cannot calibrate %s budget %d/%d: %s" % (mech, budget[0], budget[1], exc))
    if nout[0] * spec.den != spec.num * nout[1]:
        raise Rejected("noise", "nout = %d/%d does not match the %s noise for budget %d/%d "
                       "(d=%d, clip=%d, L=%d): expected %d/%d"
                       % (nout[0], nout[1], mech, budget[0], budget[1], d, clip, L, spec.num, spec.den))
    # nint: the same calibration, or (v2, kinds cms/cs/dcs, any mode) that of 2L arrays: the
    # shadow persist scheme gives the accumulator and its flash track half the budget each
    # (docs/PRIVACY.md "Persisting without growing the noise")
    allowed = [spec]
    if nint[0] * spec.den != spec.num * nint[1] and v >= 2 and kind != "dbits":
        allowed.append(_noise_for(mech, budget, d, clip, 2 * L))  # only when the first does not match
    if not any(nint[0] * a.den == a.num * nint[1] for a in allowed):
        raise Rejected("noise", "nint = %d/%d does not match the %s noise for budget %d/%d "
                       "(d=%d, clip=%d, L=%d): expected %s"
                       % (nint[0], nint[1], mech, budget[0], budget[1], d, clip, L,
                          " or ".join("%d/%d" % (a.num, a.den) for a in allowed)))


# the parameters of releases that passed every check of them (_release_fields, _parameters, _check_dbits,
# _check_arrays, _check_noise), by cborscan.Scan.same: the template (key set and types) and the encoded bytes
# of the parameters. A fleet's releases share a few such sets, so those checks run once per set; any other
# bytes are checked in full. Bounded (a flood of distinct parameters only empties it).
_STATICS: dict[Any, tuple[Any, ...]] = {}
_STATICS_MAX = 256


def decode_state(payload: bytes, topic: Optional[str] = None, max_bytes: int = 1 << 20,
                 fleet: Any = None, topic_filter: str = DEFAULT_TOPIC, sha256: Optional[str] = None) -> tuple[Any, ...]:
    """Validate ``payload`` (received on ``topic``): the release's :meth:`Release.state` (every field
    but the payload, :data:`STATE_FIELDS` order; what the MQTT process sends the aggregator).

    ``fleet`` is a :class:`pansketch.host_tools.hostconfig.FleetConfig` (or None):
    its salt_id, kind, d, w and mechanism are enforced when set.
    Raises :class:`Rejected`. ``payload`` may be a memoryview (the
    validation helper reads messages out of one received buffer): nothing
    of it is copied then, and the Release refers to it. ``sha256``: the
    payload's SHA-256 (hex) when the caller has it already (the MQTT helper
    hashes each message before validating it, to know it again if it
    exhausts the CPU budget).
    """
    if isinstance(payload, memoryview):
        if payload.format != "B" or payload.ndim != 1:
            payload = payload.cast("B")
    else:
        payload = bytes(payload)
    if len(payload) > max_bytes:
        raise Rejected("size", "payload of %d bytes exceeds max_bytes = %d" % (len(payload), max_bytes))
    if not payload:
        raise Rejected("cbor", "empty payload")
    try:  # byte-level check and build in one bounded pass: no CBOR object decoder sees untrusted bytes
        # (byte strings as views: the counters are not copied; the encoding check is found on the way)
        sc = cborscan.scan(payload, views=True, known=_KNOWN, templates=_TEMPLATES)
        obj = sc.obj
    except cborscan.ScanError as exc:
        raise Rejected(exc.code, "malformed CBOR: %s" % exc.reason if exc.code == "cbor" else exc.reason)
    # (only the release subset's types come out of cborscan: no floats, no tags, nothing else to refuse
    # as code 'type' here)
    # the checks of the parameters run once per distinct set of them (_STATICS); the others every time,
    # all in the order in which they report the first failure
    same = sc.same
    st = _STATICS.get(same) if same is not None else None
    if st is None:
        v = _release_fields(obj)
    dev = _str(obj, "dev")
    if not valid_device(dev):
        raise Rejected("schema", "field 'dev' = %r is not a valid device id (1-64 of A-Z a-z 0-9 . _ -)" % dev[:80])
    seq = _int(obj, "seq", 0, MAX_U32)
    if st is None:
        mode, kind, b, dmap, levels, d, w, hv, salt, clip, mech, budget, nint, nout, nz, L, lvl, win_s, ep_s = \
            _parameters(obj, v)
    else:
        v, mode, kind, b, dmap, levels, d, w, hv, salt, clip, mech, budget, nint, nout, nz, L, lvl, win_s, ep_s = st
    elo = _int(obj, "elo", 0, MAX_EPOCH // ep_s)
    ehi = _int(obj, "ehi", 0, MAX_EPOCH // ep_s)
    if ehi <= elo:
        raise Rejected("schema", "epoch range [%d, %d) is empty" % (elo, ehi))
    if mode == "tree":
        if ehi - elo != 1 << lvl or elo % (1 << lvl):
            raise Rejected("schema", "tree node [%d, %d) is not the aligned level-%d node (2^%d epochs starting at "
                           "a multiple of 2^%d)" % (elo, ehi, lvl, lvl, lvl))
    elif ehi - elo > MAX_SPAN:
        raise Rejected("schema", "epoch range [%d, %d) spans more than %d epochs" % (elo, ehi, MAX_SPAN))
    win = _int(obj, "win", 0, MAX_EPOCH)
    if win != (elo * ep_s) // win_s:
        raise Rejected("schema", "window %d does not contain epoch %d (expected window %d)"
                       % (win, elo, (elo * ep_s) // win_s))
    part = _int(obj, "part", 0, MAX_U32)
    ctr = obj["ctr"]
    if not isinstance(ctr, (bytes, memoryview)):
        raise Rejected("schema", "field 'ctr' must be a byte string")
    if st is None:  # the rest of 'schema' (L against mode and kind) before 'shape'
        _check_dbits(kind, mech, budget, clip, w, d, nz)
        _check_arrays(mode, kind, L, levels)
    if kind == "dbits":
        if len(ctr) != 4 * d:
            raise Rejected("shape", "ctr has %d bytes, kind dbits has d=%d int32 counts (%d bytes)"
                           % (len(ctr), d, 4 * d))
    elif len(ctr) != 4 * levels * d * w:
        raise Rejected("shape", "ctr has %d bytes, %d level(s) x d=%d x w=%d int32 counters need %d"
                       % (len(ctr), levels, d, w, 4 * levels * d * w))
    # payload == pansketch.agent.cbor's encoding of obj (cborscan.scan; canonical_offset re-encodes to the same answer)
    off = sc.offsets["ctr"] if sc.canonical else -1
    if off < 0:
        raise Rejected("encoding", "not the deterministic CBOR encoding devices write (agent/cbor.py)")

    if topic is not None:
        tdev = topic_device(topic, topic_filter)
        if tdev is None:
            raise Rejected("topic", "topic %r is not %s with a valid device id" % (topic[:200], topic_filter[:200]))
        if tdev != dev:
            raise Rejected("topic", "topic device %r does not match release dev %r" % (tdev[:80], dev))

    if fleet is not None:
        if fleet.salt_id and salt != fleet.salt_id:
            raise Rejected("fleet", "salt id %s is not the fleet's (%s)" % (salt, fleet.salt_id))
        for name, want, got in (("kind", fleet.kind, kind), ("d", fleet.d, d), ("w", fleet.w, w),
                                ("mechanism", fleet.mechanism, mech)):
            if want is not None and want != got:
                raise Rejected("fleet", "%s = %r but the fleet requires %r" % (name, got, want))

    if st is None:
        _check_noise(v, kind, mech, budget, d, clip, L, nint, nout)
        if same is not None:
            if len(_STATICS) >= _STATICS_MAX:
                _STATICS.clear()
            _STATICS[same] = (v, mode, kind, b, dmap, levels, d, w, hv, salt, clip, mech, budget, nint, nout, nz, L,
                              lvl, win_s, ep_s)

    # Release.state(): STATE_FIELDS order (checked where this module is imported)
    return (mode, kind, d, w, hv, salt, clip, mech, budget, nint, nout, nz, L, dev, seq, win_s, ep_s, win, elo, ehi,
            part, off, sha256 if sha256 is not None else hashlib.sha256(payload).hexdigest(), v, lvl, b, dmap)


assert STATE_FIELDS == ("mode", "kind", "d", "w", "hv", "salt", "clip", "mech", "budget", "nint", "nout", "nz", "L",
                        "dev", "seq", "win_s", "ep_s", "win", "elo", "ehi", "part", "ctr_off", "sha256", "v", "lvl",
                        "b", "map"), "decode_state builds Release.state() in this order"
