"""``pansketch serve`` holds against strangers: slow connections, huge bodies, token guessing.

The real server (waitress as configured by host_tools/web/httpserver.py) on a loopback port:

* 200 connections that trickle one header line every 2 s (reconnecting when dropped) and one GET
  with a 300 MB body, while a probe asks ``/healthz`` twice a second: every probe is answered within
  1 s, the slow connections are dropped by the request deadline, the body is refused (413) before
  more than a few MB of it were accepted;
* failed token attempts are answered 401 a few times, then 429 without being checked, and logged
  in one or two lines, not one per attempt; the right token works again once the address has waited;
* a token shorter than 16 characters is refused at start.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import threading
import time
from typing import Any

import pytest

from pansketch.host_tools.localnet import stop_process
from pansketch.host_tools.store.sqlite import Store
from tests.support.dash import REPO, env, pansketch

pytest.importorskip("waitress")
TOKEN = "holds-test-token-0123456789"
SLOW = 200
BODY = 300 * 1024 * 1024


@pytest.fixture()
def serve(tmp_path: Any) -> Any:
    Store(str(tmp_path / "host.db")).close()
    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "host.db"\n[fleet]\nsalt = "holds-test-salt"\n')
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(pansketch("serve", "--config", str(conf), "--port", "0", "--token", TOKEN),
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env(), cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "http://" in line, line + open(tmp_path / "serve.log").read()
    port = int(line.split()[2].rstrip("/").rsplit(":", 1)[1])
    try:
        yield port, proc, tmp_path / "serve.log"
    finally:
        stop_process(proc)
        proc.stdout.close()
        log.close()


def _get(port: int, path: str, auth: str = "Bearer " + TOKEN, timeout: float = 5.0) -> tuple[int, float]:
    """(status, seconds) of one request on a new connection."""
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(("GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: %s\r\nConnection: close\r\n\r\n"
                   % (path, auth)).encode())
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split()[1]) if data.startswith(b"HTTP/") else -1, time.monotonic() - t


class SlowClients(threading.Thread):
    """``n`` connections, each sending one header line every ``every_s`` and never finishing; a dropped one
    is replaced at once (the pressure stays at n)."""

    def __init__(self, port: int, n: int, every_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.port, self.n, self.every_s = port, n, every_s
        self.stop = threading.Event()
        self.dropped = 0
        self.ages: list[float] = []  # how long each dropped connection had lived

    def _open(self, sel: selectors.BaseSelector) -> None:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, [time.monotonic(), time.monotonic()])

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        for _ in range(self.n):
            self._open(sel)
        while not self.stop.is_set():
            for key, _ev in sel.select(timeout=0.2):
                try:
                    gone = key.fileobj.recv(4096) == b""  # type: ignore[union-attr]
                except OSError:
                    gone = True
                if gone:
                    self.ages.append(time.monotonic() - key.data[0])
                    sel.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]
                    self.dropped += 1
                    self._open(sel)
            now = time.monotonic()
            for key in list(sel.get_map().values()):
                if now - key.data[1] >= self.every_s:
                    key.data[1] = now
                    try:
                        key.fileobj.send(b"X-Slow: %d\r\n" % int(now))  # type: ignore[union-attr]
                    except OSError:
                        pass
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


def _big_body(port: int, result: dict[str, Any]) -> None:
    """A GET announcing and sending a 300 MB body, as fast as the server takes it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % BODY)
    chunk = b"x" * 65536
    sent = 0
    reply = b""
    s.settimeout(5)
    try:
        while sent < BODY:
            sent += s.send(chunk)
    except OSError:  # the server closed the connection: refused
        pass
    try:
        s.settimeout(5)
        reply = s.recv(4096)
    except OSError:
        pass
    s.close()
    result.update(sent=sent, reply=reply)


def test_probes_answered_under_slow_connections_and_a_huge_body(serve: Any) -> None:
    port, proc, _log = serve
    assert _get(port, "/healthz")[0] == 200
    slow = SlowClients(port, SLOW)
    slow.start()
    big: dict[str, Any] = {}
    body = threading.Thread(target=_big_body, args=(port, big), daemon=True)
    time.sleep(3)  # all 200 open and trickling
    body.start()
    times = []
    try:
        t_end = time.monotonic() + 25  # longer than the request deadline (10 s): slow ones get dropped
        while time.monotonic() < t_end:
            status, took = _get(port, "/healthz", timeout=5)
            times.append((status, took))
            time.sleep(0.5)
    finally:
        slow.stop.set()
        slow.join(10)
        body.join(30)
    assert proc.poll() is None
    assert len(times) >= 20
    assert all(st == 200 and took < 1.0 for st, took in times), times
    # the deadline, not the client, ended them: none outlived it by more than the maintenance period
    assert slow.dropped >= SLOW, slow.dropped
    assert max(slow.ages) < 10 + 3, max(slow.ages)
    assert big["reply"].startswith(b"HTTP/1.1 413"), big
    assert big["sent"] < 32 * 1024 * 1024, big["sent"]  # refused at its headers, not after taking the body


def test_token_failures_slowed_and_logged_once(serve: Any) -> None:
    port, _proc, log = serve
    codes = [_get(port, "/healthz", auth="Bearer guess-%04d-xxxxxxxxxxxx" % i)[0] for i in range(40)]
    assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}, codes
    assert _get(port, "/healthz")[0] == 429  # the right token is not even checked from this address now
    time.sleep(2.5)
    assert _get(port, "/healthz")[0] == 200
    text = open(log).read()
    lines = [ln for ln in text.splitlines() if "failed token attempt" in ln]
    assert 1 <= len(lines) <= 2, text
    assert "127.0.0.1" in lines[0]


def test_short_tokens_refused(tmp_path: Any) -> None:
    conf = tmp_path / "host.toml"
    conf.write_text('[aggregator]\ndb = "host.db"\n[fleet]\nsalt = "holds-test-salt"\n')
    r = subprocess.run(pansketch("serve", "--config", str(conf), "--port", "0", "--token", "s3cret"),
                       capture_output=True, text=True, env=env(), cwd=REPO, timeout=30)
    assert r.returncode == 2 and "at least 16" in r.stderr, r.stderr
    tf = tmp_path / "tok"
    tf.write_text("short\n")
    r = subprocess.run(pansketch("serve", "--config", str(conf), "--port", "0", "--token-file", str(tf)),
                       capture_output=True, text=True, env=dict(env(), PANSKETCH_TOKEN=""), cwd=REPO, timeout=30)
    assert r.returncode == 2 and "at least 16" in r.stderr, r.stderr
    assert os.path.exists(tf)


def test_small_bodies_on_get_are_refused_too(serve: Any) -> None:
    port, _proc, _log = serve
    for head in (b"Content-Length: 10\r\n\r\n0123456789", b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n" % TOKEN.encode()
                      + head)
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 413"), (head, reply)
