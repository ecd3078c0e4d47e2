"""Dashboard pages for the kinds ``dcs`` (quantiles / CDF, heavy hitters) and ``dbits`` (distinct counts).

Every number comes from the functions behind ``pansketch query``
(:mod:`pansketch.host_tools.query.dyadic_cli` ``quantiles`` / ``cdf`` / ``heavy`` and
:func:`pansketch.host_tools.query.distinct.query`); the JSON endpoints return their rows
unchanged, i.e. what ``pansketch query ... --json`` prints. This module
only chooses *where* to ask (which devices, which CDF points, which
windows) and lays the answers out.

Device selection: with no ``device=`` given, a page uses every device whose
releases are of the page's kind (the store may hold several kinds, which
never merge); the answer is then the CLI's answer with those ``--device``
options (for a store of one kind: the CLI's answer without ``--device``).
A store without releases of the kind gets a page saying so (HTTP 200) and,
from the JSON endpoints, a 404 with the reason.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from types import SimpleNamespace
from typing import Any, Optional

from pansketch.host_tools.query import distinct
from pansketch.host_tools.query import dyadic_cli, strheavy_cli
from pansketch.host_tools.query.core import QueryError, iso
from pansketch.host_tools.web.errors import BadRequest

MAX_QUANTILES = 20
DEFAULT_QS = (0.5, 0.95)
DEFAULT_POINTS = 65
MAX_POINTS = 513
MAX_WINDOWS = 500
ZOOM = (0.005, 0.995)  # the CDF chart spans the readings between these estimated quantiles unless told otherwise
KIND_USE = {"dcs": "quantiles, CDF and heavy hitters need devices with kind = \"dcs\" (a dyadic CountSketch)",
            "dbits": "distinct counts need devices with kind = \"dbits\"",
            "strhh": "heavy strings need devices with kind = \"strhh\" (a prefix CountSketch)"}

Resp = tuple[str, list[tuple[str, str]], bytes]


def reading_text(x: Optional[float]) -> str:
    if x is None:
        return "…"
    return "%.10g" % x


def reading_label(rd: list[Optional[float]]) -> str:
    """[lo, hi) of a domain value's readings, or the one reading when the range holds one integer."""
    lo, hi = rd
    if lo is not None and hi is not None and float(lo).is_integer() and abs(hi - lo - 1) < 1e-9:
        return "%d" % lo
    if lo is None:  # the lowest value also holds every reading clamped into it
        return "< %s" % reading_text(hi)
    if hi is None:
        return "≥ %s" % reading_text(lo)
    return "[%s, %s)" % (reading_text(lo), reading_text(hi))


