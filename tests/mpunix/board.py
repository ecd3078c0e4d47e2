# Runs inside the MicroPython Unix port (tests/support/unixvm.py starts it): turns the
# process into a "board" and then runs the board's own /boot.py and /main.py.
#
#   micropython -X heapsize=128K board.py FLASH_DIR FAKES_DIR HW_DIR [SCRIPT]
#
# * FLASH_DIR is mounted at "/" (os.VfsPosix), so the firmware sees the flash
#   layout deploy/flash.sh writes: /pansketch.json, /boot.py, /main.py,
#   /agent, /firmware, /lib/umqtt/simple.py, and its state under /data.
# * FAKES_DIR (machine, network, ntptime, bluetooth: the board modules the
#   Unix port lacks, linked from tests/mpfakes, and fakehw, the hardware
#   behind them) is mounted at /fakes, first on sys.path.
# * HW_DIR is mounted at /hw: the files the fakes read (e.g. /hw/uart1, the
#   bytes arriving on UART 1).
# sys.path is then a board's ['', '.frozen', '/lib'] behind /fakes. Nothing
# else is faked: sockets, os.urandom, hashlib, the heap and its garbage
# collector are the port's own.
import os
import sys

# With SCRIPT (a module in HW_DIR, e.g. bench.mpy compiled from
# tests/mpunix/bench.py), that module runs instead of main.py.
flash, fakes, hw = sys.argv[1], sys.argv[2], sys.argv[3]
script = sys.argv[4] if len(sys.argv) > 4 else None
os.umount("/")
os.mount(os.VfsPosix(flash), "/")
os.mount(os.VfsPosix(fakes), "/fakes")
os.mount(os.VfsPosix(hw), "/hw")
os.chdir("/")
sys.path[:] = ["/fakes", "", ".frozen", "/lib"]
del flash, fakes, hw
import gc  # noqa: E402 (after the mounts: /fakes must be on the path first)

gc.collect()
import boot  # noqa: E402,F401  (like a board: boot.py, then main.py)

if script:
    sys.path.append("/hw")
    __import__(script)
else:
    import main  # noqa: E402,F401
