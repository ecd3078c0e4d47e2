"""How big a sketch fits on a board: the heap budget with WiFi and TLS up.

Runs on CPython (``python -m pansketch.firmware.memory --config pansketch.json``
prints the estimate for every board profile, or ``--table`` the table of
docs/FIRMWARE.md) and on the board (``import pansketch.firmware.memory as m;
m.report()`` after stopping main.py with Ctrl-C: it uses the board's real
``gc.mem_free()``).

Model (bytes of Python heap):

    steady = code + APP_FIXED + CELL*n + step garbage + TLS in heap + RESERVE
    boot   = code + APP_FIXED + (CELL + BOOT_CELL)*n + RESERVE

``n = d*w`` cells. The Recorder holds two int32 arrays of n cells (the noisy
accumulator and the release buffer): CELL = 8. The state file is read
straight into the accumulator at boot (agent/storage.read_state), so
BOOT_CELL, the extra per cell while it loads, is 0. The boot happens
before WiFi/TLS come up (firmware/app.py allocates the sketch first), so
the two peaks do not add. Window and keep mode need the same memory (one
accumulator + one release buffer), plus SHADOW_CELL = 4 bytes per cell
under persist_noise = "shadow" (the shadow array M, agent/recorder.py;
"auto" picks it when persists are frequent: check ``Params.shadow``). Tree mode holds L accumulators (one
per level) and ONE shared scratch buffer: 4*(L+1) bytes per cell
(``cell_bytes``), plus the tree module's code net of agent/recorder.py's,
which a tree-mode board does not load (TREE_CODE_*); the tree
state file is read straight into the L accumulators (BOOT_CELL stays 0).

The constants marked *measured* come from the MicroPython VMs
(tests/test_firmware_memory.py re-measures the .py/.mpy ones in the
WebAssembly VM, tests/test_firmware_unix_frozen.py the frozen code in the
32-bit Unix port with the firmware frozen in; both fail if they drift;
figures in bench-results/firmware.json and firmware-unix.json), and so do
the TLS costs of the profiles. The boards' free heaps are *assumed* from
public figures (MicroPython docs and forum measurements) and should be
checked with ``report()`` on the real board.
"""

# -- measured in the MicroPython VMs ------------------------------------------
# .py / .mpy: the WebAssembly VM (tests/test_firmware_memory.py, bench-results/firmware.json);
# frozen: the 32-bit Unix port with the firmware frozen into its image (tests/mpunix/build-frozen.sh;
# tests/test_firmware_unix_frozen.py re-measures it, bench-results/firmware-unix.json "frozen").
CODE_PY = 114400     # live heap of core + firmware + umqtt.simple imported from .py sources
CODE_MPY = 76500     # ... imported from .mpy files (deploy/flash.sh --mpy)
CODE_FROZEN = 13750  # ... frozen into the image (measured 13,696-13,728 B: module dicts, functions, classes;
                     # the bytecode stays in flash)
APP_FIXED = 4000     # App, Link, Wifi, source buffers, config object, Recorder attributes after boot
                     # (3.9 KB in the WebAssembly VM, 3.8 KB in the frozen Unix port)
CELL = 8             # per sketch cell, steady (accumulator + release buffer)
SHADOW_CELL = 4      # per cell, the shadow array of persist_noise = "shadow"
BOOT_CELL = 0        # per cell, extra while the state file is read at boot
STEP_EVENT = 350     # garbage per event in one main-loop step (UART line -> item -> SHA-256)
RESERVE = 4096       # head room for fragmentation and the console
TREE_CODE_PY = 2200  # tree mode's code minus window mode's: agent/tree.py loaded instead of agent/recorder.py
                     # (.py, measured in the VM on top of the firmware's other modules: 2,160 B; both modes
                     # load their shared core agent/accum.py)
TREE_CODE_MPY = 2550  # ... from .mpy (measured in the VM, tests/test_firmware_memory.py: 2,544 B)
TREE_CODE_FROZEN = 400   # ... frozen (measured in the frozen Unix port on top of the firmware's modules: 352 B)
# tree mode, measured in the VM (host_tools/bench/core.py --tree-only, bench-results/tree.json):
# microseconds per event (SHA-256 + counter updates of every level), cs d=4 w=256
TREE_US_PER_EVENT = {1: 14.0, 8: 37.0, 12: 54.0, 16: 64.0, 24: 88.0}