def value_reading(x: int, mapping: list[int] | tuple[int, int, int]) -> str:
    """A decimal reading that maps to domain value x (the middle of its reading range, exact enough)."""
    sn, sd, off = (int(v) for v in mapping)
    mid = Fraction(off) + (Fraction(x) + Fraction(1, 2)) * Fraction(sd, sn)
    digits = max(0, math.ceil(math.log10(max(1, 4 * sn // max(1, sd) + 1)))) + 2
    scale = 10 ** digits
    n = round(mid * scale)
    sign = "-" if n < 0 else ""
    n = abs(n)
    return "%s%d.%0*d" % (sign, n // scale, digits, n % scale)


def upper_edge(x: int, mapping: list[int] | tuple[int, int, int]) -> float:
    """The upper end of value x's readings: F(x) is the fraction of readings below it."""
    sn, sd, off = mapping
    return off + (x + 1) * sd / sn


def parse_qs_list(vals: list[str]) -> list[float]:
    out: list[float] = []
    for v in vals:
        for tok in re.split(r"[\s,;]+", v.strip()):
            if not tok:
                continue
            pct = tok.endswith("%")
            try:
                q = float(tok[:-1] if pct else tok)
            except ValueError:
                raise ValueError("q: not a number: %r" % tok[:40])
            if pct:
                q /= 100.0
            if math.isnan(q) or not 0 <= q <= 1:
                raise ValueError("q must be in [0, 1] (or a percentage): %r" % tok[:40])
            out.append(q)
    out = list(dict.fromkeys(out))
    if len(out) > MAX_QUANTILES:
        raise ValueError("at most %d quantiles" % MAX_QUANTILES)
    return out


def q_label(q: float) -> str:
    if q == 0.5:
        return "median"
    p = 100 * q
    return "p%s" % (("%d" % round(p)) if abs(p - round(p)) < 1e-9 else ("%g" % p))


class KindPages:
    """Mixed into :class:`pansketch.host_tools.web.app.Dashboard`: /quantiles, /heavy, /distinct and their JSON."""

    # provided by Dashboard
    confidence: float
    _store: Any
    _html: Any
    _json: Any
    _salt: Any
    _bars: Any

    # -- selection ----------------------------------------------------------------
    @staticmethod
    def _kinds(st: Any) -> dict[str, list[str]]:
        """kind -> devices holding releases of it."""
        out: dict[str, list[str]] = {}
        for row in st.devices():  # a device row is there while the device holds releases
            out.setdefault(row[3], []).append(row[0])
        return out

    @staticmethod
    def _missing(kind: str, kinds: dict[str, list[str]]) -> str:
        held = ", ".join("%s (%d device%s)" % (k, len(v), "" if len(v) == 1 else "s") for k, v in sorted(kinds.items()))
        return "no releases of kind %r in this store: %s. It holds %s." % (kind, KIND_USE[kind], held or "no releases")

    def _kind_sel(self, p: Any, st: Any, kind: str) -> tuple[dict[str, Any], list[str], dict[str, list[str]]]:
        """(selection for the query functions, the kind's devices, all kinds); QueryError if the kind is absent."""
        kinds = self._kinds(st)
        devs = kinds.get(kind, [])
        if not devs:
            raise QueryError(self._missing(kind, kinds))
        sel = self._selection(p)  # type: ignore[attr-defined]
        if sel["device"] is None:
            sel["device"] = list(devs)
        return sel, devs, kinds

    def _form(self, p: Any, sel: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return {"window": p.get("window") or "", "since": p.get("since") or "", "until": p.get("until") or "",
                "device": p.all("device"), "confidence": p.confidence(self.confidence)}

    def _kind_page(self, p: Any, kind: str, template: str, title: str, build: Any) -> Resp:
        try:
            with self._store() as st:
                kinds = self._kinds(st)
                devs = kinds.get(kind, [])
                if not devs:
                    return self._html(template, title=title, missing=self._missing(kind, kinds), form=self._form(p),
                                      known=[], params=p, res=None)
                sel, devs, kinds = self._kind_sel(p, st, kind)
                res = build(st, sel, p)
        except FileNotFoundError as exc:
            return self._html("empty.html", title=title, message=str(exc))
        return self._html(template, title=title, missing=None, form=dict(self._form(p), **res.pop("form", {})),
                          known=devs, params=p, res=res)

    # -- quantiles and CDF (dcs) ------------------------------------------------------
    def _qs(self, p: Any) -> list[float]:
        try:
            qs = parse_qs_list(p.all("q"))
        except ValueError as exc:
            raise BadRequest(str(exc))
        return qs or list(DEFAULT_QS)

    def _reading(self, p: Any, k: str) -> Optional[str]:
        v = p.get(k)
        if not v:
            return None
        from pansketch.agent.dcs import parse_reading

        if len(v) > 100 or parse_reading(v) is None:
            raise BadRequest("%s: not a reading (decimal, 0x hex, IPv4 or MAC): %r" % (k, v[:40]))
        return v

    def _quantiles(self, st: Any, sel: dict[str, Any], p: Any) -> dict[str, Any]:
        qs = self._qs(p)
        points = p.int("points", DEFAULT_POINTS, 2, MAX_POINTS) or DEFAULT_POINTS
        conf = p.confidence(self.confidence)
        xmin, xmax = self._reading(p, "from"), self._reading(p, "to")
        salt = self._salt()
        # the chosen quantiles and the chart's range: one call (one merge), the CLI's quantile answers
        zoom = [z for z in ZOOM if z not in qs] if xmin is None or xmax is None else []
        rows = dyadic_cli.quantiles(st, qs + zoom, salt=salt, confidence=conf, **sel)
        qrows, zrows = rows[:len(qs)], rows[len(qs):]
        r0 = rows[0]
        mp = r0["map"]
        from pansketch.agent.dcs import map_value

        lo_x = map_value(xmin, r0["b"], mp) if xmin is not None else min(r["value"] for r in (zrows or qrows))
        hi_x = map_value(xmax, r0["b"], mp) if xmax is not None else max(r["value"] for r in (zrows or qrows))
        lo_x, hi_x = min(lo_x, hi_x), max(lo_x, hi_x)
        if xmin is None:  # an automatic range includes every chosen quantile; a given one is kept
            lo_x = min([lo_x] + [r["value"] for r in qrows])
        if xmax is None:
            hi_x = max([hi_x] + [r["value"] for r in qrows])
        if hi_x == lo_x:
            lo_x, hi_x = max(0, lo_x - 1), min((1 << r0["b"]) - 1, hi_x + 1)
        span = hi_x - lo_x
        xs = sorted({lo_x + (i * span) // (points - 1) for i in range(points)}
                    | {r["value"] for r in qrows if lo_x <= r["value"] <= hi_x})
        crow = dyadic_cli.cdf(st, at=[value_reading(x, mp) for x in xs], salt=salt, confidence=conf, **sel)
        for r in qrows:
            r["label"] = q_label(r["q"])
            r["reading_label"] = reading_label(r["reading"])
        chart = {"x": [upper_edge(r["value"], mp) for r in crow], "cdf": [r["cdf"] for r in crow],
                 "lo": [r["cdf_lo"] for r in crow], "hi": [r["cdf_hi"] for r in crow],
                 "confidence": conf,
                 "quantiles": [{"q": r["q"], "label": r["label"], "x": upper_edge(r["value"], mp), "cdf": r["cdf"],
                                "lo": r["cdf_lo"], "hi": r["cdf_hi"], "reading": r["reading_label"]} for r in qrows]}
        for r in crow:
            r["reading_label"] = reading_label(r["reading"])
        return {"rows": qrows, "cdf": crow, "chart": chart, "meta": r0,
                "form": {"q": " ".join("%g" % q for q in qs), "points": points, "from": xmin or "", "to": xmax or "",
                         "zoom": bool(zrows)}}

    def page_quantiles(self, p: Any) -> Resp:
        return self._kind_page(p, "dcs", "quantiles.html", "quantiles", self._quantiles)

    def api_quantiles(self, p: Any) -> Resp:
        with self._store() as st:
            sel, _d, _k = self._kind_sel(p, st, "dcs")
            rows = dyadic_cli.quantiles(st, self._qs(p), salt=self._salt(), confidence=p.confidence(self.confidence),
                                        **sel)
        return self._json({"answers": rows})

    def api_cdf(self, p: Any) -> Resp:
        at = [x for v in p.all("at") for x in re.split(r"[\s,;]+", v.strip()) if x]
        if len(at) > MAX_POINTS:
            raise BadRequest("at most %d readings" % MAX_POINTS)
        with self._store() as st:
            sel, _d, _k = self._kind_sel(p, st, "dcs")
            try:
                rows = dyadic_cli.cdf(st, points=p.int("points", 17, 2, MAX_POINTS) or 17, at=at or None,
                                      salt=self._salt(), confidence=p.confidence(self.confidence), **sel)
            except ValueError as exc:
                raise QueryError(str(exc))
        return self._json({"answers": rows})

    # -- heavy hitters (dcs) -----------------------------------------------------------
    def _threshold(self, p: Any) -> Optional[float]:
        v = p.get("threshold")
        if not v:
            return None
        try:
            t = float(v)
        except ValueError:
            t = math.nan
        if not math.isfinite(t):
            raise BadRequest("threshold: not a number: %r" % v[:40])
        return t

    def _heavy_kind(self, p: Any) -> str:
        """dcs or strhh: the ``kind`` asked for if the store holds it; else the kind of the devices asked for;
        else the one more devices have, strhh on a tie -- the rule of ``pansketch query heavy``
        (pansketch.host_tools.query.core.pick_devices with kinds ("strhh", "dcs")), so both answer the same."""
        try:
            with self._store() as st:
                kinds = self._kinds(st)
        except FileNotFoundError:
            return "dcs"
        want = p.get("kind")
        if want in ("dcs", "strhh") and kinds.get(want):
            return str(want)
        asked = set(p.all("device"))
        for k in ("strhh", "dcs"):
            if asked and asked <= set(kinds.get(k, [])):
                return k
        held = {k: len(kinds.get(k, [])) for k in ("strhh", "dcs")}
        return "strhh" if held["strhh"] and held["strhh"] >= held["dcs"] else "dcs"

    def _heavy_rows(self, st: Any, sel: dict[str, Any], p: Any, kind: str = "dcs"
                    ) -> tuple[list[dict[str, Any]], int, Optional[float]]:
        k = p.int("k", 10, 1, 1000) or 10
        thr = self._threshold(p)
        if kind == "strhh":  # heavy strings: the prefix descent (pansketch.host_tools.query.strheavy_cli)
            rows = strheavy_cli.heavy(st, k, threshold=thr, salt=self._salt(),
                                      confidence=p.confidence(self.confidence), **sel)
            return rows, k, thr
        rows = dyadic_cli.heavy(st, k, threshold=thr, salt=self._salt(), confidence=p.confidence(self.confidence),
                                **sel)
        return rows, k, thr

    def _heavy(self, st: Any, sel: dict[str, Any], p: Any, kind: str = "dcs") -> dict[str, Any]:
        rows, k, thr = self._heavy_rows(st, sel, p, kind)
        for r in rows:  # the page's label column (strhh: the string, its value column too)
            if kind == "strhh":
                r["value"] = r["reading_label"] = r["label"]
            else:
                r["reading_label"] = reading_label(r["reading"])
        chart = None
        if rows:
            chart = self._bars([SimpleNamespace(item=r["reading_label"], estimate=r["estimate"], lo=r["lo"], hi=r["hi"])
                                for r in rows])
        return {"rows": rows, "chart": chart, "kind": kind,
                "form": {"k": k, "threshold": "" if thr is None else p.get("threshold")}}

    def page_heavy(self, p: Any) -> Resp:
        kind = self._heavy_kind(p)
        return self._kind_page(p, kind, "heavy.html", "heavy hitters",
                               lambda st, sel, q: self._heavy(st, sel, q, kind))

    def api_heavy(self, p: Any) -> Resp:
        kind = self._heavy_kind(p)
        with self._store() as st:
            sel, _d, _k = self._kind_sel(p, st, kind)
            rows, _k2, _t = self._heavy_rows(st, sel, p, kind)
        return self._json({"answers": rows})

    # -- distinct counts (dbits) ------------------------------------------------------------
    def _windows(self, st: Any, sel: dict[str, Any], limit: int, conf: float) -> tuple[list[dict[str, Any]], int]:
        """Per window of the selection: the distinct count of that window (distinct.query), oldest first."""
        rels = st.releases(devices=sel["device"], window=sel["window"], since=sel["since"], until=sel["until"])
        wins = sorted({(r.win * r.win_s, r.win_s, r.win) for r in rels})
        lens = {ws for _t, ws, _w in wins}
        cut = max(0, len(wins) - limit)
        out = []
        for t0, ws, w in wins[cut:]:
            t1 = t0 + ws
            if len(lens) == 1 and sel["since"] is None and sel["until"] is None:
                one = dict(sel, window=w)  # the CLI's --window W
            else:  # the window's part of the range (the window id alone would mean other times for other lengths)
                lo = t0 if sel["since"] is None else max(t0, sel["since"])
                hi = t1 if sel["until"] is None else min(t1, sel["until"])
                one = dict(sel, window=None, since=lo, until=hi)
            try:
                a = distinct.query(st, salt=self._salt(), confidence=conf, **one)
                err = None
            except QueryError as exc:
                a, err = None, str(exc)
            out.append({"window": w, "win_s": ws, "t0": t0, "t1": t1, "answer": a, "error": err})
        return out, cut

    def _distinct(self, st: Any, sel: dict[str, Any], p: Any) -> dict[str, Any]:
        conf = p.confidence(self.confidence)
        total = distinct.query(st, salt=self._salt(), confidence=conf, **sel)
        limit = p.int("windows", 200, 1, MAX_WINDOWS) or 200
        wins, cut = self._windows(st, sel, limit, conf)
        chart = None
        if len(wins) > 1:
            step = min(w["win_s"] for w in wins)
            chart = {"x": [(w["t0"] + w["t1"]) / 2 for w in wins], "confidence": conf, "step": step,
                     "partial": [False] * len(wins),
                     "lines": [{"label": "distinct", "color": "#1f77b4",
                                "est": [w["answer"]["estimate"] if w["answer"] else None for w in wins],
                                "lo": [w["answer"]["lo"] if w["answer"] else None for w in wins],
                                "hi": [w["answer"]["hi"] if w["answer"] else None for w in wins],
                                "zero": [w["answer"]["estimate"] if w["answer"] and w["answer"]["lo"] <= 0 else None
                                         for w in wins]}]}
        return {"total": total, "windows": wins, "truncated": cut, "chart": chart,
                "form": {"windows": limit}}

    def page_distinct(self, p: Any) -> Resp:
        return self._kind_page(p, "dbits", "distinct.html", "distinct", self._distinct)

    def api_distinct(self, p: Any) -> Resp:
        with self._store() as st:
            sel, _d, _k = self._kind_sel(p, st, "dbits")
            conf = p.confidence(self.confidence)
            out = distinct.query(st, salt=self._salt(), confidence=conf, **sel)
            if p.flag("per_window"):
                wins, cut = self._windows(st, sel, p.int("windows", 200, 1, MAX_WINDOWS) or 200, conf)
                out["windows"] = [dict(w["answer"] or {"error": w["error"]}, window=w["window"],
                                       window_since=iso(w["t0"]), window_until=iso(w["t1"])) for w in wins]
                if cut:
                    out["windows_truncated"] = cut
        return self._json(out)
