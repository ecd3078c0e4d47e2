"""WiFi station with retry and capped exponential backoff, never blocking.

``Wifi.poll()`` is called every main-loop step. It starts a connection
attempt, waits (across steps, without blocking) up to
``connect_timeout_s`` for it, and after a failure waits 2, 4, 8, ... up to
``retry_max_s`` seconds before the next one. A lost link is noticed at the
next poll and retried at once (then with backoff). Counting never waits
for the network.
"""


def activate(hostname=None):
    """Switch the station interface on; the WLAN object (None without ``network``).

    Called first thing at boot, before any random byte is read: on the ESP32
    ``os.urandom`` is ``esp_random()``, which Espressif documents as a true
    RNG only while WiFi or Bluetooth is enabled (docs/FIRMWARE.md).
    """
    try:
        import network
    except ImportError:  # a board without WiFi: Wifi.poll() will say so
        return None
    if hostname:
        try:
            network.hostname(hostname)
        except Exception:
            pass
    wlan = network.WLAN(network.STA_IF)
    wlan.active(True)
    return wlan

# network.STAT_* values differ per port; look them up by name for messages.
_STATUS_NAMES = ("STAT_WRONG_PASSWORD", "STAT_NO_AP_FOUND", "STAT_CONNECT_FAIL", "STAT_BEACON_TIMEOUT",
                 "STAT_ASSOC_FAIL", "STAT_HANDSHAKE_TIMEOUT")


class Wifi:
    def __init__(self, ssid, password, log, hostname=None, connect_timeout_s=20, retry_max_s=300, wlan=None):
        self.ssid = ssid
        self.password = password
        self.hostname = hostname
        self.log = log
        self.timeout_ms = connect_timeout_s * 1000
        self.retry_max_ms = retry_max_s * 1000
        self.delay_ms = 2000
        self.next_ms = None  # uptime of the next attempt (None: now)
        self.started = None  # uptime when the running attempt began
        self.up = False
        self.wlan = wlan  # already active when given (see activate)
        self.attempts = 0

    def _iface(self):
        if self.wlan is None:
            self.wlan = activate(self.hostname)
            if self.wlan is None:
                raise OSError("this board has no network module (no WiFi)")
        return self.wlan

    def _status_text(self, wlan):
        try:
            import network

            st = wlan.status()
            for name in _STATUS_NAMES:
                if getattr(network, name, None) == st:
                    return name[5:].lower().replace("_", " ")
            return "status %r" % (st,)
        except Exception:
            return "no status"

    def poll(self, now_ms):
        """True while connected; otherwise drives the connect/backoff cycle."""
        wlan = self._iface()
        if wlan.isconnected():
            if not self.up:
                self.up = True
                self.started = None
                self.delay_ms = 2000
                try:
                    ip = wlan.ifconfig()[0]
                except Exception:
                    ip = "?"
                self.log("wifi: connected to %r as %s" % (self.ssid, ip))
            return True
        if self.up:
            self.up = False
            self.started = None
            self.next_ms = now_ms
            self.log("wifi: link to %r lost; reconnecting" % self.ssid)
        if self.started is not None:
            if now_ms - self.started < self.timeout_ms:
                return False
            why = self._status_text(wlan)
            try:
                wlan.disconnect()
            except Exception:
                pass
            self.started = None
            self.next_ms = now_ms + self.delay_ms
            self.log("wifi: cannot join %r (%s); next try in %d s" % (self.ssid, why, self.delay_ms // 1000))
            self.delay_ms = min(self.delay_ms * 2, self.retry_max_ms)
            return False
        if self.next_ms is None or now_ms >= self.next_ms:
            self.attempts += 1
            try:
                wlan.connect(self.ssid, self.password)
            except OSError as exc:
                self.next_ms = now_ms + self.delay_ms
                self.log("wifi: connect(%r) failed (%s); next try in %d s" % (self.ssid, exc, self.delay_ms // 1000))
                self.delay_ms = min(self.delay_ms * 2, self.retry_max_ms)
                return False
            self.started = now_ms
        return False
