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

if not options.unix_port:  # tests/mpunix/manifest.py (the Unix port has no boards/manifest.py)
    include("$(PORT_DIR)/boards/manifest.py")  # the port's own frozen modules
require("umqtt.simple")  # micropython-lib; our own deterministic CBOR encoder replaces cbor2

# The device core: only modules that run on MicroPython (agent/daemon.py,
# config.py, sources.py and publisher.py are the CPython Pi daemon).
CORE = (
    "__init__.py", "acks.py", "calibrate.py", "cbor.py", "dbits.py", "dcs.py", "strhh.py", "hashing.py", "levels.py",
    "noise.py", "params.py", "recorder.py", "recorders.py", "release.py", "rng.py", "sketch.py", "storage.py", "tree.py",
)
FIRMWARE = (
    "__init__.py", "app.py", "clock.py", "config.py", "memory.py", "mqtt.py", "wifi.py",
    "sources/__init__.py", "sources/ble.py", "sources/gpio.py", "sources/pulse.py", "sources/uart.py",
)
package("agent", files=CORE, base_path="..")
package("firmware", files=FIRMWARE, base_path="..")
