# Measurements for tests/mpunix/bench.py (imported after the firmware booted), and the
# RAM UART and timing helpers tests/mpunix/scrubbench.py shares:
#
#   @live_loaded BYTES                      live heap with this module loaded (the loop's baseline)
#   @loop STEPS LIVE_HW STEP_MS_MAX SEQ     real main loop until a release is committed and
#                                           published: live heap after every step (collected),
#                                           its high-water, the slowest step (the commit)
#   @alloc_event BYTES                      garbage per event (App.add of a text item)
#   @fill FREE US GCS GC_US                 with FREE bytes of the heap still free (ballast
#                                           keeps the rest live: the GC runs more often and
#                                           marks more): us/event (fastest of 5 x N events),
#                                           collections per 1000 events, us per gc.collect()
#   @idle_step_us US                        one main-loop step with nothing to do
#   @uart_us LINES US                       us/event through the UART source's line parsing and
#                                           App.step() (a RAM UART: no fake file I/O), steps
#                                           that committed or published a release left out
#   @done 1
import gc
import json
import time

from pansketch.firmware import app as fwapp


def out(key, *vals):
    print("@%s %s" % (key, " ".join(str(v) for v in vals)))


class RamUart:
    """A UART whose bytes are in RAM (the fake one reads a file: its I/O is not the firmware's cost)."""

    def __init__(self, size=1024):
        self.buf = bytearray(size)
        self.n = 0
        self.pos = 0

    def put(self, line):
        b = self.buf
        for c in line:
            b[self.n] = ord(c)
            self.n += 1
        b[self.n] = 10
        self.n += 1

    def any(self):
        return self.n - self.pos

    def readinto(self, buf, nbytes=None):
        k = len(buf) if nbytes is None else nbytes
        left = self.n - self.pos
        if left <= 0:
            return None
        if k > left:
            k = left
        for i in range(k):
            buf[i] = self.buf[self.pos + i]
        self.pos += k
        if self.pos == self.n:
            self.pos = self.n = 0
        return k


def best(fn, reps=5):
    """Fastest of ``reps`` calls of fn, in us (the host is shared; each call does the same work)."""
    b = None
    for _ in range(reps):
        t0 = time.ticks_us()
        fn()
        us = time.ticks_diff(time.ticks_us(), t0)
        if b is None or us < b:
            b = us
    return b


def until_released(a, collect, limit_ms=20000):
    """The real main loop (main()'s sleep included) until release 0 is committed and published."""
    steps = 0
    hw = 0
    slow = 0
    t0 = time.ticks_ms()
    while time.ticks_diff(time.ticks_ms(), t0) < limit_ms:
        s0 = time.ticks_ms()
        ms = a.step()
        d = time.ticks_diff(time.ticks_ms(), s0)
        if d > slow:
            slow = d
        steps += 1
        if collect:
            gc.collect()
            u = gc.mem_alloc()
            if u > hw:
                hw = u
        if a.rec.seq >= 1 and a.link.up and not a.rec.outbox.pending():
            return steps, hw, slow
        fwapp.sleep(a, ms)
    raise RuntimeError("no release published within %d ms" % limit_ms)


def run(a):
    f = open("/hw/bench.json")
    opts = json.loads(f.read())
    f.close()
    items = ["item-%04d" % i for i in range(64)]
    gc.collect()
    out("live_loaded", gc.mem_alloc())
    steps, hw, slow = until_released(a, True)
    out("loop", steps, hw, slow, a.rec.seq)

    def per_event(n):
        def events():
            for i in range(n):
                a.add(items[i & 63])

        return best(events) / n  # each rep has the same GC work

    def collections(n):
        c = 0
        prev = gc.mem_alloc()
        for i in range(n):
            a.add(items[i & 63])
            m = gc.mem_alloc()
            if m < prev:  # the heap in use shrank: a collection ran
                c += 1
            prev = m
        return c

    per_event(200)  # warm up
    gc.collect()
    a0 = gc.mem_alloc()
    for i in range(16):  # 16 events: far less than the free heap, so no collection in between
        a.add(items[i])
    out("alloc_event", (gc.mem_alloc() - a0) // 16)

    n = opts.get("events", 2000)
    for target in opts.get("fills", (0, 32768, 16384, 8192, 4096, 2048)):
        ballast = []
        gc.collect()
        if target:
            while gc.mem_free() > target + 1024:
                ballast.append(bytearray(512 if gc.mem_free() > target + 4096 else 64))
        gc.collect()
        free = gc.mem_free()
        us = per_event(n)
        gcs = collections(1000)
        out("fill", free, "%.2f" % us, gcs, best(gc.collect))
        ballast = None

    # the UART source path: App.step() reads lines from a UART and counts them
    lines = opts.get("uart_lines", 2000)
    gc.collect()
    u = RamUart()
    a.source.uart = u
    idle = None
    for _ in range(20):
        seq = a.rec.seq
        pub = a.link.published
        t0 = time.ticks_us()
        a.step()
        dt = time.ticks_diff(time.ticks_us(), t0)
        if a.rec.seq == seq and a.link.published == pub and (idle is None or dt < idle):
            idle = dt
    out("idle_step_us", idle)
    us = 0
    counted = 0
    for k in range(lines // 50):
        for i in range(50):
            u.put(items[(k + i) & 63])
        seq = a.rec.seq
        pub = a.link.published
        t0 = time.ticks_us()
        a.step()
        dt = time.ticks_diff(time.ticks_us(), t0)
        if a.rec.seq == seq and a.link.published == pub and not u.any():
            us += dt
            counted += 50
    out("uart_us", counted, "%.2f" % (us / counted))
    out("done", 1)
