"""``pansketch query heavy`` on kind ``strhh``: heavy-hitter strings with no candidate list.

Python API (pansketch.host_tools.query.strheavy does the descent)::

    from pansketch.host_tools.query import strheavy_cli
    rows = strheavy_cli.heavy(store, 10, salt="fleet-salt", threshold=1000)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence, Union

from pansketch.host_tools.output import textsafe
from pansketch.host_tools.query import strheavy


def heavy_merged(m: Any, s: Any, k: int, *, salt: str, threshold: Optional[float] = None,
                 fdr: float = strheavy.DEFAULT_FDR, beam: Optional[int] = None,
                 confidence: float = 0.95) -> list[dict[str, Any]]:
    """Rows for merged strhh releases ``m`` of selection ``s``."""
    from pansketch.host_tools.query.core import QueryError, iso

    if k < 1:
        raise QueryError("k must be at least 1")
    if not 0 < fdr < 1:
        raise QueryError("--fdr must be in (0, 1), got %r" % fdr)
    if beam is not None and beam < 1:
        raise QueryError("--beam must be at least 1")
    v = strheavy.PrefixView.of(m, salt, confidence)
    found, t, stats = v.heavy(k, threshold, fdr, beam)
    meta = {"window": s.window, "range": {"since": iso(m.t0), "until": iso(m.t1), "since_unix": m.t0,
                                          "until_unix": m.t1},
            "devices": m.devices, "releases": m.releases, "kind": "strhh", "len": m.b, "d": m.d, "w": m.w,
            "confidence": confidence, "fdr": fdr, "noise_sd": round(m.noise_sd, 3),
            "examined": sum(stats["examined"]), "method": "strhh-prefix-descent",
            **({"partial_excluded": s.partial} if s.partial else {})}
    return [dict(strheavy.HeavyString(i, x, e, e - t, e + t).to_dict(), **meta)
            for i, (x, e) in enumerate(found, 1)]


def heavy(store: Any, k: int, *, salt: str, threshold: Optional[float] = None, fdr: float = strheavy.DEFAULT_FDR,
          beam: Optional[int] = None, confidence: float = 0.95, window: Optional[int] = None,
          since: Optional[float] = None, until: Optional[float] = None,
          device: Union[None, str, Sequence[str]] = None) -> list[dict[str, Any]]:
    """The k strings with the largest counts among the discoveries, with simultaneous intervals."""
    from pansketch.host_tools.query.core import QueryError, select_merged

    m, s = select_merged(store, salt=salt, window=window, since=since, until=until, device=device,
                         kinds=("strhh",))
    if m.kind != "strhh":
        raise QueryError("these releases are of kind %r; string heavy hitters need kind 'strhh'" % m.kind)
    return heavy_merged(m, s, k, salt=salt, threshold=threshold, fdr=fdr, beam=beam, confidence=confidence)


def print_rows(rows: list[dict[str, Any]], as_json: bool, elapsed: float, threshold: Optional[float]) -> int:
    if as_json:
        for r in rows:
            print(textsafe.json_text(r))
        print("# answered in %.1f ms" % (elapsed * 1000), file=sys.stderr)
        return 0
    if not rows:
        print("# no string above the noise floor%s" % (" and the threshold" if threshold is not None else ""))
        return 0
    r0 = rows[0]
    print("# %d release(s) from %d device(s); strhh len=%d d=%d w=%d; noise sd %.1f per cell; FDR %g; "
          "%.0f%% simultaneous intervals (%s, %d prefixes examined)"
          % (r0["releases"], len(r0["devices"]), r0["len"], r0["d"], r0["w"], r0["noise_sd"], r0["fdr"],
             100 * r0["confidence"], r0["method"], r0["examined"]))
    print("%4s  %-40s  %12s  %s" % ("RANK", "ITEM", "ESTIMATE", "INTERVAL"))
    for r in rows:
        # the label is a string some device chose: escaped, so it cannot clear the screen or forge a line
        print("%4d  %-40s  %12g  [%g, %g]" % (r["rank"], textsafe.term(r["label"]), r["estimate"], r["lo"], r["hi"]))
    if any(r["long"] for r in rows):
        print("# item\u2026#hh: items longer than len bytes, counted as their first len-2 bytes and a hash bucket hh")
    print("# answered in %.1f ms" % (elapsed * 1000))
    return 0


def run_heavy(args: argparse.Namespace, store: Any, salt: str, conf: float, since: Optional[float],
              until: Optional[float]) -> Optional[int]:
    """``query heavy`` when the selection is of kind strhh; None to let the dcs path answer."""
    from pansketch.host_tools.query.core import select_merged

    t = time.perf_counter()
    m, s = select_merged(store, salt=salt, window=args.window, since=since, until=until, device=args.device,
                         kinds=("strhh", "dcs"))  # a mixed store: the kind most devices have
    if m.kind != "strhh":
        return None
    rows = heavy_merged(m, s, args.k, salt=salt, threshold=args.threshold, fdr=getattr(args, "fdr", None)
                        or strheavy.DEFAULT_FDR, beam=getattr(args, "beam", None), confidence=conf)
    return print_rows(rows, args.json, time.perf_counter() - t, args.threshold)


METRIC_K = 10
METRIC_SPAN_S = 86400


def metric_families(store: Any, salt: str, k: int = METRIC_K, span_s: int = METRIC_SPAN_S) -> list[Any]:
    """Prometheus families of the heavy strings of the last ``span_s`` seconds of strhh releases.

    ``pansketch_strhh_heavy_estimate{rank,item}`` (with ``_lower``/``_upper``: the simultaneous
    interval of ``query heavy``), ``pansketch_strhh_heavy_strings`` (how many the descent reported,
    at most k) and ``pansketch_strhh_heavy_until_timestamp_seconds`` (end of the span: the latest
    epoch end of a strhh device). The span ends at that epoch end, so a scrape answers the same
    as ``pansketch query heavy -k 10 --since END-86400 --until END``. Empty on a store without
    strhh releases. The values are noisy releases post-processed (docs/PRIVACY.md): nothing
    beyond what ``query heavy`` answers."""
    from prometheus_client.core import GaugeMetricFamily

    from pansketch.host_tools.query.core import QueryError

    held = store.kind_counts()
    if not held.get("strhh"):
        return []
    devs = None if len(held) == 1 else set(store.devices_of_kind("strhh"))
    ends = [t1 for dev, _n, _last, t1 in store.device_activity() if devs is None or dev in devs]
    if not ends:
        return []
    until = float(max(ends))
    try:
        rows = heavy(store, k, salt=salt, since=until - span_s, until=until)
    except QueryError:
        return []
    fams = {n: GaugeMetricFamily("pansketch_strhh_heavy_" + n, h, labels=["rank", "item"]) for n, h in (
        ("estimate", "estimated count of the rank-th heaviest string (kind strhh, last day of releases)"),
        ("lower", "lower end of its simultaneous interval"), ("upper", "upper end of its simultaneous interval"))}
    for r in rows:
        lab = [str(r["rank"]), textsafe.term(r["label"])]  # a scrape shown in a terminal stays text
        fams["estimate"].add_metric(lab, r["estimate"])
        fams["lower"].add_metric(lab, r["lo"])
        fams["upper"].add_metric(lab, r["hi"])
    n = GaugeMetricFamily("pansketch_strhh_heavy_strings", "heavy strings reported (at most %d)" % k)
    n.add_metric([], len(rows))
    end = GaugeMetricFamily("pansketch_strhh_heavy_until_timestamp_seconds",
                            "end (unix time) of the day of strhh releases the heavy strings are from")
    end.add_metric([], until)
    return list(fams.values()) + [n, end]