# -- board profiles ----------------------------------------------------------
# free:   Python heap free after boot with WiFi up, before importing pansketch (assumed, public figures:
#         ESP32 -- MicroPython's ESP32 docs give "around 100KB" for the heap of a plain ESP32 (largest
#         contiguous block, ESP-IDF v4), and since v1.21 the heap grows from the ESP-IDF heap on demand;
#         Pico W -- what remains of the RP2040's 264 KB next to the CYW43 WiFi driver and lwIP; ESP8266 --
#         its fixed ~38 KB heap). Check yours with report() on the board.
# tls:    what one TLS session costs *inside* the Python heap: measured in the frozen Unix port
#         (bench-results/firmware-unix.json "frozen": live high-water over TLS minus over plain MQTT)
#         with Mbed TLS allocating outside the heap (ESP32: 2.7 KB, the ssl wrapper and socket objects)
#         and inside it (Pico W: 26.6 KB, Mbed TLS's 16 KiB + 4 KiB record buffers and session state);
#         ESP8266's axTLS is assumed.
# code:   how the code is installed by default (the examples in deploy/board assume it);
# codes:  the installs the table lists.
# events: the max_events_per_step the table assumes (its garbage is head room).
PROFILES = (
    ("esp8266", {
        "name": "ESP8266 (1 MB+ flash)", "free": 34 * 1024, "tls": 12 * 1024, "code": "frozen", "codes": ("frozen",),
        "events": 8,
        "note": "38 KB fixed heap; axTLS buffers (~5 KB record + handshake, assumed) come from it; "
                "no certificate verification; code must be frozen",
    }),
    ("esp32", {
        "name": "ESP32 without PSRAM", "free": 110 * 1024, "tls": 3 * 1024, "code": "frozen", "codes": ("mpy", "frozen"),
        "events": 64,
        "note": "Mbed TLS (~20 KB per connection) and WiFi live in the ESP-IDF heap outside the Python heap; "
                "the board example (w = 1024, shadow) needs the frozen image (firmware/manifest.py)",
    }),
    ("picow", {
        "name": "Raspberry Pi Pico W", "free": 160 * 1024, "tls": 28 * 1024, "code": "mpy", "codes": ("mpy", "frozen"),
        "events": 64,
        "note": "Mbed TLS buffers (16 KiB in-record, 4 KiB out, session: 26.6 KB measured) are allocated "
                "from the Python heap",
    }),
)


def profile(name):
    for k, p in PROFILES:
        if k == name:
            return p
    raise ValueError("unknown board %r (known: %s)" % (name, ", ".join([k for k, _ in PROFILES])))


def code_bytes(code, levels=1):
    """Heap of the imported code; tree mode (levels > 1) imports agent/tree.py instead of agent/recorder.py."""
    if code == "py":
        base, tree = CODE_PY, TREE_CODE_PY
    elif code == "mpy":
        base, tree = CODE_MPY, TREE_CODE_MPY
    elif code == "frozen":
        base, tree = CODE_FROZEN, TREE_CODE_FROZEN
    else:
        raise ValueError("code must be py, mpy or frozen")
    return base + (tree if levels > 1 else 0)


def cell_bytes(levels=1, shadow=False):
    """Steady heap per sketch cell: L accumulators + one scratch (window/keep: L = 1, 8 bytes),
    + the shadow array(s) under persist_noise = "shadow" (one per level in tree mode)."""
    if levels > 1:
        return 4 * (levels + 1) + (SHADOW_CELL * levels if shadow else 0)  # + one shadow per level
    return CELL + (SHADOW_CELL if shadow else 0)


