"""Fake ``network`` (station interface only) for both test VMs, over the WiFi of
``fakehw`` (simulated in the WebAssembly VM; loopback and /hw/wifi_down on the
Unix-port board)."""
import fakehw

STA_IF = 0
AP_IF = 1
STAT_IDLE = 1000
STAT_CONNECTING = 1001
STAT_WRONG_PASSWORD = 202
STAT_NO_AP_FOUND = 201
STAT_GOT_IP = 1010
_STATUS = {"idle": STAT_IDLE, "connecting": STAT_CONNECTING, "wrong_password": STAT_WRONG_PASSWORD,
           "no_ap": STAT_NO_AP_FOUND, "got_ip": STAT_GOT_IP}

_hostname = [fakehw.HOSTNAME]


def hostname(name=None):
    if name is None:
        return _hostname[0]
    _hostname[0] = name


_active = {}  # iface -> bool: like the real ports, WLAN(STA_IF) is one interface


class WLAN:
    def __init__(self, iface=STA_IF):
        self._iface = iface

    def active(self, v=None):
        on = _active.get(self._iface, False)
        if v is None:
            return on
        if v and not on:
            fakehw.radio_on()
        _active[self._iface] = bool(v)

    def connect(self, ssid, key=None):
        if not self.active():
            raise OSError("WiFi Internal Error")
        fakehw.wifi_join(ssid, key)

    def disconnect(self):
        fakehw.wifi_leave()

    def isconnected(self):
        return fakehw.wifi_connected()

    def status(self, *a):
        return _STATUS[fakehw.wifi_status()]

    def ifconfig(self, *a):
        return fakehw.IFCONFIG

    def config(self, *a, **kw):
        return None
