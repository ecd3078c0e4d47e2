#!/usr/bin/env bash
# Put pansketch on a MicroPython board (ESP32, Pico W, ESP8266) over USB.
#
#   deploy/flash.sh -b picow -c my-board.json --mpy     # precompiled .mpy (less RAM), auto-detected port
#   deploy/flash.sh -b esp32 -p /dev/ttyUSB0 -c cfg.json # .py sources
#   deploy/flash.sh -b esp32 -c cfg.json --frozen       # image built with firmware/manifest.py
#   deploy/flash.sh -b picow -c cfg.json --mpy --put ca.der:/ca.der  # extra files (CA, client cert/key)
#   deploy/flash.sh -b picow -c cfg.json --mpy --dry-run  # print the steps; writes nothing, touches no board
#
# Steps (docs/FIRMWARE.md explains each):
#   1. check on the host, before anything is written: the config (pansketch.firmware.config, the same
#      validator the board runs); that its sketch fits the board (-b) with the code installed
#      the way this run installs it (.py, --mpy or --frozen: `pansketch fit`, firmware/memory.py),
#      else name the smallest change that fits; that every --put file exists; and that the
#      config no longer holds the example's placeholders (WiFi, broker, passwords, salt of
#      deploy/board/*.example.json). --force flashes a config that does not fit or still
#      has placeholders (never a missing --put file);
#   2. stage the device core (agent/ modules that run on MicroPython) and firmware/
#      into build/board/, compiled with mpy-cross when --mpy;
#   3. mpremote mip install umqtt.simple (not with --frozen: it is in the image;
#      cbor2 is not needed: releases use our deterministic encoder agent/cbor.py);
#   4. remove old copies on the board, copy the code, the config as /pansketch.json,
#      extra files, boot.py and main.py;
#   5. reset the board; `mpremote connect PORT repl` shows its console.
#
# Environment: MPREMOTE (default "mpremote"), MPY_CROSS (default "mpy-cross"),
# PYTHON (default "python3").
set -euo pipefail

MPREMOTE=${MPREMOTE:-mpremote}
MPY_CROSS=${MPY_CROSS:-mpy-cross}
PYTHON=${PYTHON:-python3}
PORT=auto
BOARD=
CONFIG=
MODE=py
MIP=1
DRY=0
FORCE=0
PUTS=()

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    echo "options: -b esp32|picow|esp8266  -p PORT  -c CONFIG  --mpy | --frozen  --no-mip  --put LOCAL:REMOTE  --dry-run  --force"
}

while [ $# -gt 0 ]; do
    case "$1" in
        -p|--port) PORT=$2; shift 2 ;;
        -b|--board) BOARD=$2; shift 2 ;;
        -c|--config) CONFIG=$2; shift 2 ;;
        --mpy) MODE=mpy; shift ;;
        --frozen) MODE=frozen; MIP=0; shift ;;
        --no-mip) MIP=0; shift ;;
        --put) PUTS+=("$2"); shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --force) FORCE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "flash.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

if [ -z "$CONFIG" ]; then
    echo "flash.sh: give the board config with -c FILE (start from deploy/board/pansketch.example.json)" >&2
    exit 2
fi
if [ ! -f "$CONFIG" ]; then
    echo "flash.sh: config file $CONFIG not found" >&2
    exit 2
fi
case "$BOARD" in
    esp32|picow|esp8266) ;;
    "") echo "flash.sh: name the board with -b esp32|picow|esp8266 (the fit check depends on it)" >&2; exit 2 ;;
    *) echo "flash.sh: unknown board $BOARD (esp32, picow or esp8266)" >&2; exit 2 ;;
esac
CONFIG=$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")
# every --put source, relative to where flash.sh was started (checked before anything is written)
missing=()
for spec in "${PUTS[@]+"${PUTS[@]}"}"; do
    case "$spec" in
        *:*) [ -f "${spec%%:*}" ] || missing+=("${spec%%:*}") ;;
        *) echo "flash.sh: --put $spec: give LOCAL:REMOTE (e.g. ca.der:/ca.der)" >&2; exit 2 ;;
    esac
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "flash.sh: --put file(s) not found: ${missing[*]} (from $(pwd)); nothing was written" >&2
    exit 2
