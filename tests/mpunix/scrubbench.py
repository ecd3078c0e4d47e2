# Runs inside the MicroPython Unix port instead of /main.py (tests/mpunix/board.py
# with SCRIPT=scrubbench; benchmarks/residue_unix.py compiles it and benchrun.py, whose
# RAM UART and timing it uses, to .mpy in /hw).
# Boots the firmware from /pansketch.json as main.py would, then measures what
# wiping costs (fastest of 5 repetitions each; the host is shared):
#
#   @heap BYTES FREE              the VM's heap, free after boot (collected)
#   @event_add US GARBAGE         App.add of a str item (the path without views)
#   @event_view US GARBAGE        App.add_view of the same item in a buffer (if the firmware has it)
#   @uart K US_EVENT US_STEP MIN  App.step() counting K lines of a RAM UART (scrub included):
#                                 mean per event, mean and fastest per step
#   @scrub METHOD FREE US         pansketch.agent.wipe.heap() with FREE bytes free: probe | exact
#   @done 1
import gc
import time

from pansketch.firmware import app as fwapp


a = fwapp.boot("/pansketch.json")
if not a.running:
    print("@idle " + a.reason)
    raise SystemExit(2)
gc.collect()
print("@heap %d %d" % (gc.mem_alloc() + gc.mem_free(), gc.mem_free()))  # before benchrun is loaded
from benchrun import RamUart, best, out  # noqa: E402
items = ["secret-mac-%04d-0123456789ab" % i for i in range(64)]
bufs = []
for it in items:
    bufs.append(memoryview(bytearray(it.encode())))
N = 500


def run_add():
    for i in range(N):
        a.add(items[i & 63])


def run_view():
    for i in range(N):
        a.add_view(True, bufs[i & 63], 1)


def garbage(fn1):
    gc.collect()
    gc.disable()
    m = gc.mem_alloc()
    for i in range(16):
        fn1(i)
    g = (gc.mem_alloc() - m) // 16
    gc.enable()
    return g


run_add()
out("event_add", "%.2f" % (best(run_add) / N), garbage(lambda i: a.add(items[i])))
if hasattr(a, "add_view"):
    run_view()
    out("event_view", "%.2f" % (best(run_view) / N), garbage(lambda i: a.add_view(True, bufs[i], 1)))

u = RamUart(4096)
a.source.uart = u
for k in (1, 8, 64):
    tot = 0
    steps = 0
    low = None
    for r in range(40):
        for i in range(k):
            u.put(items[(r + i) & 63])
        seq = a.rec.seq
        t0 = time.ticks_us()
        a.step()
        dt = time.ticks_diff(time.ticks_us(), t0)
        if a.rec.seq == seq and not u.any() and (steps == 0 or dt < 20 * tot / steps):
            tot += dt
            steps += 1
            if low is None or dt < low:
                low = dt
    out("uart", k, "%.2f" % (tot / steps / k), "%.1f" % (tot / steps), low)

try:
    from pansketch.agent import wipe
except ImportError:
    wipe = None
if wipe is not None:
    gc.collect()
    free = gc.mem_free()
    out("scrub", "probe", free, best(wipe.heap))
    wipe.GROWS = True
    gc.collect()
    out("scrub", "exact", gc.mem_free(), best(wipe.heap))
    wipe.GROWS = False
gc.collect()
out("collect", gc.mem_free(), best(gc.collect))
out("done", 1)
