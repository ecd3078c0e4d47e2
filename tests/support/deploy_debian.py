"""Shared by tests/test_deploy_debian.py and the tests that build on it: REPO, _why_not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def _why_not() -> str:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (unshare --mount --net, bind mounts over /etc/mosquitto)"
    for tool in ("unshare", "mount", "ip", "setpriv", "openssl", "mosquitto_passwd", "dpkg-query", "nft", "prlimit"):
        if shutil.which(tool) is None:
            return "%s is not installed" % tool
    if not os.path.exists("/usr/sbin/mosquitto") or not os.path.exists("/etc/mosquitto/mosquitto.conf"):
        return "Debian's mosquitto package is not installed (apt-get install mosquitto)"
    r = subprocess.run(["unshare", "--mount", "--net", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return "unshare --mount --net is not permitted here: %s" % r.stderr.strip()
    return ""
