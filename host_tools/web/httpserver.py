"""The dashboard's HTTP server: waitress, configured and given the one deadline it lacks.

waitress parses requests on one event-loop thread and hands only complete
requests to its worker threads, so slow clients never hold a worker; what
they can hold is a *connection slot*. Its defaults let a stranger take all
of them: 100 connections, and an inactivity timeout that a client resets
with every byte (one header line every 15 s keeps a connection forever).
The settings here:

* **connection limit sized for the host**: the process's open-file limit
  is raised to its hard limit (at most :data:`NOFILE_WANTED`) and the
  limit is that minus :data:`FD_RESERVE` for the store, logs and the
  listening socket, at most :data:`MAX_CONNECTIONS`; ``poll()`` instead of
  ``select()``, which cannot watch file descriptors above 1024.
* **request deadline** (:class:`DeadlineServer`): a request whose headers
  are not complete ``request_timeout_s`` after its first byte is dropped,
  however steadily it trickles. waitress has no such option; its periodic
  maintenance (every ``cleanup_interval`` s) is extended to enforce it.
* **idle deadline**: a connection with no request in progress is closed
  after ``idle_timeout_s`` (waitress's ``channel_timeout``).
* **no request bodies**: the dashboard serves only GET and HEAD. A body of
  :data:`MAX_BODY_BYTES` or more is refused (413) as soon as the headers
  announce it (or, chunked, once that much arrived), before it is buffered
  or spooled to a temporary file (waitress's ``max_request_body_size``); a
  smaller one stays in memory and the app refuses it too (413 on GET/HEAD,
  405 on other methods). Headers are capped at 16 KiB.

``tests/test_dashboard_holds.py`` runs 200 slow connections and a 300 MB
body against ``pansketch serve`` while a probe's ``/healthz`` is answered
within a second every time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("pansketch.serve")

NOFILE_WANTED = 8192
FD_RESERVE = 128
MAX_CONNECTIONS = 4000
MIN_CONNECTIONS = 32
REQUEST_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 15
MAX_HEADER_BYTES = 16384
MAX_BODY_BYTES = 1024  # far below waitress's inbuf_overflow (512 KiB): never a temporary file


def raise_nofile(wanted: int = NOFILE_WANTED) -> int:
    """Raise the soft open-file limit towards ``wanted`` (within the hard limit); returns the soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a container may refuse: keep what we have
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return int(soft) if soft != resource.RLIM_INFINITY else wanted


def connection_limit(nofile: int) -> int:
    """Connections to accept at once with ``nofile`` file descriptors."""
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, nofile - FD_RESERVE))


def make_server(app: Any, bind: str, port: int, threads: int, *, request_timeout_s: float = REQUEST_TIMEOUT_S,
                idle_timeout_s: int = IDLE_TIMEOUT_S, connections: int = 0,
                trusted_proxy: str | None = None) -> Any:
    """A waitress server for ``app`` with the limits above (``.run()`` blocks, ``.close()`` stops).

    ``connections`` 0: sized from the open-file limit. ``trusted_proxy``: the address of a reverse
    proxy whose ``X-Forwarded-For`` names the client (for the per-client token-failure limit)."""
    from waitress.adjustments import Adjustments
    from waitress.channel import HTTPChannel
    from waitress.server import TcpWSGIServer
    from waitress.task import ThreadedTaskDispatcher

    class DeadlineChannel(HTTPChannel):  # type: ignore[misc]
        """Remembers when the request being parsed began (its first byte)."""

        request_began = 0.0

        def received(self, data: bytes) -> bool:
            if self.request is None and data:
                self.request_began = time.monotonic()
            return bool(super().received(data))

    class DeadlineServer(TcpWSGIServer):  # type: ignore[misc]
        channel_class = DeadlineChannel

        def maintenance(self, now: float) -> None:
            super().maintenance(now)  # idle connections: channel_timeout
            mono = time.monotonic()
            for ch in list(self.active_channels.values()):
                # a request still being read (none being served on this connection) past its deadline
                if ch.request is not None and not ch.requests and mono - ch.request_began > request_timeout_s:
                    ch.will_close = True

    kw: dict[str, Any] = dict(
        host=bind, port=port, threads=threads, ident="pansketch", clear_untrusted_proxy_headers=True,
        connection_limit=connections or connection_limit(raise_nofile()), asyncore_use_poll=True,
        channel_timeout=idle_timeout_s, cleanup_interval=1, max_request_body_size=MAX_BODY_BYTES,
        max_request_header_size=MAX_HEADER_BYTES, backlog=1024)
    if trusted_proxy:
        kw.update(trusted_proxy=trusted_proxy, trusted_proxy_headers={"x-forwarded-for"})
    adj = Adjustments(**kw)
    # a name such as localhost may resolve to several addresses: the first one is served (one URL to print)
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    return DeadlineServer(app, {}, True, None, dispatcher=dispatcher, adj=adj, sockinfo=adj.listen[0])
