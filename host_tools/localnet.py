"""Local daemons on 127.0.0.1 (the demo's broker, the throwaway PostgreSQL, the benchmarks' and the
tests' brokers): pick a free port, wait until the daemon answers on it (or, generally, until a
condition holds), stop it; and the one mosquitto launcher (:class:`Mosquitto`) the demo, the
benchmarks and the tests start their brokers with.

Shared by every host package (imports nothing of the project).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Any, Callable, Optional

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick; a daemon binds it next)."""
    s = socket.socket()
    try:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
    finally:
        s.close()


def stop_process(proc: Optional[subprocess.Popen[Any]], timeout: float = 10.0) -> None:
    """SIGTERM ``proc`` (if it still runs) and wait ``timeout`` s for it to exit; SIGKILL it if it does not."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def stop_processes(procs: list[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    """:func:`stop_process` for several at once: SIGTERM all of them first, so that they shut down side by
    side, then wait for each (SIGKILL what has not exited ``timeout`` s after its signal)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def wait_until(pred: Callable[[], Any], timeout: float = 20.0, every: float = 0.05) -> bool:
    """Poll ``pred`` every ``every`` seconds until it is true (True) or ``timeout`` seconds have passed
    (then its last value, as a bool)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return bool(pred())


def wait_port(port: int, timeout: float = 10.0, alive: Optional[Callable[[], bool]] = None,
              poll: float = 0.02) -> bool:
    """Whether a TCP connection to 127.0.0.1:``port`` succeeds within ``timeout`` seconds.

    ``alive`` (e.g. ``lambda: proc.poll() is None``) ends the wait early, False, once the daemon has died.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        try:
            socket.create_connection((HOST, port), 0.2).close()
            return True
        except OSError:
            time.sleep(poll)
    return False


MOSQUITTO_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")


def mosquitto_path() -> Optional[str]:
    """The mosquitto executable: on PATH, or where Debian, a source build or Homebrew put it; None if none."""
    for p in (shutil.which("mosquitto"),) + MOSQUITTO_PATHS:
        if p and os.path.exists(p):
            return p
    return None


class Mosquitto:
    """One mosquitto process on 127.0.0.1:``port`` (a free one unless given), started at construction.

    Its config is a listener, anonymous clients (unless ``conf_extra`` sets
    ``allow_anonymous`` or a ``password_file``), ``user root`` when run as
    root (mosquitto would otherwise drop to the user ``mosquitto``, who
    cannot write ``tmpdir``), then ``conf_extra`` (the caller's limits and
    log types). ``persistent``: sessions and queued QoS 1 messages saved to
    ``tmpdir`` every ``autosave_interval`` seconds (0: only on a clean stop)
    and reloaded by :meth:`restart`, like a production broker. ``tls``: a
    second listener on ``tls_port`` (``cafile``, ``certfile``, ``keyfile``;
    ``require_certificate``: clients must present one from ``cafile``),
    TLS 1.2 and up. Config and log (appended to across restarts) are
    ``mosquitto-<port>.conf`` and ``.log`` in ``tmpdir``.
    :meth:`restart` keeps the port (clients reconnect to the same address);
    :meth:`kill` is ``kill -9`` (nothing saved since the last autosave
    survives). Raises FileNotFoundError when mosquitto is not installed,
    RuntimeError (with the log's tail) when it does not start.
    """

    def __init__(self, tmpdir: Any, port: Optional[int] = None, conf_extra: str = "",
                 persistent: bool = False, autosave_interval: int = 1, tls: Optional[dict[str, Any]] = None) -> None:
        self.tmpdir = str(tmpdir)
        self.port = port or free_port()
        self.tls = tls
        self.tls_port = free_port() if tls else None
        self.conf_extra = conf_extra
        self.persistent = persistent
        self.autosave_interval = autosave_interval
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.conf_path = os.path.join(self.tmpdir, "mosquitto-%d.conf" % self.port)
        self.log_path = os.path.join(self.tmpdir, "mosquitto-%d.log" % self.port)
        self.start()

    def _conf(self) -> str:
        lines = ["listener %d %s" % (self.port, HOST)]
        if "allow_anonymous" not in self.conf_extra and "password_file" not in self.conf_extra:
            lines.append("allow_anonymous true")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            lines.append("user root")
        if self.persistent:
            pdir = os.path.join(self.tmpdir, "mosquitto-%d-db" % self.port)
            os.makedirs(pdir, exist_ok=True)
            lines += ["persistence true", "persistence_location %s/" % pdir,
                      "autosave_interval %d" % self.autosave_interval]
        tls = []
        if self.tls and self.tls_port is not None:  # after conf_extra: these options belong to this listener
            tls = ["listener %d %s" % (self.tls_port, HOST), "cafile %s" % self.tls["cafile"],
                   "certfile %s" % self.tls["certfile"], "keyfile %s" % self.tls["keyfile"], "tls_version tlsv1.2"]
            if self.tls.get("require_certificate"):
                tls.append("require_certificate true")
        return "\n".join(lines) + "\n" + self.conf_extra + "\n" + "\n".join(tls) + "\n"

    def start(self) -> None:
        exe = mosquitto_path()
        if exe is None:
            raise FileNotFoundError("mosquitto is not installed (apt-get install mosquitto)")
        with open(self.conf_path, "w") as f:
            f.write(self._conf())
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([exe, "-c", self.conf_path], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        proc = self.proc
        if all(wait_port(p, 10, lambda: proc.poll() is None) for p in (self.port, self.tls_port) if p):
            return
        self.stop()
        raise RuntimeError("mosquitto did not start on port %d:\n%s" % (self.port, self.log_text()[-2000:]))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        stop_process(self.proc)
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


def publish(port: int, msgs: list[tuple[str, bytes]], client_id: str, timeout: float = 60.0) -> None:
    """Publish ``(topic, payload)`` pairs at QoS 1 to the broker on 127.0.0.1:``port`` and return once
    the broker has acknowledged every one (acknowledged, not stored: what the host stored is the
    caller's to check). Up to 1,000 in flight; paho-mqtt, MQTT v5."""
    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect(HOST, port)
    c.loop_start()
    try:
        for info in [c.publish(t, p, qos=1) for t, p in msgs]:
            info.wait_for_publish(timeout)
    finally:
        c.disconnect()
        c.loop_stop()
