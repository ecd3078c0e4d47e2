"""Fake ``ntptime`` for the Unix-port board (tests/unixvm.py): the host's clock.

Answers like micropython-lib's ntptime (seconds since the port's epoch,
1970 on the Unix port) from the host's real clock, plus the offset in
/hw/clock_offset if that file exists (a test can move "UTC" without
touching the host). /hw/ntp_down makes it time out, like an unreachable
server.
"""
import os
import time as _time

host = "pool.ntp.org"
timeout = 1


def _exists(p):
    try:
        os.stat(p)
        return True
    except OSError:
        return False


def time():
    if _exists("/hw/ntp_down"):
        raise OSError(110)  # ETIMEDOUT
    off = 0
    if _exists("/hw/clock_offset"):
        f = open("/hw/clock_offset")
        off = int(f.read().strip() or "0")
        f.close()
    return int(_time.time()) + off


def settime():
    time()