fi
PUTS_ABS=()
for spec in "${PUTS[@]+"${PUTS[@]}"}"; do
    src=${spec%%:*}
    case "$src" in /*) ;; *) src=$(pwd)/$src ;; esac
    PUTS_ABS+=("$src:${spec#*:}")
done
# The device code: this checkout's, or for a copy of this script that `pansketch init` wrote, the
# installed package's (python -I: a folder named agent/ or firmware/ where this runs must not stand in
# for it). Staging goes to build/board in the checkout, or in the directory flash.sh was started from.
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -f "$REPO/firmware/manifest.py" ]; then
    STAGE=build/board
else
    STAGE=$(pwd)/build/board
    REPO=$("$PYTHON" -I -c 'import os, pansketch.firmware.memory as m; print(os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))))' 2>/dev/null) || {
        echo "flash.sh: no checkout around $0 and $PYTHON cannot import the installed pansketch (activate its venv, or PYTHON=...)" >&2
        exit 2
    }
fi
cd "$REPO"

# 1. validate + heap estimate for this board and this code form (exit 2 with the offending key on a bad
# config; 3: does not fit, with the smallest change that does). In a checkout the module runs from here;
# a pip-installed copy of this script (pansketch init) asks the installed `pansketch`.
if [ -f host_tools/cli.py ] && [ -f pyproject.toml ]; then FIT=("$PYTHON" -m pansketch.host_tools.cli fit); else FIT=("$PYTHON" -I -m pansketch.host_tools.cli fit); fi
fit=0
"${FIT[@]}" "$CONFIG" --board "$BOARD" --code "$MODE" || fit=$?
if [ "$fit" = 2 ] || { [ "$fit" != 0 ] && [ "$FORCE" = 0 ]; }; then
    [ "$fit" = 3 ] && echo "flash.sh: $CONFIG does not fit the $BOARD as flashed ($MODE): see the change above; nothing was written (--force flashes it anyway)" >&2
    exit 2
fi
[ "$fit" = 3 ] && echo "flash.sh: WARNING: flashing a config that does not fit the $BOARD because of --force" >&2
# the example's placeholders (compared with deploy/board/*.example.json; passwords are not echoed)
placeholders=$("$PYTHON" - "$CONFIG" <<'PY'
import glob, json, sys
from pansketch.agent.pi.tomlconf import PLACEHOLDER_SALTS
KEYS = (("salt",), ("wifi", "ssid"), ("wifi", "password"), ("mqtt", "host"), ("mqtt", "password"))
def get(d, path):
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None
    return d
cfg = json.load(open(sys.argv[1]))
examples = [json.load(open(f)) for f in sorted(glob.glob("deploy/board/*.example.json"))]
out = []
for path in KEYS:
    v = get(cfg, path)
    if v is None:
        continue
    if any(v == get(e, path) for e in examples) or (path == ("salt",) and v in PLACEHOLDER_SALTS):
        out.append(".".join(path) + ("" if "password" in path else " %r" % (v,)))
print(", ".join(out))
PY
)
if [ -n "$placeholders" ]; then
    if [ "$FORCE" = 0 ]; then
        echo "flash.sh: $CONFIG still has the example's placeholders: $placeholders; edit them (or --force)" >&2
        exit 2
    fi
    echo "flash.sh: WARNING: flashing the example's placeholders ($placeholders) because of --force" >&2
fi

# 2. stage
# the files firmware/manifest.py freezes, by running it as MicroPython's freezer does (in its folder)
CORE=$("$PYTHON" - <<'PY'
import os
class Options:
    unix_port = None
def package(p, files=None, base_path=".", opt=None):
    for f in files:  # the path on the board (pansketch/...) and the file it is made from
        print(p + "/" + f, os.path.relpath(os.path.realpath(os.path.join(base_path, p, f)), ".."))
os.chdir("firmware")
env = {"options": Options(), "include": lambda *a, **k: None, "require": lambda *a, **k: None,
       "module": lambda *a, **k: None, "package": package}
exec(compile(open("manifest.py").read(), "firmware/manifest.py", "exec"), env)
PY
)
if [ "$DRY" = 1 ]; then
    [ "$MODE" != frozen ] && echo "+ stage $(printf '%s\n' "$CORE" | wc -l) files into $STAGE ($MODE)"
else
    rm -rf "$STAGE"
    mkdir -p "$STAGE"
fi
if [ "$MODE" != frozen ] && [ "$DRY" = 0 ]; then
    while read -r f src; do
        mkdir -p "$STAGE/$(dirname "$f")"
        if [ "$MODE" = mpy ]; then
            "$MPY_CROSS" -o "$STAGE/${f%.py}.mpy" -s "$f" "$src"
        else
            cp "$src" "$STAGE/$f"
        fi
    done <<<"$CORE"
fi

run() {
    echo "+ $MPREMOTE $*"
    if [ "$DRY" = 0 ]; then "$MPREMOTE" "$@"; fi
}
CONN=(connect "$PORT")

# 3. libraries
if [ "$MIP" = 1 ]; then
    run "${CONN[@]}" mip install umqtt.simple
fi

# 4. files (old copies would shadow new or frozen modules: remove them first)
run "${CONN[@]}" rm -r :pansketch :agent :firmware 2>/dev/null || true  # (:agent, :firmware: the layout before pansketch/)
if [ "$MODE" != frozen ]; then
    run "${CONN[@]}" cp -r "$STAGE/pansketch" :
fi
run "${CONN[@]}" cp "$CONFIG" :pansketch.json + cp firmware/boot.py :boot.py + cp firmware/main.py :main.py
for spec in "${PUTS_ABS[@]+"${PUTS_ABS[@]}"}"; do
    run "${CONN[@]}" cp "${spec%%:*}" ":${spec#*:}"
done

# 5. go
run "${CONN[@]}" reset
if [ "$DRY" = 1 ]; then
    echo "flash.sh: dry run: nothing was written (no $STAGE) and the board was not touched"
else
    echo "flash.sh: done. Console: $MPREMOTE connect $PORT repl   (Ctrl-C stops main.py, Ctrl-X leaves)"
fi