def max_cells(free, tls_heap, code="mpy", tls=True, max_events=64, levels=1, shadow=False):
    """Largest d*w that fits in ``free`` bytes of heap (0 if none)."""
    fixed = code_bytes(code, levels) + APP_FIXED + RESERVE
    steady = free - fixed - (tls_heap if tls else 0) - STEP_EVENT * max_events
    boot = free - fixed
    cell = cell_bytes(levels, shadow)
    n = min(steady // cell, boot // (cell + BOOT_CELL))
    return n if n > 0 else 0


def need(d, w, tls_heap, code="mpy", tls=True, max_events=64, levels=1, shadow=False):
    """Heap (bytes) a d x w sketch needs at its worst moment."""
    n = d * w
    fixed = code_bytes(code, levels) + APP_FIXED + RESERVE
    cell = cell_bytes(levels, shadow)
    steady = fixed + cell * n + STEP_EVENT * max_events + (tls_heap if tls else 0)
    boot = fixed + (cell + BOOT_CELL) * n
    return steady if steady > boot else boot


def max_levels(free, tls_heap, d, w, code="mpy", tls=True, max_events=64):
    """Largest tree L (2..24) whose d x w sketch fits, 0 if none."""
    best = 0
    for L in range(2, 25):
        if need(d, w, tls_heap, code, tls, max_events, L) <= free:
            best = L
    return best


def tree_table(shapes=((4, 64), (4, 128), (4, 256), (4, 512), (8, 256)), tls=True):
    """Markdown table: largest tree L per board and sketch shape, and per-event cost per L."""
    lines = [
        "| board | code | TLS | " + " | ".join("d=%d w=%d: max L" % s for s in shapes) + " |",
        "|---|---|---|" + "---|" * len(shapes),
    ]
    for key, p in PROFILES:
        cells = []
        for d, w in shapes:
            L = max_levels(p["free"], p["tls"], d, w, p["code"], tls, p["events"])
            cells.append("%d" % L if L else "-")
        lines.append("| %s | %s | %s | %s |" % (p["name"], p["code"], "on" if tls else "off", " | ".join(cells)))
    lines.append("")
    lines.append("| L | heap per cell | d=4 w=256 sketch | µs per event in the VM (d=4) | releases per epoch (avg) |")
    lines.append("|---|---|---|---|---|")
    for L in sorted(TREE_US_PER_EVENT):
        lines.append("| %s | %d B | %.1f KB | %.0f | %s |" % (
            "1 (window/keep)" if L == 1 else "%d" % L, cell_bytes(L), cell_bytes(L) * 1024 / 1000.0,
            TREE_US_PER_EVENT[L], "1" if L == 1 else "%.3f" % (2 - 2.0 ** (1 - L))))
    return "\n".join(lines)


def _pow2_le(x):
    p = 1
    while p * 2 <= x:
        p *= 2
    return p if x >= 2 else 0


def table(tls_modes=(True, False)):
    """Markdown table of the largest sketches per board profile and install (window and keep mode alike)."""
    lines = [
        "| board | code | TLS | events/step | max d*w cells | d=4: max w (power of 2) | d=8: max w (power of 2) "
        "| shadow: max d*w | shadow d=4: max w (power of 2) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, p in PROFILES:
        for code in p["codes"]:
            for tls in tls_modes:
                n = max_cells(p["free"], p["tls"], code, tls, p["events"])
                ns = max_cells(p["free"], p["tls"], code, tls, p["events"], 1, True)
                lines.append("| %s | %s | %s | %d | %d | %d (%d) | %d (%d) | %d | %d (%d) |" % (
                    p["name"], code, "on" if tls else "off", p["events"], n, n // 4, _pow2_le(n // 4),
                    n // 8, _pow2_le(n // 8), ns, ns // 4, _pow2_le(ns // 4)))
    lines.append("")
    for key, p in PROFILES:
        lines.append("* %s: %s." % (p["name"], p["note"]))
    return "\n".join(lines)


def kind_table(tls=True):
    """Markdown table: the largest sketch of each kind per board profile (kinds dcs and dbits).

    dcs keeps (b + 1)*d*w cells (CELL bytes each, like cs); dbits keeps d*w/8
    bytes of bits plus d int32 release cells (no state file, no boot copy):
    in cell units (d*w/8 + 8*d) / CELL.
    """
    lines = [
        "| board | TLS | dcs b=16 d=3: max w | dcs b=32 d=3: max w | dcs b=48 d=2: max w | dbits d=16: max w (bits/level) |",
        "|---|---|---|---|---|---|",
    ]
    for key, p in PROFILES:
        n = max_cells(p["free"], p["tls"], p["code"], tls, p["events"])
        bytes_free = n * CELL
        dbits_w = ((bytes_free - 8 * 16) * 8 // 16) // 8 * 8
        lines.append("| %s | %s | %d (%d) | %d (%d) | %d (%d) | %d |" % (
            p["name"], "on" if tls else "off", n // (17 * 3), _pow2_le(n // (17 * 3)), n // (33 * 3),
            _pow2_le(n // (33 * 3)), n // (49 * 2), _pow2_le(n // (49 * 2)), max(0, dbits_w)))
    return "\n".join(lines)


def estimate_lines(d, w, tls=True, max_events=64, code=None, levels=1, shadow=False):
    out = []
    for key, p in PROFILES:
        c = code or p["code"]
        n = max_cells(p["free"], p["tls"], c, tls, max_events, levels, shadow)
        req = need(d, w, p["tls"], c, tls, max_events, levels, shadow)
        line = "%-8s %-6s needs %6d of %6d bytes: %s; largest w for d=%d: %d" % (
            key, c, req, p["free"], "fits" if req <= p["free"] else "DOES NOT FIT", d, n // d)
        if levels > 1:
            line += "; largest L for %dx%d: %d" % (d, w, max_levels(p["free"], p["tls"], d, w, c, tls, max_events))
        out.append(line)
    return out


CODE_WORDS = {"py": ".py sources", "mpy": ".mpy", "frozen": "the firmware frozen into the image"}
CODE_FLAGS = {"py": "(no flag)", "mpy": "--mpy", "frozen": "--frozen"}


def _cells_for(p, w):
    """Heap cells (CELL-byte units) of the sketch of Params ``p`` with ``w`` columns."""
    if p.kind == "dbits":  # d levels of w bits + d int32 release counts (kind_table)
        return (p.d * w // 8 + 8 * p.d + CELL - 1) // CELL
    return p.dcs_levels * p.d * w


def _need(p, w, board, code, tls, max_events, levels, shadow):
    b = profile(board)
    return need(_cells_for(p, w), 1, b["tls"], code, tls, max_events, levels, shadow)


def _largest_w(p, board, code, tls, max_events, levels, shadow):
    """The largest w below p.w that fits (a power of two when p.w is one), 0 if none."""
    free = profile(board)["free"]
    pow2 = p.w & (p.w - 1) == 0
    step = 8 if p.kind == "dbits" else 1
    w = p.w
    while w > step:
        w = w // 2 if pow2 else w - step
        if _need(p, w, board, code, tls, max_events, levels, shadow) <= free:
            return w
    return 0


def fit(p, board, code, tls=True, max_events=64):
    """Does the sketch of Params ``p`` fit ``board`` with the code installed as ``code`` (py, mpy, frozen)?

    Returns (fits, lines): the estimate, and when it does not fit the smallest changes that do, each
    alone, the sketch's own shape kept where possible: another code form, fewer events per step,
    persist_noise = "refresh" (no shadow array), fewer tree levels, then the largest w that fits."""
    b = profile(board)
    free = b["free"]
    levels, shadow = p.levels, p.shadow
    req = _need(p, p.w, board, code, tls, max_events, levels, shadow)
    lines = ["%s with %s: needs %d of %d bytes of heap (TLS %s, %d events per step): %s" % (
        board, CODE_WORDS[code], req, free, "on" if tls else "off", max_events,
        "fits" if req <= free else "DOES NOT FIT")]
    if req <= free:
        return True, lines
    changes = []
    for other in ("mpy", "frozen"):
        if other != code and _need(p, p.w, board, other, tls, max_events, levels, shadow) <= free:
            changes.append("flash with %s (%s): this config fits the %s as it is" % (
                CODE_FLAGS[other], CODE_WORDS[other], board))
    if max_events > 8 and _need(p, p.w, board, code, tls, 8, levels, shadow) <= free:
        changes.append("max_events_per_step = 8 fits the %s with %s (less garbage per step)" % (
            board, CODE_WORDS[code]))
    if shadow and _need(p, p.w, board, code, tls, max_events, levels, False) <= free:
        changes.append('persist_noise = "refresh" fits the %s with %s (no shadow array; one more '
                       'internal noise draw per persist)' % (board, CODE_WORDS[code]))
    if levels > 1:
        L = max_levels(free, b["tls"], _cells_for(p, p.w), 1, code, tls, max_events)
        if L >= 2:
            changes.append("levels = %d fits the %s with %s" % (L, board, CODE_WORDS[code]))
    w = _largest_w(p, board, code, tls, max_events, levels, shadow)
    if w:
        changes.append("w = %d fits the %s with %s" % (w, board, CODE_WORDS[code]))
    if changes:
        lines.append("smallest change that fits: " + changes[0])
        lines.extend("  or: " + c for c in changes[1:])
    else:
        lines.append("no smaller sketch of this kind and d fits the %s with %s: use a board with more heap"
                     % (board, CODE_WORDS[code]))
    return False, lines


def fit_main(path, board, code, tls=True, out=print):
    """What ``pansketch fit`` and deploy/flash.sh run: 0 fits, 3 does not, 2 a bad config (the key named)."""
    import json

    from pansketch.firmware.config import Config, ConfigError

    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        out("config error: %s: %s" % (path, exc))
        return 2
    try:
        cfg = Config(raw)
        profile(board)
    except (ConfigError, ValueError) as exc:
        out("config error: %s" % exc)
        return 2
    p = cfg.params
    tls = cfg.tls and tls
    out("%s: %s d=%d w=%d (%d cells), %s mode, persist noise %s" % (
        path, p.kind, p.d, p.w, p.cells, p.mode, "shadow" if p.shadow else "refresh"))
    ok, lines = fit(p, board, code, tls, cfg.max_events)
    for line in lines:
        out(line)
    if not cfg.tls:
        out("warning: mqtt.tls is off: the broker of deploy/OPERATIONS.md takes devices only over TLS "
            "(port 8883, mqtt.tls.ca = its fleet CA in DER, ca.der from make-device-credentials.sh)")
    elif not cfg.tls_verify:
        out("warning: mqtt.tls.verify is false: anyone on the network can pose as the broker")
    return 0 if ok else 3


def report(path=None):
    """On the board: estimate from the real free heap (run after Ctrl-C in main.py)."""
    import gc

    from pansketch.firmware import config

    cfg = config.load(path or config.DEFAULT_PATH)
    gc.collect()
    free = gc.mem_free()
    p = cfg.params
    print("config: %s %dx%d (%d cells = %d bytes of sketch), TLS %s" % (
        p.kind, p.d, p.w, p.cells, cell_bytes(p.levels, p.shadow) * p.cells, "on" if cfg.tls else "off"))
    print("heap free now: %d bytes; a step of %d events makes ~%d bytes of garbage" % (
        free, cfg.max_events, STEP_EVENT * cfg.max_events))
    print("if the sketch is allocated (app running), more cells that would fit: %d" % (
        max(0, (free - RESERVE - STEP_EVENT * cfg.max_events) // cell_bytes(p.levels, p.shadow))))


# kind strhh, measured on the stdlib's identifier tokens (host_tools/bench/strheavy.py, docs/HOST.md):
# (len, d, w, events, eps, recall at k = 10 (mean over 20 runs), smallest count every run reported)
STRHH_MEASURED = ((6, 5, 80, 100000, "1", 0.91, 1006), (12, 5, 1024, 463783, "1", 1.0, 1516))
STRHH_PICO = (6, 5, 80)  # the Pico-sized configuration of the table (2,400 cells)


def strhh_noise_sd(L, d, noise, inoise=None):
    """sd of a strhh node estimate from the noise: the mean of d cells, each with the internal and the
    output draw (``noise``/``inoise``: pansketch.agent.calibrate specs with mech, num, den)."""
    import math

    def var(spec):
        t = spec.num / spec.den
        if spec.mech == "dgauss":
            return t
        q = math.exp(-1.0 / t)
        return 2 * q / (1 - q) ** 2

    return math.sqrt((var(noise) + var(inoise or noise)) / d)


def strhh_lines(L, d, w, shadow=False, tls=True, noise=None, inoise=None, events=100000):
    """Kind strhh (agent/strhh.py): L*d*w cells. Per board profile: does it fit, the largest
    power-of-two w for these L and d, and the largest w of the Pico-sized len=6 d=5; then the
    error at ``events`` events per window: the noise sd of a node estimate (with the release's
    ``noise`` spec) and what was measured at that size (STRHH_MEASURED). The host's descent
    needs d >= 3 (docs/PRIVACY.md)."""
    out = []
    pl, pd, _pw = STRHH_PICO
    for key, p in PROFILES:
        n = max_cells(p["free"], p["tls"], p["code"], tls, p["events"], 1, shadow)
        wmax = _pow2_le(n // (L * d)) if n >= L * d else 0
        out.append("%-8s %s for len=%d d=%d w=%d (%d cells of %d); largest power-of-two w at len=%d d=%d: %d;"
                   " largest w at len=%d d=%d: %d" % (
                       key, "fits" if L * d * w <= n else "DOES NOT FIT", L, d, w, L * d * w, n, L, d, wmax,
                       pl, pd, n // (pl * pd)))
    if noise is not None:
        sd = strhh_noise_sd(L, d, noise, inoise)
        out.append("error    at %d events per window: noise sd of a node estimate %.0f (%.2f %% of the events);"
                   " the CountSketch collisions add an error set by the stream (heavy strings elsewhere in a row)"
                   % (events, sd, 100.0 * sd / events))
    for ml, md, mw, mn, meps, rec, small in STRHH_MEASURED:
        out.append("measured len=%d d=%d w=%d, %d events, eps=%s (stdlib tokens): recall at k=10 %.2f, every string"
                   " of >= %d events (%.2f %%) found" % (ml, md, mw, mn, meps, rec, small, 100.0 * small / mn))
    return out


def main(argv=None):
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m pansketch.firmware.memory",
                                 description="Heap estimate of the pansketch firmware per board profile.")
    ap.add_argument("--config", help="board config file (pansketch.json) to check")
    ap.add_argument("--table", action="store_true", help="print the table of largest sketches")
    ap.add_argument("--tree", action="store_true", help="print the tree-mode table (largest L per board)")
    ap.add_argument("--no-tls", action="store_true", help="assume a plain MQTT connection")
    ap.add_argument("--code", choices=("py", "mpy", "frozen"), help="how the code is installed (default per board)")
    ap.add_argument("--require-fit", action="store_true",
                    help="with --config: exit 3 when the config fits no board profile (deploy/flash.sh)")
    a = ap.parse_args(argv)
    tls = not a.no_tls
    if a.config:
        with open(a.config) as f:
            raw = json.load(f)
        from pansketch.firmware.config import Config, ConfigError

        try:
            cfg = Config(raw)
        except ConfigError as exc:
            print("config error: %s" % exc)
            return 2
        tls = cfg.tls and not a.no_tls
        p = cfg.params
        print("%s: %s d=%d w=%d (%d cells), %s mode, persist noise %s, TLS %s" % (
            a.config, p.kind, p.d, p.w, p.d * p.w, p.mode, "shadow" if p.shadow else "refresh",
            "on" if tls else "off"))
        if p.kind == "strhh":  # len levels of d x w: the cells are L*d*w (agent/strhh.py)
            lines = strhh_lines(p.b, p.d, p.w, p.shadow, tls, p.noise, p.inoise)
        else:
            lines = estimate_lines(p.d, p.w, tls, cfg.max_events, a.code, p.levels, p.shadow)
        for line in lines:
            print(line)
        if not cfg.tls:
            print("warning: mqtt.tls is off: the broker of deploy/OPERATIONS.md takes devices only over TLS "
                  "(port 8883, mqtt.tls.ca = its fleet CA in DER, ca.der from make-device-credentials.sh)")
        elif not cfg.tls_verify:
            print("warning: mqtt.tls.verify is false: anyone on the network can pose as the broker")
        if a.require_fit and all("DOES NOT FIT" in line for line in lines):
            print("%s: fits no board profile (%s): make w (or d, or L) smaller, see the largest w above"
                  % (a.config, ", ".join(k for k, _ in PROFILES)))
            return 3
        return 0
    if a.tree:
        print(tree_table(tls=tls))
        return 0
    print(table((True, False) if tls else (False,)))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())

