"""The parameters a device counts and releases with, validated in one place.

Shared by the Pi daemon (agent/pi/daemon.py reads them from TOML) and the
board firmware (firmware/ reads them from a JSON file). Every error names
the offending key so config loaders can report it verbatim.
"""

import hashlib

from pansketch.agent import calibrate, hashing
from pansketch.agent.sketch import KINDS


MAX_LEVELS = 24  # 2**23 epochs per tree; memory (L arrays) is the real limit
# device ids: 1-64 of these ASCII characters (docs/FORMAT.md section 1); the host checks the same set
# (host_tools.decode.DEVICE_ID), so no Unicode lookalike of another device's name is ever accepted
DEVICE_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-"


class ParamError(ValueError):
    """A bad parameter; ``key`` names it."""

    def __init__(self, key, msg):
        # super() form: MicroPython has no ValueError.__init__ to call directly
        super().__init__("%s: %s" % (key, msg))
        self.key = key


DBITS_EPS_MAX = "1.5936242600"  # the root of 2/(2 - eps) = e^eps is 1.59362426004004...: refused just above


def dbits_eps_ok(num, den):
    """Whether eps = num/den > 0 makes dbits' randomized response eps-DP in both directions.

    A bit is Bern(1/2) when its item is absent and Bern(p), p = 1/2 + eps/4,
    when present (agent/dbits.py). The four likelihood ratios are 2p and
    1/(2p) (bit 1), 2(1 - p) and 1/(2(1 - p)) (bit 0); the largest is
    1/(2(1 - p)) = 2/(2 - eps), so the condition is 2/(2 - eps) <= e^eps
    (true for eps <= 1.59362..., false above; 1 + eps/2 <= e^eps always).
    Decided exactly in integers (no floats: the same answer on every VM): the
    Taylor sum S of e^eps to 40 terms is below e^eps, so S * (2 - eps) >= 2
    is sufficient; it misses only eps within ~1e-40 of the root.
    """
    if num <= 0 or den <= 0 or num >= 2 * den:
        return False
    n = 40
    # S * den^n * n! = sum_k num^k den^(n-k) n!/k!, built from k = n down
    t = 0
    f = 1  # n!/k!
    for k in range(n, -1, -1):
        t += num ** k * den ** (n - k) * f
        f *= k if k else 1
    # f is now n!; S * (2 - eps) >= 2  <=>  t * (2 den - num) >= 2 den * den^n * n!
    return t * (2 * den - num) >= 2 * den * den ** n * f


def _int(cfg, key, default, lo, hi):
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ParamError(key, "must be an integer, got %r" % (v,))
    if v < lo or v > hi:
        raise ParamError(key, "must be between %d and %d, got %d" % (lo, hi, v))
    return v


