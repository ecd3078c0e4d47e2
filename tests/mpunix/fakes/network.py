"""Fake ``network`` for the Unix-port board (tests/unixvm.py).

The "WiFi" is the host's loopback: the station joins at once unless the
file /hw/wifi_down exists (then it cannot find the AP, and an up link
drops). Sockets themselves are the port's real ones.
"""
import os

STA_IF = 0
AP_IF = 1
STAT_IDLE = 1000
STAT_CONNECTING = 1001
STAT_WRONG_PASSWORD = 202
STAT_NO_AP_FOUND = 201
STAT_GOT_IP = 1010

_hostname = ["unix-board"]
_state = {"active": False, "target": None}


def hostname(name=None):
    if name is None:
        return _hostname[0]
    _hostname[0] = name


def _ap():
    try:
        os.stat("/hw/wifi_down")
        return False
    except OSError:
        return True


class WLAN:
    def __init__(self, iface=STA_IF):
        self.iface = iface

    def active(self, v=None):
        if v is None:
            return _state["active"]
        _state["active"] = bool(v)

    def connect(self, ssid, key=None):
        if not _state["active"]:
            raise OSError("WiFi Internal Error")
        _state["target"] = ssid

    def disconnect(self):
        _state["target"] = None

    def isconnected(self):
        return _state["target"] is not None and _ap()

    def status(self, *a):
        if self.isconnected():
            return STAT_GOT_IP
        return STAT_NO_AP_FOUND if not _ap() else STAT_IDLE

    def ifconfig(self, *a):
        return ("127.0.0.1", "255.0.0.0", "127.0.0.1", "127.0.0.1")

    def config(self, *a, **kw):
        return None
