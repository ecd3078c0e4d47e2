"""A real mosquitto on a free loopback port, for every test that needs a broker.

    from tests.broker import needs_mosquitto, start_mosquitto
    b = start_mosquitto(tmp_path)               # .port, .stop(), .restart(), .log_text()
    b = start_mosquitto(tmp_path, persistent=True, conf_extra="max_queued_messages 10000")

    b = start_mosquitto(tmp_path, tls=make_test_pki(tmp_path / "pki"))   # + .tls_port (TLS 1.2+)

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
import subprocess
from typing import Any, Optional

import pytest

from host_tools.localnet import free_port, stop_process, wait_port  # noqa: F401  (free_port: re-exported)


def mosquitto_path() -> Optional[str]:
    for p in (shutil.which("mosquitto"), "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if p and os.path.exists(p):
            return p
    return None


needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None,
                                     reason="mosquitto is not installed (.ci/run installs it)")


class Mosquitto:
    """One mosquitto process; see the module docstring."""

    def __init__(self, tmpdir: Any, port: Optional[int] = None, conf_extra: str = "",
                 persistent: bool = False, autosave_interval: int = 1, tls: Optional[dict[str, Any]] = None) -> None:
        self.tmpdir = str(tmpdir)
        self.port = port or free_port()
        # tls: a second listener on 127.0.0.1:tls_port (cafile/certfile/keyfile, e.g. from make_test_pki;
        # require_certificate: clients must present a certificate from cafile)
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
        tls = []
        if self.tls and self.tls_port is not None:  # tls_port is set with tls
            tls = ["listener %d 127.0.0.1" % self.tls_port, "cafile %s" % self.tls["cafile"],
                   "certfile %s" % self.tls["certfile"], "keyfile %s" % self.tls["keyfile"], "tls_version tlsv1.2"]
            if self.tls.get("require_certificate"):
                tls.append("require_certificate true")
        return "\n".join(lines) + "\n" + self.conf_extra + "\n" + "\n".join(tls) + "\n"

    def start(self) -> None:
        exe = mosquitto_path()
        if exe is None:
            pytest.skip("mosquitto is not installed (.ci/run installs it)")
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


def start_mosquitto(tmpdir: Any, port: Optional[int] = None, conf_extra: str = "", persistent: bool = False,
                    autosave_interval: int = 1, tls: Optional[dict[str, Any]] = None) -> Mosquitto:
    """Start mosquitto on a free (or the given) loopback port; call ``.stop()`` when done."""
    return Mosquitto(tmpdir, port, conf_extra, persistent, autosave_interval, tls)


def make_test_pki(d: Any, server_name: str = "localhost", clients: tuple[str, ...] = ()) -> dict[str, Any]:
    """A throwaway fleet CA (EC P-256, openssl), a server certificate for ``server_name`` and one client
    certificate per name in ``clients``; DER copies (``*.der``) for the MicroPython firmware. Returns the
    paths (``cafile``, ``certfile``, ``keyfile``: a ``tls=`` for :func:`start_mosquitto`; ``ca_der``;
    ``clients``: name -> (cert.der, key.der)). Skips the test when openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    d = str(d)
    os.makedirs(d, exist_ok=True)

    def ossl(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ossl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=pansketch test CA")
    ossl("x509", "-in", "ca.crt", "-outform", "der", "-out", "ca.der")
    out: dict[str, Any] = {"dir": d, "cafile": os.path.join(d, "ca.crt"), "ca_der": os.path.join(d, "ca.der"),
                           "certfile": os.path.join(d, "server.crt"), "keyfile": os.path.join(d, "server.key"),
                           "clients": {}}
    for name, ext in [(server_name, "subjectAltName=DNS:%s\n" % server_name)] + [(c, "") for c in clients]:
        base = "server" if name == server_name and ext else "client-" + name
        ossl("req", *ec, "-keyout", base + ".key", "-out", base + ".csr", "-subj", "/CN=" + name)
        with open(os.path.join(d, base + ".ext"), "w") as f:
            f.write(ext or "extendedKeyUsage=clientAuth\n")
        ossl("x509", "-req", "-in", base + ".csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             base + ".crt", "-days", "2", "-extfile", base + ".ext")
        if base != "server":
            ossl("x509", "-in", base + ".crt", "-outform", "der", "-out", base + ".crt.der")
            ossl("pkey", "-in", base + ".key", "-outform", "der", "-out", base + ".key.der")
            out["clients"][name] = (os.path.join(d, base + ".crt.der"), os.path.join(d, base + ".key.der"))
    return out


@pytest.fixture
def mosquitto(tmp_path: Any) -> Any:
    """A running broker for one test, stopped afterwards."""
    b = start_mosquitto(tmp_path)
    try:
        yield b
    finally:
        b.stop()
