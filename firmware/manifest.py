# Freeze pansketch (device core + board firmware + umqtt.simple) into a
# MicroPython image, so the code runs from flash and costs almost no RAM
# (needed on ESP8266, recommended everywhere; firmware/memory.py):
#
#   cd micropython/ports/esp32        # or ports/rp2, ports/esp8266
#   make submodules
#   make BOARD=ESP32_GENERIC FROZEN_MANIFEST=/path/to/pansketch/firmware/manifest.py
#   # rp2: make BOARD=RPI_PICO_W FROZEN_MANIFEST=...
#
# Then flash the image (esptool / UF2) and run deploy/flash.sh --frozen to
# copy only the config, boot.py and main.py. Paths are relative to this file.

import os

if not options.unix_port:  # tests/mpunix/manifest.py (the Unix port has no boards/manifest.py)
    include("$(PORT_DIR)/boards/manifest.py")  # the port's own frozen modules
require("umqtt.simple")  # micropython-lib; our own deterministic CBOR encoder replaces cbor2

# What goes on a board, by one rule (tests/test_layering.py holds the tree to it):
# every module directly in agent/ is the portable device core and is frozen;
# agent/pi/ is the CPython-only Pi daemon and never is. firmware/ is frozen
# whole except this manifest and boot.py/main.py (copied to the board's
# filesystem by deploy/flash.sh). The freezer runs this file under CPython
# with the working directory set to firmware/, so it can list the folders.


def _py_files(root, skip=()):
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__")))
        rel = os.path.relpath(d, root)
        for n in sorted(names):
            f = n if rel == "." else rel.replace(os.sep, "/") + "/" + n
            if n.endswith(".py") and f not in skip:
                out.append(f)
    return out


CORE = tuple(sorted(n for n in os.listdir("../agent") if n.endswith(".py")))
FIRMWARE = tuple(_py_files(".", skip=("manifest.py", "boot.py", "main.py")))
package("agent", files=CORE, base_path="..")
package("firmware", files=FIRMWARE, base_path="..")