class Params:
    """Validated device parameters.

    Keys (defaults): device (required), salt (required), kind ('cs'),
    d (4), w (1024), clip (1), mode ('window'), window_s (3600),
    epoch_s (= window_s in window mode, 600 in keep mode, 3600 in tree
    mode), levels (tree mode only, default 8: L, the arrays one event
    touches; the tree's horizon is 2**(L-1) epochs and window_s is derived
    as epoch_s * 2**(L-1)), mechanism ('dgauss'), budget ('1/2': rho for
    dgauss, eps for dlap: the per-event guarantee against every release
    plus one intrusion, in tree mode over all L nodes holding the event),
    persist_s (600: how often the state goes to flash), persist_noise ('auto':
    'refresh' adds one internal draw to the release per persist, 'shadow'
    keeps the release at one internal draw at half the budget whatever the
    number of persists, with one more array in RAM; 'auto' picks shadow
    when that gives the smaller release variance, docs/PRIVACY.md
    "Persisting without growing the noise").
    Kind 'dcs' only: b (16, domain bits) and map ([1, 1, 0]: scale_num,
    scale_den, offset of the reading -> domain map, agent/dcs.py).
    Kind 'strhh' only: len (12, bytes per item = prefix levels, agent/strhh.py); d defaults to 5.
    """

    def __init__(self, cfg):
        dev = cfg.get("device")
        if not isinstance(dev, str) or not dev or len(dev) > 64:
            raise ParamError("device", "must be a non-empty string of at most 64 characters")
        for ch in dev:
            if ch not in DEVICE_CHARS:
                raise ParamError("device", "may only contain ASCII letters, digits, '-', '_' and '.'")
        self.device = dev
        salt = cfg.get("salt")
        if not isinstance(salt, str) or len(salt) < 8:
            raise ParamError("salt", "must be a string of at least 8 characters, shared by the whole fleet")
        if len(salt.encode()) > hashing.MAX_SALT:
            raise ParamError("salt", "must be at most 255 bytes")
        self.salt = salt
        self.kind = cfg.get("kind", "cs")
        if self.kind not in KINDS and self.kind not in ("dcs", "dbits", "strhh"):
            raise ParamError("kind", "must be 'cms', 'cs', 'dcs', 'dbits' or 'strhh', got %r" % (self.kind,))
        self.d = _int(cfg, "d", 4, 1, 32)
        self.w = _int(cfg, "w", 1024, 2, 1 << 24)
        self.clip = _int(cfg, "clip", 1, 1, 1 << 20)
        self.mode = cfg.get("mode", "window")
        if self.mode not in ("window", "keep", "tree"):
            raise ParamError("mode", "must be 'window', 'keep' or 'tree', got %r" % (self.mode,))
        if self.mode == "tree":
            # L levels 0..L-1; a level-l node covers 2**l epochs aligned to
            # absolute epoch 0; the root (level L-1) is the horizon: one tree.
            self.levels = _int(cfg, "levels", 8, 1, MAX_LEVELS)
            self.epoch_s = _int(cfg, "epoch_s", 3600, 1, 366 * 86400)
            self.window_s = self.epoch_s << (self.levels - 1)
            if "window_s" in cfg and cfg["window_s"] != self.window_s:
                raise ParamError("window_s", "is derived in tree mode: epoch_s * 2**(levels-1) = %d (leave it out)"
                                 % self.window_s)
        else:
            if "levels" in cfg and cfg["levels"] != 1:
                raise ParamError("levels", "only tree mode has levels")
            self.levels = 1
            self.window_s = _int(cfg, "window_s", 3600, 1, 366 * 86400)
            default_epoch = self.window_s if self.mode == "window" else min(600, self.window_s)
            self.epoch_s = _int(cfg, "epoch_s", default_epoch, 1, self.window_s)
            if self.window_s % self.epoch_s:
                raise ParamError("epoch_s", "must divide window_s (%d)" % self.window_s)
            if self.mode == "window" and self.epoch_s != self.window_s:
                raise ParamError("epoch_s", "must equal window_s in window mode (use mode = 'keep' for epochs)")
        self.mechanism = cfg.get("mechanism", "dgauss")
        if self.mechanism not in calibrate.MECHANISMS:
            raise ParamError("mechanism", "must be 'dlap' or 'dgauss', got %r" % (self.mechanism,))
        try:
            self.budget = calibrate.parse_ratio(cfg.get("budget", "1/2"))
        except (ValueError, ZeroDivisionError) as exc:
            raise ParamError("budget", str(exc))
        if self.budget[0] <= 0:
            raise ParamError("budget", "must be positive")
        self.persist_s = _int(cfg, "persist_s", 600, 1, 86400)
        self.persist_noise = cfg.get("persist_noise", "auto")
        if self.persist_noise not in ("auto", "refresh", "shadow"):
            raise ParamError("persist_noise", "must be 'auto', 'refresh' or 'shadow', got %r" % (self.persist_noise,))
        # kind dcs (agent/dcs.py): b domain bits, b + 1 levels of d x w, one event touches all levels
        # (dcs_levels; not the tree's levels, which is L in tree mode and 1 otherwise)
        self.b = 0
        self.map = None
        self.dcs_levels = 1
        if self.kind == "dcs":
            self.b = _int(cfg, "b", 16, 1, 62)  # pansketch.agent.dcs.MAX_B (not imported: boards load dcs only for kind dcs)
            m = cfg.get("map", [1, 1, 0])
            if (not isinstance(m, (list, tuple)) or len(m) != 3
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in m)):
                raise ParamError("map", "must be [scale_num, scale_den, offset] (three integers), got %r" % (m,))
            if not (0 < m[0] < 1 << 62 and 0 < m[1] < 1 << 62 and -(1 << 62) < m[2] < 1 << 62):
                raise ParamError("map", "scale_num and scale_den must be in [1, 2^62), |offset| < 2^62")
            self.map = (m[0], m[1], m[2])
            self.dcs_levels = self.b + 1
        elif "b" in cfg or "map" in cfg:
            raise ParamError("b" if "b" in cfg else "map", "only applies to kind 'dcs'")
        if self.kind == "strhh":
            # agent/strhh.py: items encoded to len bytes, one level per prefix length (MIN_L..MAX_L
            # not imported: boards load strhh only for kind strhh); b carries len in releases
            self.b = _int(cfg, "len", 12, 3, 64)
            self.dcs_levels = self.b
            if "d" not in cfg:  # 5 rows: 3 must agree, which the descent's FDR needs (host_tools/bench/strheavy.py)
                self.d = 5
            if self.d < 3:  # the host's descent p-values need a median of >= 2 rows above (strheavy.py)
                raise ParamError("d", "kind 'strhh' needs d >= 3 (got %d)" % self.d)
        elif "len" in cfg:
            raise ParamError("len", "only applies to kind 'strhh'")
        if self.mode == "tree" and self.kind not in ("cms", "cs"):
            # a tree of dcs would hold L x (b + 1) arrays (calibration arrays = L * (b + 1)) and
            # a tree of dbits has no count-noise chain: neither is implemented (docs/PRIVACY.md)
            raise ParamError("kind", "tree mode supports kinds cms and cs, got %r" % (self.kind,))
        self.cells = self.dcs_levels * self.d * self.w
        self.arrays = calibrate.arrays_touched(self.mode, self.levels) * self.dcs_levels
        if self.kind == "dbits":
            # agent/dbits.py: d levels of w bits; the release is d counts with dlap(1/eps) noise (one
            # item moves one count by at most 1); the bits' bias eps/4 is eps-DP both ways only up
            # to eps ~ 1.5936 (dbits_eps_ok)
            if self.d > 30:
                raise ParamError("d", "kind 'dbits' has at most 30 levels")
            if self.w % 8 or self.w < 8:
                raise ParamError("w", "kind 'dbits' needs w (bits per level) a multiple of 8")
            if self.mechanism != "dlap":
                raise ParamError("mechanism", "kind 'dbits' is eps-DP: use mechanism = 'dlap' (budget = eps)")
            if not dbits_eps_ok(self.budget[0], self.budget[1]):
                raise ParamError("budget", "kind 'dbits' needs eps <= %s (bits are Bern(1/2 + eps/4): eps-DP "
                                 "both ways only while 2/(2 - eps) <= e^eps)" % DBITS_EPS_MAX)
            if self.clip != 1:
                raise ParamError("clip", "kind 'dbits' counts presence: clip must be 1")
            self.cells = self.d
            self.noise = calibrate.noise_for("dlap", self.budget, 1, 1, 1)
        else:
            self.noise = calibrate.noise_for(self.mechanism, self.budget, self.d, self.clip, self.arrays)
        self.shadow = self._shadow()
        self._half = None
        self.inoise = self.internal_noise(self.shadow)

    def internal_noise(self, shadow):
        """The internal noise (Z_int, persist draws) under a persist scheme. Under shadow an
        event is in two independent noisy views -- the accumulator and one increment of the
        flash track -- so each gets half the budget: the calibration of 2x the arrays."""
        if not shadow:
            return self.noise
        if self._half is None:  # computed once: the recorder asks at every draw
            self._half = calibrate.noise_for(self.mechanism, self.budget, self.d, self.clip, 2 * self.arrays)
        return self._half

    def persists_per_epoch(self):
        """Persists inside one accumulator's life with no restart: ceil(epoch_s / persist_s) - 1."""
        return (self.epoch_s - 1) // self.persist_s

    def _shadow(self):
        """Resolve persist_noise. Shadow's internal variance is 2x (dgauss: sigma^2 doubles) or
        about 4x (dlap: the scale t doubles) one refresh draw; refresh carries 1 + p draws."""
        pn = self.persist_noise
        if self.kind == "dbits":
            if pn == "shadow":  # dbits never persists (agent/dbits.py)
                raise ParamError("persist_noise", "kind 'dbits' keeps no persisted counts: no 'shadow'")
            return False
        if self.mode == "tree":
            # a shadow per level doubles the tree's L arrays: only when asked for
            return pn == "shadow"
        if pn != "auto":
            return pn == "shadow"
        return 1 + self.persists_per_epoch() > (2 if self.mechanism == "dgauss" else 4)

    @property
    def epochs_per_window(self):
        return self.window_s // self.epoch_s

    def fingerprint(self, shadow=None):
        """Id of everything that must not change under a persisted state
        (``shadow``: of the state written under that persist scheme)."""
        s = "%s|%s|%s|%d|%d|%d|%s|%d|%d|%s|%d/%d" % (
            self.device,
            hashing.salt_id(self.salt),
            self.kind,
            self.d,
            self.w,
            self.clip,
            self.mode,
            self.window_s,
            self.epoch_s,
            self.mechanism,
            self.budget[0],
            self.budget[1],
        )
        if self.kind == "dcs":
            s += "|%d|%d,%d,%d" % (self.b, self.map[0], self.map[1], self.map[2])
        elif self.kind == "strhh":
            s += "|%d" % self.b
        if (self.shadow if shadow is None else shadow) and self.mode != "tree":
            # state.bin then holds the flash track, not the accumulator (the tree state
            # file records the scheme per level instead)
            s += "|shadow"
        h = hashlib.sha256(s.encode()).digest()
        return h[:8]
