# pansketch board boot file: deploy/flash.sh copies it to the board as /boot.py.
# Runs before main.py on every reset; keep it tiny (no network, no imports
# of pansketch code) so a broken main.py never stops the REPL from starting.
import gc

import micropython

try:
    micropython.alloc_emergency_exception_buf(128)  # readable tracebacks from IRQ handlers
except AttributeError:  # ports without it
    pass
try:
    import esp

    esp.osdebug(None)  # ESP8266/ESP32: keep vendor debug output off the console
except (ImportError, AttributeError):
    pass
gc.collect()
