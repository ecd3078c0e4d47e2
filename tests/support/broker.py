"""A real mosquitto on a free loopback port, for every test that needs a broker.

    from tests.support.broker import needs_mosquitto, start_mosquitto
    b = start_mosquitto(tmp_path)               # .port, .stop(), .restart(), .log_text()
    b = start_mosquitto(tmp_path, persistent=True, conf_extra="max_queued_messages 10000")

    b = start_mosquitto(tmp_path, tls=make_test_pki(tmp_path / "pki"))   # + .tls_port (TLS 1.2+)

The broker is pansketch.host_tools.localnet.Mosquitto, the launcher the demo and
the benchmarks use too (its docstring: ``restart()`` keeps the port,
``persistent=True`` saves sessions and queued messages, ``kill()`` is
``kill -9``). Tests using it are skipped, with the reason, only when
mosquitto is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Optional

import pytest

from pansketch.host_tools import localnet
from pansketch.host_tools.localnet import free_port, mosquitto_path  # noqa: F401  (re-exported for the tests)

needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None,
                                     reason="mosquitto is not installed (.ci/run installs it)")


class Mosquitto(localnet.Mosquitto):
    """pansketch.host_tools.localnet.Mosquitto (the one launcher: demo, benchmarks, tests); a test whose broker
    cannot start because mosquitto is not installed is skipped, with the reason, also on restart."""

    def start(self) -> None:
        if mosquitto_path() is None:
            pytest.skip("mosquitto is not installed (.ci/run installs it)")
        super().start()


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
