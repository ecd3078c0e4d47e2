"""``pansketch serve``: the read-only dashboard, JSON API and /metrics (host_tools/web) under waitress.

Binds 127.0.0.1 by default. Bound to any other address it refuses to
start without ``--token``/``--token-file``/``PANSKETCH_TOKEN`` (clients
then send ``Authorization: Bearer <token>`` or HTTP basic auth with the
token as password) unless ``--insecure-no-auth`` says otherwise. TLS
belongs to a reverse proxy in front (docs/HOST.md, "Dashboard").
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Any, Optional

log = logging.getLogger("pansketch.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_server(app: Any, bind: str = "127.0.0.1", port: int = 8080, threads: int = 4, **limits: Any) -> Any:
    """A waitress server for ``app`` (``.run()`` blocks, ``.close()`` stops); ``port`` 0 picks a free one.

    Connection limit, request and idle deadlines, no request bodies: host_tools/web/httpserver.py."""
    from pansketch.host_tools.web import httpserver

    return httpserver.make_server(app, bind, port, threads, **limits)


def server_url(server: Any) -> str:
    host = server.effective_host
    if ":" in str(host):
        host = "[%s]" % host
    return "http://%s:%s/" % (host, server.effective_port)


def run_until_stopped(server: Any, sigterm: bool = False) -> None:
    """Serve until Ctrl-C (with ``sigterm``, also until SIGTERM, where this is the main thread), then close."""
    import signal
    import threading

    def _term(*_a: Any) -> None:
        raise KeyboardInterrupt

    old = None
    if sigterm and threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _term)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def read_token(args: argparse.Namespace) -> Optional[str]:
    """The token from --token-file, --token or PANSKETCH_TOKEN (None: none given); ValueError if too short."""
    from pansketch.host_tools.web.authlimit import MIN_TOKEN_CHARS

    tok: Optional[str]
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            tok = f.read().strip()
        if not tok:
            raise ValueError("%s is empty" % args.token_file)
    else:
        tok = args.token or os.environ.get("PANSKETCH_TOKEN") or None
    if tok is not None and len(tok) < MIN_TOKEN_CHARS:
        raise ValueError("the token has %d characters, at least %d are needed (e.g. head -c 32 /dev/urandom | "
                         "base64)" % (len(tok), MIN_TOKEN_CHARS))
    return tok


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="read-only web dashboard, JSON API and /metrics",
                              description="Serve the fleet, item-over-time and top-k pages, a JSON API (/api/...) "
                                          "and Prometheus metrics (/metrics) over the release store, read-only "
                                          "(GET and HEAD only). TLS: put a reverse proxy in front (docs/HOST.md).")
    p.add_argument("--config", required=True, metavar="FILE", help="host config TOML")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080; 0 = any free port)")
    p.add_argument("--token", metavar="T", help="require this bearer token / basic-auth password "
                                               "(prefer --token-file or PANSKETCH_TOKEN: arguments show in ps)")
    p.add_argument("--token-file", metavar="FILE", help="read the token from FILE")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --bind without a token (only behind an authenticating proxy)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="without a token, also answer requests whose Host header is NAME (repeatable; by default "
                        "only the bind address, and localhost/127.0.0.1/[::1] for a loopback bind: DNS rebinding)")
    p.add_argument("--candidates", metavar="FILE", help="default candidate items of the top-k page (one per line)")
    p.add_argument("--int", dest="as_int", action="store_true", help="items are integers")
    p.add_argument("--threads", type=int, default=4, help="worker threads (default 4)")
    p.add_argument("--trusted-proxy", metavar="ADDR",
                   help="address of the reverse proxy in front: its X-Forwarded-For names the client (used to "
                        "limit failed token attempts per client)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.logsetup import setup_logging
    from pansketch.host_tools.web.extra import missing_web

    why = missing_web()
    if why:
        print("pansketch serve: %s" % why, file=sys.stderr)
        return 2
    cfg = hostconfig.load_for_command(args.config)
    if cfg is None:
        return 2
    try:
        token = read_token(args)
    except (OSError, ValueError) as exc:
        print("pansketch serve: token: %s" % exc, file=sys.stderr)
        return 2
    if not is_loopback(args.bind) and token is None and not args.insecure_no_auth:
        print("pansketch serve: refusing to bind %s without --token/--token-file/PANSKETCH_TOKEN "
              "(or --insecure-no-auth behind an authenticating proxy)" % args.bind, file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print("pansketch serve: --port must be in [0, 65535]", file=sys.stderr)
        return 2
    cands = None
    if args.candidates:
        from pansketch.host_tools.query import core as query

        try:
            cands = query.read_candidates(args.candidates, args.as_int)
        except (OSError, ValueError) as exc:
            print("pansketch serve: --candidates: %s" % exc, file=sys.stderr)
            return 2
    setup_logging(False)
    logging.getLogger("waitress").setLevel(logging.WARNING)
    try:
        from pansketch.host_tools.web.app import Dashboard, allowed_hosts_for

        app = Dashboard(cfg, token=token, candidates=cands, candidates_name=args.candidates, int_items=args.as_int,
                        allowed_hosts=allowed_hosts_for(args.bind, args.allow_host))
        server = make_server(app, args.bind, args.port, max(1, args.threads), trusted_proxy=args.trusted_proxy)
    except ImportError as exc:
        print("pansketch serve: %s (pip install 'pansketch[web]')" % exc, file=sys.stderr)
        return 2
    except OSError as exc:
        print("pansketch serve: cannot listen on %s:%d: %s" % (args.bind, args.port, exc), file=sys.stderr)
        return 1
    print("pansketch serve: %s (read-only: %s%s; at most %d connections)" % (
        server_url(server), cfg.aggregator.db, "; token required" if token else "", server.adj.connection_limit),
        flush=True)
    run_until_stopped(server)
    return 0
