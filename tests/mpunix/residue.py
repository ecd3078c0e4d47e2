# Runs inside the MicroPython Unix port instead of /main.py (tests/mpunix/board.py
# with SCRIPT=residue; tests/support/residue.py compiles it to .mpy in /hw and
# reads the process's memory at every "@pause"). It boots the board firmware from
# /pansketch.json exactly as main.py would, with one difference: the Rng's byte
# source is os.urandom teed into /hw/random.bin, so the host knows every random
# byte the noise was drawn from and can look for them in the dump.
#
# Options in /hw/residue.json:
#   bursts       number of bursts of UART lines (the host writes each burst to
#                /hw/uart1 before it lets the pause before it go on)
#   mid          events the first burst's first step counts before the
#                "mid-step" pause (Source.poll called directly: the moment inside
#                App.step after counting and before what follows it)
#   no_scrub     true: switch the scrub off (pansketch.agent.wipe.ENABLED = False), the
#                negative control
#   grows        true: scrub as on a port whose heap grows (pansketch.agent.wipe.GROWS)
#   limit_ms     give up waiting for a persist or a release after this long
#
#   @pause NAME N   the host dumps the memory now (N: the pause's number); the
#                   script sleeps, then waits for /hw/goN
#   @done 1
import json
import os
import time

f = open("/hw/residue.json")
opts = json.loads(f.read())
f.close()
del f
try:
    from pansketch.agent import wipe

    if opts.get("no_scrub"):
        wipe.ENABLED = False
    if opts.get("grows"):
        wipe.GROWS = True
    del wipe
except ImportError:  # firmware without the scrub
    pass

from pansketch.agent.rng import Rng, SystemSource  # noqa: E402
from pansketch.firmware import app as fwapp  # noqa: E402


class Tee:
    """os.urandom, each read also appended to /hw/random.bin (written from the bytes object itself)."""

    fresh = True  # what read returns is os.urandom's new object (the Rng may wipe it)

    def __init__(self):
        self.src = SystemSource()
        self.f = open("/hw/random.bin", "wb")

    def read(self, n):
        b = self.src.read(n)
        self.f.write(b)
        return b


_n = [0]


def pause(name):
    k = _n[0]
    _n[0] = k + 1
    print("@pause %s %d" % (name, k))
    time.sleep_ms(200)  # the host stops the process in here
    p = "/hw/go%d" % k
    while True:
        try:
            os.stat(p)
            return
        except OSError:
            time.sleep_ms(10)


def steps_until(a, cond, limit):
    t0 = time.ticks_ms()
    while not cond():
        ms = a.step()
        if time.ticks_diff(time.ticks_ms(), t0) > limit:
            print("@timeout 1")
            return
        fwapp.sleep(a, ms if ms < 50 else 50)


a = fwapp.boot("/pansketch.json", rng=Rng(Tee()))
if not a.running:
    print("@idle " + a.reason)
    raise SystemExit(2)
limit = opts.get("limit_ms", 20000)
steps_until(a, lambda: a.clock.synced, limit)
u = a.source.uart
for b in range(opts.get("bursts", 2)):
    pause("before-burst-%d" % b)  # the host writes the burst now
    if b == 0 and opts.get("mid"):
        a.source.poll(a, opts["mid"])
        pause("mid-step")
    steps_until(a, lambda: not u.any(), limit)
    pause("after-burst-%d" % b)
    t0 = time.ticks_ms()
    while time.ticks_diff(time.ticks_ms(), t0) < 1000:  # idle main loop, 1 s
        fwapp.sleep(a, a.step())
    pause("idle-1s-%d" % b)
    last = a.rec.last_persist
    steps_until(a, lambda: a.rec.last_persist != last, limit)
    pause("after-persist-%d" % b)
    seq = a.rec.seq
    steps_until(a, lambda: a.rec.seq != seq, limit)
    pause("after-release-%d" % b)
print("@done 1")
