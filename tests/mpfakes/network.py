"""Fake ``network`` (station interface only), driven by fakehw.wifi."""
import fakehw

STA_IF = 0
AP_IF = 1
STAT_IDLE = 1000
STAT_CONNECTING = 1001
STAT_WRONG_PASSWORD = 202
STAT_NO_AP_FOUND = 201
STAT_GOT_IP = 1010

_hostname = "esp"


def hostname(name=None):
    global _hostname
    if name is None:
        return _hostname
    _hostname = name


_active = {}  # iface -> bool: like the real ports, WLAN(STA_IF) is one interface


class WLAN:
    def __init__(self, iface=STA_IF):
        self._iface = iface

    @property
    def _active(self):
        return _active.get(self._iface, False)

    def active(self, v=None):
        if v is None:
            return self._active
        if v and not self._active:
            fakehw.order.append("wlan_active")
        _active[self._iface] = bool(v)

    def connect(self, ssid, key=None):
        if not self._active:
            raise OSError("WiFi Internal Error")
        fakehw.stats["wlan_connects"] += 1
        fakehw.sta["target"] = (ssid, key)
        fakehw.sta["since"] = fakehw.ms
        fakehw.sta["joined"] = False

    def disconnect(self):
        fakehw.sta["target"] = None
        fakehw.sta["joined"] = False

    def isconnected(self):
        return fakehw.wifi_connected()

    def status(self, *a):
        if fakehw.wifi_connected():
            return STAT_GOT_IP
        if not fakehw.wifi["ap"]:
            return STAT_NO_AP_FOUND
        t = fakehw.sta["target"]
        if t is not None and t[1] != fakehw.wifi["password"]:
            return STAT_WRONG_PASSWORD
        return STAT_CONNECTING

    def ifconfig(self, *a):
        return ("10.0.0.7", "255.255.255.0", "10.0.0.1", "10.0.0.1")

    def config(self, *a, **kw):
        return None
