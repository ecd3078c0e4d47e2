"""Local daemons on 127.0.0.1 (the demo's broker, the throwaway PostgreSQL, the benchmarks' and the
tests' brokers): pick a free port, wait until the daemon answers on it (or, generally, until a
condition holds), stop it.

Shared by every host package (imports nothing of the project).
"""

from __future__ import annotations

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
