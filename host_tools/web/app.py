"""The dashboard as a WSGI application: fleet, item and top-k pages, quantile / heavy-hitter / distinct pages
(host_tools/web/kinds.py), a JSON API and /metrics.

Read-only by construction:

* only GET and HEAD are served; every other method gets 405 with
  ``Allow: GET, HEAD`` before anything else runs;
* the store is opened per request with :class:`pansketch.host_tools.store.sqlite.Store`
  ``readonly=True`` (SQLite ``query_only``); every value from a request
  reaches SQL only as a bound parameter (the store's queries use ``?``
  placeholders; this module writes no SQL), and items are hashed, never
  looked up;
* pages are rendered by Jinja2 with autoescaping, chart data travel as a
  JSON data block (not executed), and a strict Content-Security-Policy
  allows scripts and styles from this server only -- the vendored uPlot
  and two small files, so the pages work offline.

With a token (``pansketch serve --token``) every path, /metrics and the
static files included, needs ``Authorization: Bearer <token>`` or HTTP
basic auth with the token as password (any user name), of at least 16
characters; failed attempts are slowed per client address and logged once a
minute (host_tools/web/authlimit.py). Without a token,
a request whose ``Host`` header names anything but the addresses the
server is meant to be reached at (``allowed_hosts``: for a loopback bind
localhost, 127.0.0.1 and [::1]; otherwise the bind address and the names
given with ``--allow-host``) is refused with 421: a DNS-rebinding page
(``http://evil.example:8080/`` resolved to 127.0.0.1) cannot read the
dashboard through the visitor's browser.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import math
import mimetypes
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional
from urllib.parse import parse_qs, urlencode

from pansketch.host_tools.query import fleetview
from pansketch.host_tools import metrics
from pansketch.host_tools.output import finitejson
from pansketch.host_tools.query import core as query
from pansketch.host_tools.query import kinds as query_kinds
from pansketch.host_tools.query import series
from pansketch.host_tools.hostconfig import HostConfig
from pansketch.host_tools.query.core import QueryError, iso
from pansketch.host_tools.store.sql import SQLStore as Store
from pansketch.host_tools.store.backend import open_store
from pansketch.host_tools.web import authlimit
from pansketch.host_tools.web.errors import BadRequest
from pansketch.host_tools.web.kinds import KindPages

log = logging.getLogger("pansketch.serve")

HERE = os.path.dirname(os.path.abspath(__file__))
STATIC = os.path.join(HERE, "static")
TEMPLATES = os.path.join(HERE, "templates")

MAX_ITEMS = 12
MAX_ITEM_LEN = 1000
MAX_CANDIDATES = 200_000
MAX_LINES = 40
# devices listed on the fleet page unless ?limit= says otherwise (?offset= pages on): a grid row of 10^4
# devices was several MB of HTML and most of the page's CPU; the counts and flagged names stay fleet-wide
FLEET_PAGE_DEVICES = 200
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22")

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


class Params:
    """Query-string parameters (GET forms); everything is text until parsed here."""

    def __init__(self, qs: str) -> None:
        try:
            self.raw = parse_qs(qs, keep_blank_values=False, strict_parsing=False, max_num_fields=500)
        except ValueError as exc:
            raise BadRequest(str(exc))

    def get(self, k: str, default: Optional[str] = None) -> Optional[str]:
        v = self.raw.get(k)
        return v[-1].strip() if v else default

    def all(self, k: str) -> list[str]:
        return [x for x in self.raw.get(k, []) if x.strip()]

    def flag(self, k: str) -> bool:
        return (self.get(k) or "").lower() in ("1", "on", "true", "yes")

    def int(self, k: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
        v = self.get(k)
        if v is None or v == "":
            return default
        try:
            x = int(v, 10)
        except ValueError:
            raise BadRequest("%s: not an integer: %r" % (k, v[:40]))
        if not lo <= x <= hi:
            raise BadRequest("%s: must be in [%d, %d]" % (k, lo, hi))
        return x

    def time(self, k: str) -> Optional[float]:
        v = self.get(k)
        if not v:
            return None
        try:
            return query.parse_time(v)
        except ValueError as exc:
            raise BadRequest("%s: %s" % (k, exc))

    def confidence(self, default: float) -> float:
        v = self.get("confidence")
        if not v:
            return default
        try:
            c = float(v)
        except ValueError:
            raise BadRequest("confidence: not a number")
        if not 0.5 <= c < 1 or math.isnan(c):
            raise BadRequest("confidence must be in [0.5, 1)")
        return c

    def items(self, as_int: bool) -> list[Any]:
        vals = list(self.all("item"))
        for block in self.all("items"):
            vals += [x.strip() for x in block.splitlines() if x.strip()]
        out: list[Any] = []
        for v in vals:
            if len(v) > MAX_ITEM_LEN:
                raise BadRequest("item longer than %d characters" % MAX_ITEM_LEN)
            if as_int:
                try:
                    out.append(int(v, 10))
                except ValueError:
                    raise BadRequest("%r is not an integer (untick 'integer items')" % v[:40])
            else:
                out.append(v)
        out = list(dict.fromkeys(out))
        if len(out) > MAX_ITEMS:
            raise BadRequest("at most %d items at once" % MAX_ITEMS)
        return out

    def link(self, **over: Any) -> str:
        d = {k: list(v) for k, v in self.raw.items()}
        for k, v in over.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v if isinstance(v, list) else [str(v)]
        return urlencode([(k, x) for k, vs in d.items() for x in vs])


def _num(x: Optional[float]) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and math.isinf(x):
        return "−∞" if x < 0 else "+∞"
    if float(x).is_integer():
        return "%d" % x
    return "%.1f" % x


def _ago(t: Optional[float], now: float) -> str:
    if t is None:
        return ""
    s = int(now - t)
    sign = "in " if s < 0 else ""
    s = abs(s)
    if s < 120:
        txt = "%ds" % s
    elif s < 7200:
        txt = "%dm" % (s // 60)
    elif s < 172800:
        txt = "%dh" % (s // 3600)
    else:
        txt = "%dd" % (s // 86400)
    return sign + txt + ("" if sign else " ago")


def _pct(c: float) -> str:
    p = 100 * c
    return ("%d%%" % p) if abs(p - round(p)) < 1e-9 else ("%.1f%%" % p)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def host_name(host: str) -> str:
    """``Host`` header -> the name without the port, lower case (``[::1]:8080`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def allowed_hosts_for(bind: str, extra: Any = ()) -> list[str]:
    """The Host names to accept without a token for a server bound to ``bind``."""
    import ipaddress

    names = [bind.lower()]
    try:
        ip = ipaddress.ip_address(bind.strip("[]"))
        if ip.version == 6:
            names.append("[%s]" % ip.compressed)
        loop = ip.is_loopback
    except ValueError:
        loop = bind == "localhost"
    if loop:
        names += list(LOOPBACK_HOSTS)
    return names + [h.lower() for h in extra]



def window_length(seconds: int) -> str:
    """A window's length for a column heading: "1 h", "4 h", "15 min", "1 d" (windows of different lengths
    can start at the same time, and their columns would otherwise carry the same heading)."""
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n and seconds % n == 0:
            return "%d %s" % (seconds // n, unit)
    return "%d s" % seconds

_DICT_ATTRS = frozenset(dir(dict))


def _environment(jinja2: Any, **kw: Any) -> Any:
    """A jinja2 Environment whose ``x.name`` on a plain dict (what every page is drawn from) reads its key
    at once. Jinja tries the attribute first and the key after its AttributeError; a plain dict has no
    attributes but dict's own, so for any other name the answer is the same, without the exception: that
    was a third of the fleet page's rendering (about 40000 lookups for 200 devices)."""

    class Environment(jinja2.Environment):  # type: ignore[misc, name-defined]
        def getattr(self, obj: Any, attribute: str) -> Any:
            if type(obj) is dict and attribute not in _DICT_ATTRS:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

    return Environment(**kw)


def _bytecode_cache(jinja2: Any) -> Any:
    """The templates compiled once per user and template text (jinja2's own cache): a fresh server process
    loads them instead of compiling them again, as Python its modules' bytecode (compiling fleet.html was
    22 ms of the first fleet page). Kept in ``templates`` under systemd's ``$CACHE_DIRECTORY`` when the
    unit sets one (deploy/systemd/pansketch-dashboard.service: its private /tmp is new at every start),
    else in a directory of this user's alone under the system's temporary one (which jinja2 checks).
    None when no such directory can be had: each process compiles, as before."""

    class Cache(jinja2.FileSystemBytecodeCache):  # type: ignore[misc, name-defined]
        def dump_bytecode(self, bucket: Any) -> None:
            try:
                super().dump_bytecode(bucket)
            except OSError:  # not written (the directory went away, a full disk): compiled again next time
                pass

    where = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]  # systemd: one path per CacheDirectory= entry
    try:
        if where:
            os.makedirs(os.path.join(where, "templates"), mode=0o700, exist_ok=True)
            return Cache(os.path.join(where, "templates"))
        return Cache()
    except (OSError, RuntimeError) as exc:  # RuntimeError: jinja2 found the directory unsafe (not this user's)
        log.info("templates compiled in each process: no bytecode cache (%s)", exc)
        return None


class Dashboard(KindPages):
    """WSGI app over the store of ``cfg``; see the module docstring."""

    def __init__(self, cfg: HostConfig, token: Optional[str] = None, candidates: Optional[list[Any]] = None,
                 candidates_name: Optional[str] = None, int_items: bool = False,
                 allowed_hosts: Optional[Any] = None) -> None:
        import jinja2

        # without a token: the Host names a request may carry (None: the loopback names)
        self.allowed_hosts = frozenset(h.lower() for h in (allowed_hosts if allowed_hosts is not None
                                                            else LOOPBACK_HOSTS))
        self.cfg = cfg
        self.db = cfg.aggregator.db
        self.salt = cfg.fleet.salt
        self.delta = cfg.query.delta
        self.confidence = cfg.query.confidence
        if token and len(token) < authlimit.MIN_TOKEN_CHARS:
            raise ValueError("the token must have at least %d characters (e.g. head -c 32 /dev/urandom | base64)"
                             % authlimit.MIN_TOKEN_CHARS)
        self.token = token or None
        self.auth_failures = authlimit.FailureLimit()
        self.candidates = candidates
        self.candidates_name = candidates_name
        self.int_items = int_items
        self.env = _environment(jinja2, loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                                undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                                bytecode_cache=_bytecode_cache(jinja2))
        self.env.filters.update(num=_num, iso=iso, pct=_pct, window_length=window_length)
        self.registry: Any = None
        self.routes: dict[str, Callable[[Params], tuple[str, list[tuple[str, str]], bytes]]] = {
            "/": self.page_fleet, "/api/status": self.api_status, "/metrics": self.metrics, "/healthz": self.healthz,
        }
        for kind in query_kinds.KINDS:  # each query kind's page and JSON endpoint (pansketch.host_tools.query.kinds)
            for path in (kind.page, kind.api):
                if path:
                    self.routes[path] = getattr(self, kind.handler(path))
        self.env.globals["nav"] = [{"href": k.page, "label": k.nav[0], "title": k.nav[1], "hint": k.hint}
                                   for k in query_kinds.KINDS if k.page and k.nav]

    # -- WSGI ------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        if method not in ("GET", "HEAD"):
            return self._send(start_response, method, "405 Method Not Allowed",
                              [("Allow", "GET, HEAD"), ("Content-Type", "text/plain; charset=utf-8")],
                              b"read-only: only GET and HEAD are served\n")
        if environ.get("CONTENT_LENGTH") not in (None, "", "0"):  # GET and HEAD carry no body here
            return self._send(start_response, method, "413 Content Too Large",
                              [("Content-Type", "text/plain; charset=utf-8")],
                              b"GET and HEAD take no request body\n")
        if self.token is None and not self._host_allowed(environ.get("HTTP_HOST")):
            return self._send(start_response, method, "421 Misdirected Request",
                              [("Content-Type", "text/plain; charset=utf-8")],
                              b"unexpected Host header (this server answers only to its own address; "
                              b"see pansketch serve --allow-host)\n")
        if self.token is not None:
            addr = str(environ.get("REMOTE_ADDR") or "-")
            if self.auth_failures.blocked(addr):  # too many failures from there: not even checked
                return self._send(start_response, method, "429 Too Many Requests",
                                  [("Retry-After", str(self.auth_failures.retry_after(addr))),
                                   ("Content-Type", "text/plain; charset=utf-8")],
                                  b"too many failed token attempts from this address; try again later\n")
            if not self._authorized(environ.get("HTTP_AUTHORIZATION", "")):
                if environ.get("HTTP_AUTHORIZATION"):  # a browser's first request carries none: no attempt
                    self.auth_failures.failed(addr)
                return self._send(start_response, method, "401 Unauthorized",
                                  [("WWW-Authenticate", 'Basic realm="pansketch", charset="UTF-8"'),
                                   ("Content-Type", "text/plain; charset=utf-8")], b"authentication required\n")
        path = environ.get("PATH_INFO") or "/"
        if path.startswith("/static/"):
            return self._static(start_response, method, path[len("/static/"):])
        handler = self.routes.get(path)
        if handler is None:
            return self._send(start_response, method, "404 Not Found", [("Content-Type", "text/html; charset=utf-8")],
                              self._render("error.html", title="not found", status=404,
                                           message="no page at %s" % path[:200]))
        api = path.startswith("/api/")
        try:
            params = Params(environ.get("QUERY_STRING", ""))
            status, headers, body = handler(params)
        except BadRequest as exc:
            status, headers, body = self._error(400, str(exc), api)
        except QueryError as exc:
            status, headers, body = self._error(404 if "no releases" in str(exc) else 422, str(exc), api)
        except FileNotFoundError as exc:
            status, headers, body = self._error(503, str(exc), api)
        except Exception:
            log.exception("request %s failed", path)
            status, headers, body = self._error(500, "internal error (see the server log)", api)
        return self._send(start_response, method, status, headers, body)

    def _send(self, start_response: Any, method: str, status: str, headers: list[tuple[str, str]],
              body: bytes) -> list[bytes]:
        h = list(headers) + [("Content-Length", str(len(body))), ("X-Content-Type-Options", "nosniff"),
                             ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY")]
        if not any(k == "Cache-Control" for k, _ in h):
            h.append(("Cache-Control", "no-store"))
        if any(k == "Content-Type" and v.startswith("text/html") for k, v in h):
            h.append(("Content-Security-Policy", CSP))
        start_response(status, h)
        return [b""] if method == "HEAD" else [body]

    def _host_allowed(self, host: Optional[str]) -> bool:
        """The Host header without its port is one of :attr:`allowed_hosts` (no header: allowed; browsers
        always send one, so a rebinding page cannot leave it out)."""
        if host is None:
            return True
        return host_name(host) in self.allowed_hosts

    def _authorized(self, header: str) -> bool:
        assert self.token is not None
        want = self.token.encode("utf-8")
        scheme, _, value = header.partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer":
            got = value.strip().encode("utf-8")
        elif scheme == "basic":
            try:
                got = base64.b64decode(value.strip(), validate=True).partition(b":")[2]
            except (ValueError, TypeError):
                return False
        else:
            return False
        return hmac.compare_digest(got, want)

    def _static(self, start_response: Any, method: str, rel: str) -> list[bytes]:
        full = os.path.realpath(os.path.join(STATIC, rel))
        if not full.startswith(os.path.realpath(STATIC) + os.sep) or not os.path.isfile(full):
            return self._send(start_response, method, "404 Not Found", [("Content-Type", "text/plain")], b"not found\n")
        with open(full, "rb") as f:
            body = f.read()
        ctype = mimetypes.guess_type(full)[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        return self._send(start_response, method, "200 OK",
                          [("Content-Type", ctype), ("Cache-Control", "public, max-age=3600")], body)

    # -- helpers ----------------------------------------------------------
    def _render(self, name: str, **ctx: Any) -> bytes:
        ctx.setdefault("now", time.time())
        ctx.setdefault("refresh", None)
        ctx.setdefault("db", self.db)
        ctx.setdefault("ago", lambda t: _ago(t, ctx["now"]))
        ctx.setdefault("influence_flags", [])
        return self.env.get_template(name).render(**ctx).encode("utf-8")

    def _html(self, name: str, **ctx: Any) -> tuple[str, list[tuple[str, str]], bytes]:
        if "influence_flags" not in ctx:  # the fleet page lists them per device instead
            ctx["influence_flags"] = self._influence_flags() if name not in ("fleet.html", "error.html") else []
        return "200 OK", [("Content-Type", "text/html; charset=utf-8")], self._render(name, **ctx)

    def _influence_flags(self) -> list[dict[str, Any]]:
        """Flagged device-windows of the recent windows (excluded devices left out), shown next to every
        answer page: those answers merge the flagged releases unless the device is excluded. Computed
        once per store state (pansketch.host_tools.query.influence.cached_flags)."""
        from pansketch.host_tools.query import influence

        try:
            with self._store() as st:
                return [f.to_dict() for f in influence.cached_flags(st)]
        except Exception:  # the page itself reports a store that cannot be read
            return []

    @staticmethod
    def _json(obj: Any, status: str = "200 OK") -> tuple[str, list[tuple[str, str]], bytes]:
        # a noisy sketch can honestly give NaN or an infinite bound: null plus a reason, never
        # non-JSON (allow_nan=False then only guards against a new kind of value)
        body = json.dumps(finitejson.finite(obj), ensure_ascii=False, allow_nan=False, default=str).encode("utf-8")
        return status, [("Content-Type", "application/json; charset=utf-8")], body

    def _error(self, code: int, msg: str, api: bool) -> tuple[str, list[tuple[str, str]], bytes]:
        reason = {400: "Bad Request", 404: "Not Found", 422: "Unprocessable Entity", 500: "Internal Server Error",
                  503: "Service Unavailable"}[code]
        status = "%d %s" % (code, reason)
        if api:
            return self._json({"error": msg, "status": code}, status)
        return status, [("Content-Type", "text/html; charset=utf-8")], self._render(
            "error.html", title=reason.lower(), status=code, message=msg)

    @contextmanager
    def _store(self) -> Iterator[Store]:
        st = open_store(self.db, readonly=True)
        try:
            yield st
        finally:
            st.close()

    def _salt(self) -> str:
        if not self.salt:
            raise BadRequest("the host config has no [fleet] salt: item queries need it (salt_id alone cannot hash)")
        return self.salt

    def _devices(self, st: Store) -> list[str]:
        """Devices the item and top-k pages can answer: kinds with item counts (cs, cms), with releases."""
        return [r[0] for r in st.devices() if r[3] in query.POINT_KINDS]  # a device row: it has releases

    def _selection(self, p: Params) -> dict[str, Any]:
        window = p.int("window", None, 0, 1 << 40)
        since, until = p.time("since"), p.time("until")
        if window is not None and (since is not None or until is not None):
            raise BadRequest("give either a window id or a time range, not both")
        devs = p.all("device")
        return {"window": window, "since": since, "until": until, "device": devs or None}

    # -- fleet --------------------------------------------------------------
    def _fleet(self, p: Params, page: Optional[int] = None) -> dict[str, Any]:
        """``page``: the devices listed when no ``limit`` is given (None: all of them)."""
        windows = p.int("windows", 12, 1, 500)
        offset = p.int("offset", 0, 0, 1 << 40) or 0
        limit = p.int("limit", page, 1, 1 << 20)
        with self._store() as st:
            return fleetview.fleet(st, self.delta, time.time(), windows or 12,
                                   late_grace_s=self.cfg.status.late_grace_s,
                                   max_seq_jump=self.cfg.aggregator.max_seq_jump, offset=offset, limit=limit)

    def page_fleet(self, p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        try:
            f = self._fleet(p, FLEET_PAGE_DEVICES)
        except FileNotFoundError as exc:
            return self._html("empty.html", title="fleet", message=str(exc))
        shown = [k for k in fleetview.DELIVERY if f["delivery_reported"][k]]
        return self._html("fleet.html", title="fleet", f=f, shown_delivery=shown,
                          refresh=p.int("refresh", None, 5, 86400))

    def api_status(self, p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        return self._json(self._fleet(p))

    # -- item series --------------------------------------------------------
    def _series(self, p: Params) -> tuple[Optional[series.Series], dict[str, Any]]:
        as_int = p.flag("int") or (self.int_items and p.get("int") is None)
        items = p.items(as_int)
        conf = p.confidence(self.confidence)
        since, until = p.time("since"), p.time("until")
        devs = p.all("device")
        per_device = p.flag("per_device")
        step = p.int("step", None, 1, 10 * 366 * 86400)
        limit = p.int("buckets", 500, 1, series.MAX_BUCKETS)
        form = {"items": items, "device": devs, "per_device": per_device, "since": p.get("since") or "",
                "until": p.get("until") or "", "step": step or "", "confidence": conf, "int": as_int,
                "buckets": limit}
        if not items:
            return None, form
        with self._store() as st:
            s = series.series(st, items, salt=self._salt(), since=since, until=until, device=devs or None,
                              per_device=per_device, step=step, confidence=conf, limit=limit or 500)
        if len(s.lines) > MAX_LINES:
            raise BadRequest("%d lines (items x devices): at most %d; pick fewer items or devices"
                             % (len(s.lines), MAX_LINES))
        return s, form

    @staticmethod
    def _chart(s: series.Series) -> dict[str, Any]:
        xs = [p.t0 for p in s.lines[0].points] if s.lines else []  # bucket starts, as the table says
        lines = []
        for i, ln in enumerate(s.lines):
            est, lo, hi, zero = [], [], [], []
            for p in ln.points:
                a = p.answer
                fin = a is not None and math.isfinite(a.lo) and math.isfinite(a.hi)
                est.append(a.estimate if a is not None else None)
                lo.append(a.lo if a is not None and fin else None)
                hi.append(a.hi if a is not None and fin else None)
                zero.append(a.estimate if a is not None and p.includes_zero else None)
            lines.append({"label": ln.label, "color": PALETTE[i % len(PALETTE)], "est": est, "lo": lo, "hi": hi,
                          "zero": zero})
        partial = [any(ln.points[k].missing_devices for ln in s.lines) for k in range(len(xs))]
        return {"x": xs, "lines": lines, "confidence": s.confidence, "step": s.step, "partial": partial}

    def page_item(self, p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        try:
            with self._store() as st:
                known = self._devices(st)
                if not known:  # nothing this page can draw: say what the store holds (not a 404)
                    query.pick_devices(st, query.POINT_KINDS)
        except (FileNotFoundError, QueryError) as exc:
            return self._html("empty.html", title="item", message=str(exc))
        s, form = self._series(p)
        rows = []
        if s is not None:
            for i, ln in enumerate(s.lines):
                for pt in ln.points:
                    rows.append({"line": ln, "color": PALETTE[i % len(PALETTE)], "p": pt})
        return self._html("item.html", title="item", s=s, form=form, known=known, rows=rows,
                          chart=self._chart(s) if s is not None else None, params=p)

    @staticmethod
    def _device_page(p: Params) -> tuple[int, Optional[int]]:
        """The page of each answer's contributing devices in the JSON API: ``devices_offset``,
        ``devices_limit`` (default pansketch.host_tools.query.core.DEVICES_LIMIT), ``all_devices=1`` for every
        one (pansketch.host_tools.query.devicepage: the same as the CLI's --json)."""
        if p.flag("all_devices"):
            return 0, None
        return (p.int("devices_offset", 0, 0, 1 << 40) or 0,
                p.int("devices_limit", query.DEVICES_LIMIT, 0, 1 << 40))

    def api_series(self, p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        s, _form = self._series(p)
        if s is None:
            raise BadRequest("give at least one item= parameter")
        return self._json(s.to_dict(*self._device_page(p)))

    def api_freq(self, p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        as_int = p.flag("int") or (self.int_items and p.get("int") is None)
        items = p.items(as_int)
        if not items:
            raise BadRequest("give at least one item= parameter")
        sel = self._selection(p)
        with self._store() as st:
            ans = query.freq(st, items, salt=self._salt(), confidence=p.confidence(self.confidence), **sel)
        page = self._device_page(p)
        return self._json({"answers": [a.to_dict(*page) for a in ans]})

    # -- top-k ----------------------------------------------------------------
    def _candidates(self, p: Params, as_int: bool) -> tuple[Optional[list[Any]], str]:
        block = "\n".join(p.all("candidates"))
        if block:
            cands: list[int | str] = []
            for line in block.splitlines():
                x = line.split("\t", 1)[0].strip()
                if not x:
                    continue
                if as_int:
                    try:
                        cands.append(int(x, 10))
                    except ValueError:
                        raise BadRequest("candidate %r is not an integer" % x[:40])
                else:
                    cands.append(x)
                if len(cands) > MAX_CANDIDATES:
                    raise BadRequest("at most %d candidates" % MAX_CANDIDATES)
            return cands, "the %d candidates given" % len(cands)
        if self.candidates is not None:
            return self.candidates, "%d candidates from %s" % (len(self.candidates), self.candidates_name or "the server")
        return None, ""

    def _topk(self, p: Params) -> tuple[Optional[list[query.Answer]], dict[str, Any]]:
        as_int = p.flag("int") or (self.int_items and p.get("int") is None)
        k = p.int("k", 10, 1, 1000) or 10
        conf = p.confidence(self.confidence)
        sel = self._selection(p)
        cands, source = self._candidates(p, as_int)
        form = {"k": k, "confidence": conf, "window": p.get("window") or "", "since": p.get("since") or "",
                "until": p.get("until") or "", "device": p.all("device"), "int": as_int, "source": source,
                "server_candidates": self.candidates is not None, "candidates": "\n".join(p.all("candidates"))}
        if cands is None:
            return None, form
        with self._store() as st:
            ans = query.topk(st, cands, k, salt=self._salt(), confidence=conf, **sel)
        return ans, form

    @staticmethod
    def _bars(ans: list[query.Answer]) -> dict[str, Any]:
        """Geometry of the horizontal bar chart (SVG drawn by the template): bar = estimate, whisker = interval."""
        fin = [x for a in ans for x in (a.lo, a.hi, a.estimate, 0.0) if math.isfinite(x)]
        lo, hi = min(fin), max(fin)
        if hi <= lo:
            hi = lo + 1
        left, width, row = 260, 560, 24

        def sx(v: float) -> float:
            v = min(max(v, lo), hi)
            return round(left + (v - lo) / (hi - lo) * width, 1)

        bars = []
        for i, a in enumerate(ans):
            y = 10 + i * row
            x0, xe = sx(0.0), sx(a.estimate)
            bars.append({"y": y, "x": min(x0, xe), "w": max(1.0, abs(xe - x0)), "lo": sx(a.lo), "hi": sx(a.hi),
                         "est": xe, "item": str(a.item), "zero": a.lo <= 0 <= a.hi,
                         "lo_inf": not math.isfinite(a.lo), "hi_inf": not math.isfinite(a.hi)})
        ticks = []
        step = 10 ** math.floor(math.log10(max(1e-9, (hi - lo) / 4)))
        for m in (1, 2, 5, 10):
            if (hi - lo) / (step * m) <= 6:
                step *= m
                break
        t = math.ceil(lo / step) * step
        while t <= hi:
            ticks.append({"x": sx(t), "label": _num(t)})
            t += step
        return {"bars": bars, "ticks": ticks, "zero": sx(0.0), "height": 20 + len(ans) * row, "left": left,
                "right": left + width, "width": left + width + 20}

    def page_topk(self, p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        try:
            with self._store() as st:
                known = self._devices(st)
        except FileNotFoundError as exc:
            return self._html("empty.html", title="top-k", message=str(exc))
        ans, form = self._topk(p)
        compare = None
        if ans:
            compare = urlencode([("item", str(a.item)) for a in ans[:5]] + [("device", d) for d in form["device"]]
                                + ([("int", "1")] if form["int"] else []))
        return self._html("topk.html", title="top-k", ans=ans, form=form, known=known,
                          chart=self._bars(ans) if ans else None, compare=compare)

    def api_topk(self, p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        ans, form = self._topk(p)
        if ans is None:
            raise BadRequest("no candidates: give candidates=... (one per line) or start serve with --candidates FILE")
        page = self._device_page(p)
        return self._json({"candidates": form["source"], "answers": [a.to_dict(*page) for a in ans]})

    # -- metrics and health ---------------------------------------------------
    def metrics(self, _p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        from prometheus_client import generate_latest

        if self.registry is None:
            self.registry = metrics.store_registry(self.db, self.delta, self.cfg.status.late_grace_s, self.salt or None)
        return "200 OK", [("Content-Type", metrics.CONTENT_TYPE)], generate_latest(self.registry)

    def healthz(self, _p: Params) -> tuple[str, list[tuple[str, str]], bytes]:
        ok = os.path.exists(self.db)
        return self._json({"ok": ok, "db": self.db}, "200 OK" if ok else "503 Service Unavailable")
