"""Fake ``ntptime``: answers with fakehw.unix() when WiFi is up and ntp["ok"]."""
import fakehw

host = "pool.ntp.org"
timeout = 1
asked = []


def time():
    asked.append(host)
    if not fakehw.ntp["ok"] or not fakehw.wifi_connected():
        raise OSError(110)
    return fakehw.unix()  # the VM's port epoch is 1970


def settime():
    time()
