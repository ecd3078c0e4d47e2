"""``pansketch query quantile | cdf | heavy``: answers from merged dcs releases.

Python API (pansketch.host_tools.query.dyadic does the estimation)::

    from pansketch.host_tools.query import dyadic_cli
    ans = dyadic_cli.quantiles(store, [0.5, 0.95], salt="fleet-salt", window=480000)
    rows = dyadic_cli.cdf(store, salt="fleet-salt", points=17)
    top = dyadic_cli.heavy(store, 10, salt="fleet-salt")
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Optional, Sequence, Union

import numpy as np

from pansketch.host_tools.output import textsafe
from pansketch.host_tools.query import dyadic
from pansketch.host_tools.query.core import int_at_least, positive_int


def _view(store: Any, salt: str, confidence: float, **sel: Any) -> tuple[Any, Any, dyadic.DyadicView]:
    from pansketch.host_tools.query.core import QueryError, select_merged

    m, s = select_merged(store, salt=salt, kinds=("dcs",), **sel)
    if m.kind != "dcs":
        raise QueryError("these releases are of kind %r; quantile, cdf and heavy need kind 'dcs' "
                         "(use freq/topk)" % m.kind)
    return m, s, dyadic.DyadicView.of(m, salt, confidence)


RANK_METHOD = "dcs-rank-ls-per-salt"


def _meta(m: Any, s: Any, v: dyadic.DyadicView) -> dict[str, Any]:
    from pansketch.host_tools.query.core import iso

    return {"window": s.window, "range": {"since": iso(m.t0), "until": iso(m.t1), "since_unix": m.t0,
                                          "until_unix": m.t1},
            "devices": m.devices, "releases": m.releases, "kind": "dcs", "b": m.b, "map": list(m.map),
            "confidence": v.confidence, "noise_sd": round(m.noise_sd, 3),
            **({"partial_excluded": s.partial} if s.partial else {})}


def quantiles(store: Any, qs: Sequence[float], *, salt: str, confidence: float = 0.95,
              window: Optional[int] = None, since: Optional[float] = None, until: Optional[float] = None,
              device: Union[None, str, Sequence[str]] = None) -> list[dict[str, Any]]:
    """Per q: the estimated q-quantile (domain value and reading range) with the rank interval of that value."""
    from pansketch.host_tools.query.core import QueryError

    for q in qs:
        if not 0 <= q <= 1:
            raise QueryError("quantiles must be in [0, 1], got %r" % q)
    m, s, v = _view(store, salt, confidence, window=window, since=since, until=until, device=device)
    xs = v.quantile(qs)
    meta = _meta(m, s, v)
    return [dict(a.to_dict(), method=RANK_METHOD, **meta) for a in dyadic.rank_answers(v, xs, qs, m.map, coarsen=True)]


def cdf(store: Any, *, salt: str, points: int = 17, at: Optional[Sequence[Any]] = None, confidence: float = 0.95,
        window: Optional[int] = None, since: Optional[float] = None, until: Optional[float] = None,
        device: Union[None, str, Sequence[str]] = None) -> list[dict[str, Any]]:
    """F(x) = fraction of events with value <= x, at readings ``at`` or at ``points`` values that
    follow the data: the estimated q-quantiles for q evenly spaced in [0, 1] (duplicates merged).
    The rows are monotone, in [0, 1] and inside their intervals (dyadic.make_consistent)."""
    from pansketch.host_tools.query.core import QueryError

    m, s, v = _view(store, salt, confidence, window=window, since=since, until=until, device=device)
    top = (1 << m.b) - 1
    if at:
        xs = np.array([dyadic.to_value(r, m.b, m.map) for r in at], dtype=np.int64)
    else:
        if points < 2:
            raise QueryError("--points must be at least 2")
        # a grid over the whole 2^b domain would spend most points where no reading occurs
        qs = np.linspace(0.0, 1.0, points)
        xs = np.unique(np.minimum(top, v.quantile(qs)))
    meta = _meta(m, s, v)
    return [dict(a.to_dict(), method=RANK_METHOD, **meta) for a in dyadic.rank_answers(v, xs, None, m.map, coarsen=not at)]


def heavy(store: Any, k: int, *, salt: str, threshold: Optional[float] = None, confidence: float = 0.95,
          window: Optional[int] = None, since: Optional[float] = None, until: Optional[float] = None,
          device: Union[None, str, Sequence[str]] = None) -> list[dict[str, Any]]:
    """The k domain values with the largest counts (no candidate list), with per-item intervals."""
    from pansketch.host_tools.query.core import QueryError

    if k < 1:
        raise QueryError("k must be at least 1")
    m, s, v = _view(store, salt, confidence, window=window, since=since, until=until, device=device)
    found, t0 = v.heavy(k, threshold)
    meta = _meta(m, s, v)
    out = []
    for rank, (x, e) in enumerate(found, 1):
        lo, hi = dyadic.reading_range(x, m.b, m.map)
        out.append(dict({"rank": rank, "value": x, "reading": [lo, hi], "estimate": round(e, 3),
                         "lo": round(e - t0, 3), "hi": round(e + t0, 3), "method": "dcs-dyadic-descent"}, **meta))
    return out


def _unit(txt: str) -> float:
    """argparse type: a quantile in [0, 1] (usage error, exit 2, otherwise)."""
    try:
        v = float(txt)
    except ValueError:
        raise argparse.ArgumentTypeError("not a number: %r" % txt)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError("quantiles are in [0, 1], got %r (the median is 0.5)" % txt)
    return v


def _points(txt: str) -> int:
    return int_at_least(txt, 2)


# the arguments of each kind (pansketch.host_tools.query.kinds registers them; the CLI adds the shared options)
def add_quantile_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--q", type=_unit, nargs="+", required=True, metavar="Q", help="quantiles in [0, 1]")


def add_cdf_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--points", type=_points, default=17,
                   help="points at the estimated quantiles 0, 1/(P-1), ..., 1 (default 17, at least 2)")
    c.add_argument("--at", nargs="+", metavar="READING", help="readings at which to evaluate the CDF")


def add_heavy_arguments(h: argparse.ArgumentParser) -> None:
    h.add_argument("-k", type=positive_int, required=True, metavar="K",
                   help="how many of the heaviest values to list (at least 1)")
    h.add_argument("--threshold", type=float, default=None, help="only values whose estimate is at least this")
    h.add_argument("--fdr", type=float, default=None, help="kind strhh: target false-discovery rate (default 0.05)")
    h.add_argument("--beam", type=int, default=None, help="kind strhh: open prefixes and finished strings kept per level (default max(2k+4, min(64, w/16), 24))")


def add_distinct_arguments(dq: argparse.ArgumentParser) -> None:
    """distinct has only the shared options."""


def reading_label(rd: Sequence[Optional[float]]) -> str:
    """A domain value's readings for people: '[20.5, 20.6)', or '< -39.9' / '>= 369.5' for the end
    values, which also hold every reading clamped into them (not '[-, -39.9)')."""
    lo, hi = rd
    if lo is None and hi is None:
        return "any reading"
    if lo is None:
        return "< %.10g" % hi  # type: ignore[str-format]
    if hi is None:
        return ">= %.10g" % lo
    return "[%.10g, %.10g)" % (lo, hi)


def _outside(r: dict[str, Any]) -> bool:
    """The estimate lies outside its own interval (noise; the interval is the statement to trust)."""
    return not (r["rank_lo"] <= r["rank"] <= r["rank_hi"] and min(r["cdf_lo"], r["cdf_hi"]) <= r["cdf"]
                <= max(r["cdf_lo"], r["cdf_hi"]))


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return "%g" % x


def run(args: argparse.Namespace, store: Any, salt: str, conf: float, since: Optional[float],
        until: Optional[float]) -> int:
    sel = dict(salt=salt, confidence=conf, window=args.window, since=since, until=until, device=args.device)
    t = time.perf_counter()
    if args.qtype == "heavy":  # kind strhh answers heavy with its own descent (host_tools/query/strheavy_cli.py)
        from pansketch.host_tools.query import strheavy_cli

        done = strheavy_cli.run_heavy(args, store, salt, conf, since, until)
        if done is not None:
            return done
    if args.qtype == "distinct":
        from pansketch.host_tools.query import distinct

        a = distinct.query(store, **sel)
        if args.json:
            print(textsafe.json_text(a))
        else:
            print("# %d release(s) from %d device(s); dbits %d levels x %d bits; %.0f%% interval (%s)"
                  % (a["releases"], len(a["devices"]), a["levels"], a["bits"], 100 * a["confidence"], a["method"]))
            print("DISTINCT  %s  [%s, %s]   (%s)" % (_fmt(a["estimate"]), _fmt(a["lo"]), _fmt(a["hi"]), a["scope"]))
        return 0
    if args.qtype == "quantile":
        rows = quantiles(store, args.q, **sel)
    elif args.qtype == "cdf":
        rows = cdf(store, points=args.points, at=args.at, **sel)
    else:
        rows = heavy(store, args.k, threshold=args.threshold, **sel)
    el = time.perf_counter() - t
    if args.json:
        for r in rows:
            print(textsafe.json_text(r))
        return 0
    if not rows:
        print("# no value above the noise floor%s" % (" and the threshold" if getattr(args, "threshold", None) else ""))
        return 0
    r0 = rows[0]
    print("# %d release(s) from %d device(s); dcs b=%d map=%s; noise sd %.1f per cell; %.0f%% intervals (%s)"
          % (r0["releases"], len(r0["devices"]), r0["b"], r0["map"], r0["noise_sd"], 100 * r0["confidence"],
             r0["method"]))
    if args.qtype == "heavy":
        print("%4s  %22s  %24s  %12s  %s" % ("RANK", "VALUE", "READING", "ESTIMATE", "INTERVAL"))
        for r in rows:
            print("%4d  %22d  %24s  %12s  [%s, %s]" % (r["rank"], r["value"], reading_label(r["reading"]),
                                                        _fmt(r["estimate"]), _fmt(r["lo"]), _fmt(r["hi"])))
    else:
        head = ("%6s  " % "Q" if args.qtype == "quantile" else "")
        print(head + "%22s  %24s  %12s  %26s  %8s  %s" % ("VALUE", "READING", "RANK<=", "RANK INTERVAL", "CDF",
                                                          "CDF INTERVAL"))
        outside = dishonest = 0
        for r in rows:
            line = ("%6g  " % r["q"] if args.qtype == "quantile" else "")
            if r.get("honest_interval", True):
                line += "%22d  %24s  %12s  %26s  %8.4f  [%.4f, %.4f]" % (
                    r["value"], reading_label(r["reading"]), _fmt(r["rank"]),
                    "[%s, %s]" % (_fmt(r["rank_lo"]), _fmt(r["rank_hi"])), r["cdf"], r["cdf_lo"], r["cdf_hi"])
            else:
                dishonest += 1
                line += "%22d  %24s  %12s  %26s  %8.4f  %s" % (
                    r["value"], reading_label(r["reading"]), _fmt(r["rank"]), "none (see below)", r["cdf"], "none")
            if _outside(r):
                outside += 1
                line += "  !"
            print(line)
        print("# n = %s [%s, %s]; READING: the readings of that domain value (the end values also hold the "
              "readings clamped into them)" % (_fmt(r0["n"]), _fmt(r0["n_lo"]), _fmt(r0["n_hi"])))
        if r0.get("resolution", 1) > 1:
            print("# values are the ends of blocks of %d domain values (READING: the whole block): the finest "
                  "resolution at which this fleet's sketch gives honest intervals" % r0["resolution"])
        if dishonest:  # each row's own reason (the sketch's resolution, or a merged total no events give)
            for note in sorted({r.get("note") or dyadic.NO_INTERVAL for r in rows if not r.get("honest_interval", True)}):
                print("# none: %s" % note)
        if outside:
            print("# ! = %d noisy estimate(s) outside their own interval (the raw sums are not monotone); "
                  "trust the interval, not the point" % outside)
    print("# answered in %.1f ms" % (el * 1000), file=sys.stderr if args.json else sys.stdout)
    return 0
