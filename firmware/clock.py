"""Time on the board: a monotonic uptime, and UTC once NTP has answered.

Windows and epochs follow the UTC clock (docs/ARCHITECTURE.md "Release modes"), so releases need a
synced clock. Until NTP answers the board keeps counting but commits no
release (``Clock.synced`` is False and the app says so on the console and
in its status). Times below :data:`MIN_VALID_UNIX` (2024-01-01) are
treated as "clock never set": that is what an RTC reads after a power cut
(2000-01-01 on ESP32/ESP8266, 2021-01-01 on the Pico).

UTC is kept as ``base + uptime``: after a sync the clock never reads the
RTC again, it adds the uptime measured with ``ticks_ms`` (accumulated in
small steps, so the 2**30 ms tick wrap-around is harmless). A resync
(every ``ntp.resync_s``) corrects drift.

The module-level functions (``ticks_ms``, ``ticks_diff``, ``ticks_add``,
``sleep_ms``, ``rtc_unix``) are the only way firmware code reads time, so
tests can replace them with a fake clock.
"""

import time

try:
    ticks_ms = time.ticks_ms
    ticks_diff = time.ticks_diff
    ticks_add = time.ticks_add
    sleep_ms = time.sleep_ms
except AttributeError:  # CPython: host tools import firmware modules to validate configs
    _PERIOD = 1 << 30

    def ticks_ms():
        return int(time.monotonic() * 1000) & (_PERIOD - 1)

    def ticks_diff(a, b):
        return ((a - b + _PERIOD // 2) & (_PERIOD - 1)) - _PERIOD // 2

    def ticks_add(a, d):
        return (a + d) & (_PERIOD - 1)

    def sleep_ms(n):
        time.sleep(n / 1000)

MIN_VALID_UNIX = 1704067200  # 2024-01-01T00:00:00Z

try:
    EPOCH_OFFSET = 946684800 if time.gmtime(0)[0] == 2000 else 0  # port epoch -> Unix
except Exception:
    EPOCH_OFFSET = 946684800


def rtc_unix():
    """What the board's RTC says, as Unix seconds (may be garbage before a sync)."""
    return int(time.time()) + EPOCH_OFFSET  # int(): the Unix port's time.time() is a float


class Clock:
    """Uptime (ms since construction) and, once synced, UTC seconds."""

    def __init__(self):
        self._t = ticks_ms()
        self._up = 0  # uptime ms
        self._base = None  # Unix seconds at uptime 0 (only when synced)
        self.synced_at = None  # uptime ms of the last successful sync

    def uptime_ms(self):
        t = ticks_ms()
        dt = ticks_diff(t, self._t)
        if dt > 0:
            self._up += dt
            self._t = t
        return self._up

    @property
    def synced(self):
        return self._base is not None

    def now(self):
        """UTC Unix seconds, or None while unsynced."""
        up = self.uptime_ms()
        if self._base is None:
            return None
        return self._base + up // 1000

    def provisional(self):
        """A time for code that needs one before the sync (RTC; may be invalid)."""
        if self._base is not None:
            return self.now()
        return rtc_unix()

    def set(self, unix):
        """Adopt ``unix`` (from NTP) as the current UTC time."""
        if unix < MIN_VALID_UNIX:
            raise ValueError("time %d is before 2024: not a real clock" % unix)
        up = self.uptime_ms()
        self._base = unix - up // 1000
        self.synced_at = up

    def sync(self, host, timeout_s):
        """Ask NTP (blocking for at most ``timeout_s``); returns the Unix time."""
        import ntptime

        ntptime.host = host
        ntptime.timeout = timeout_s
        t = int(ntptime.time())
        unix = t + EPOCH_OFFSET
        self.set(unix)
        try:  # best effort: keep the RTC right for the next soft reset
            import machine

            tm = time.gmtime(t)
            machine.RTC().datetime((tm[0], tm[1], tm[2], tm[6] + 1, tm[3], tm[4], tm[5], 0))
        except Exception:
            pass
        return unix
