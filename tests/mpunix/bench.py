# Runs inside the MicroPython Unix port instead of /main.py (tests/mpunix/board.py
# with SCRIPT=bench; benchmarks/firmware_unix.py compiles it and benchrun.py to
# .mpy in the board's /hw). It boots the board firmware from /pansketch.json
# exactly as main.py would (this module is tiny, so it costs the boot next to
# nothing), then benchrun measures it with the port's real garbage collector in
# the fixed heap.
import gc

from pansketch.firmware import app as fwapp


def largest():
    """Largest block allocatable right now (bisection on bytearray sizes)."""
    gc.collect()
    lo, hi = 0, gc.mem_free()
    while hi - lo > 32:
        mid = (lo + hi) // 2
        try:
            bytearray(mid)  # probe: allocated and dropped at once
            lo = mid
        except MemoryError:
            hi = mid
    gc.collect()
    return lo


a = fwapp.boot("/pansketch.json")
if not a.running:
    print("@idle " + a.reason)
    raise SystemExit(2)
gc.collect()
print("@heap %d" % (gc.mem_alloc() + gc.mem_free()))
print("@live_boot %d" % gc.mem_alloc())
print("@largest_free_boot %d" % largest())
import benchrun  # noqa: E402

benchrun.run(a)
