"""A real mosquitto on a free loopback port, for every test that needs a broker.

    from tests.broker import needs_mosquitto, start_mosquitto
    b = start_mosquitto(tmp_path)               # .port, .stop(), .restart(), .log_text()
    b = start_mosquitto(tmp_path, persistent=True, conf_extra="max_queued_messages 10000")

``restart()`` keeps the port (clients reconnect to the same address). With
``persistent=True`` the broker saves sessions and queued QoS 1 messages to
``tmpdir`` every ``autosave_interval`` seconds (1; 0 = only on a clean
stop) and reloads them on restart, like a production broker. ``kill()``
is ``kill -9``: nothing saved since the last autosave survives.
Tests using it are skipped, with the reason, only when mosquitto is not
installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Any, Optional

import pytest


def mosquitto_path() -> Optional[str]:
    for p in (shutil.which("mosquitto"), "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if p and os.path.exists(p):
            return p
    return None


needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None,
                                     reason="mosquitto is not installed (.ci/run installs it)")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Mosquitto:
    """One mosquitto process; see the module docstring."""

    def __init__(self, tmpdir: Any, port: Optional[int] = None, conf_extra: str = "",
                 persistent: bool = False, autosave_interval: int = 1) -> None:
        self.tmpdir = str(tmpdir)
        self.port = port or free_port()
        self.conf_extra = conf_extra
        self.persistent = persistent
        self.autosave_interval = autosave_interval
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.conf_path = os.path.join(self.tmpdir, "mosquitto-%d.conf" % self.port)
        self.log_path = os.path.join(self.tmpdir, "mosquitto-%d.log" % self.port)
        self.start()

    def _conf(self) -> str:
        lines = ["listener %d 127.0.0.1" % self.port]
        if "allow_anonymous" not in self.conf_extra and "password_file" not in self.conf_extra:
            lines.append("allow_anonymous true")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            lines.append("user root")  # otherwise mosquitto drops to 'mosquitto' and cannot write tmpdir
        if self.persistent:
            pdir = os.path.join(self.tmpdir, "mosquitto-%d-db" % self.port)
            os.makedirs(pdir, exist_ok=True)
            lines += ["persistence true", "persistence_location %s/" % pdir,
                      "autosave_interval %d" % self.autosave_interval]
        return "\n".join(lines) + "\n" + self.conf_extra + "\n"

    def start(self) -> None:
        exe = mosquitto_path()
        if exe is None:
            pytest.skip("mosquitto is not installed (.ci/run installs it)")
        with open(self.conf_path, "w") as f:
            f.write(self._conf())
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([exe, "-c", self.conf_path], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("mosquitto did not start on port %d:\n%s" % (self.port, self.log_text()[-2000:]))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL (a crash): no save on the way out."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def __enter__(self) -> "Mosquitto":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_mosquitto(tmpdir: Any, port: Optional[int] = None, conf_extra: str = "", persistent: bool = False,
                    autosave_interval: int = 1) -> Mosquitto:
    """Start mosquitto on a free (or the given) loopback port; call ``.stop()`` when done."""
    return Mosquitto(tmpdir, port, conf_extra, persistent, autosave_interval)


@pytest.fixture
def mosquitto(tmp_path: Any) -> Any:
    """A running broker for one test, stopped afterwards."""
    b = start_mosquitto(tmp_path)
    try:
        yield b
    finally:
        b.stop()
