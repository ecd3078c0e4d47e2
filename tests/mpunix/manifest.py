# The frozen image of the Unix-port VM (tests/mpunix/build-frozen.sh): what
# firmware/manifest.py freezes into a board's image (device core, firmware,
# umqtt.simple), plus micropython-lib's ssl wrapper, which the official ESP32
# and Pico W images freeze (their boards/manifest.py; the Unix port has none).
require("ssl")
include("../../firmware/manifest.py", unix_port=True)
