# Runs inside the MicroPython Unix port instead of /main.py (tests/mpunix/board.py
# with SCRIPT=tlsheap; tests/test_firmware_unix_tls.py compiles it to .mpy in the
# board's /hw). Boots the firmware from /pansketch.json as main.py would, then runs
# its real main loop until a release is committed, published and acknowledged by
# the host, collecting after every step:
#
#   @heap BYTES           the VM's heap
#   @live_boot BYTES      live heap after boot (sketch allocated, not connected)
#   @loop STEPS LIVE_HW   steps, and the live heap's high-water over them (the MQTT
#                         session up, with TLS: Mbed TLS's buffers, which the port
#                         allocates from this heap, as on a Pico W)
#   @connected TLS        the link was up (TLS = 1 if over TLS)
import gc
import time

from pansketch.firmware import app as fwapp

a = fwapp.boot("/pansketch.json")
if not a.running:
    print("@idle " + a.reason)
    raise SystemExit(2)
gc.collect()
print("@heap %d" % (gc.mem_alloc() + gc.mem_free()))
print("@live_boot %d" % gc.mem_alloc())
steps = 0
hw = 0
t0 = time.ticks_ms()
while time.ticks_diff(time.ticks_ms(), t0) < 45000:  # generous: a loaded CI machine slows the handshake
    ms = a.step()
    steps += 1
    gc.collect()
    u = gc.mem_alloc()
    if u > hw:
        hw = u
    if a.rec.seq >= 1 and a.link.up and not a.rec.outbox.pending():
        break
    fwapp.sleep(a, ms)
print("@loop %d %d" % (steps, hw))
print("@connected %d" % (1 if a.link.up and a.cfg.tls else 0))
print("@done 1")
