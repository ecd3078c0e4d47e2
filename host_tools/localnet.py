"""Local daemons on 127.0.0.1 (the demo's broker, the throwaway PostgreSQL, the benchmarks' and the
tests' brokers): pick a free port, wait until the daemon answers on it.

Shared by every host package (imports nothing of the project).
"""

from __future__ import annotations

import socket
import time
from typing import Callable, Optional

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick; a daemon binds it next)."""
    s = socket.socket()
    try:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
    finally:
        s.close()


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
