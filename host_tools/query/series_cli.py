"""``pansketch query series``: count per bucket with intervals (pansketch.host_tools.query.series computes it)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from pansketch.host_tools.query import core as query
from pansketch.host_tools.output import textsafe
from pansketch.host_tools.query import devicepage, plot
from pansketch.host_tools.query.core import QueryError, iso
from pansketch.host_tools.query.series import series
from pansketch.host_tools.store.sql import SQLStore


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The arguments of ``pansketch query series`` (the shared selection/output options come from the CLI)."""
    s.add_argument("items", nargs="+", metavar="ITEM")
    s.add_argument("--step", type=parse_step, metavar="S",
                   help="bucket length in seconds or with a unit: 90s, 15m, 1h, 1d (default: the window length; "
                        "the epoch length for tree-mode devices)")
    s.add_argument("--no-running", dest="running", action="store_false",
                   help="leave out the running total since the first bucket")
    s.add_argument("--per-device", action="store_true", help="one line per item and device")
    devicepage.add_arguments(s)


def parse_step(txt: str) -> int:
    """Seconds from '3600', '90s', '15m', '1h', '1d' or '1w'."""
    t = str(txt).strip().lower()
    mult = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        v = int(t[:-1]) * mult[t[-1]] if t and t[-1] in mult else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError("not a step: %r (seconds, or 15m, 1h, 1d)" % txt)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be positive, got %r (seconds, or 15m, 1h, 1d)" % txt)
    return v


def run(args: argparse.Namespace, store: SQLStore, salt: str, conf: float, since: Optional[float],
        until: Optional[float]) -> int:
    """``pansketch query series``: the table (or JSON lines, or --plot) of :func:`pansketch.host_tools.query.series.series`."""
    def err(msg: str, code: int) -> int:
        print("pansketch query: %s" % msg, file=sys.stderr)
        return code

    if args.window is not None:
        return err("series: select time with --since/--until (each bucket is a window or --step)", 2)
    try:
        items = [query._item(x, args.as_int, "ITEM") for x in args.items]
        s = series(store, items, salt=salt, since=since, until=until, device=args.device,
                   per_device=args.per_device, step=args.step, confidence=conf,
                   running=getattr(args, "running", True))
    except (QueryError, ValueError) as exc:
        return err(str(exc), 1)
    if args.plot:
        try:
            plot.plot_series(s, args.plot, "pansketch query series")
        except (ImportError, OSError) as exc:
            return err(str(exc), 1)
        print("pansketch query: plot written to %s" % args.plot, file=sys.stderr)
    if args.json:
        offset, limit = devicepage.page(args)
        for ln in s.lines:
            for p in ln.points:
                d = {"item": ln.item, "device": ln.device}
                d.update(p.to_dict(offset, limit))
                print(textsafe.json_text(d))
        return 0
    labels = {id(ln): textsafe.term(ln.label) for ln in s.lines}  # shown escaped: see pansketch.host_tools.output.textsafe
    width = max(8, min(40, max(len(x) for x in labels.values())))
    print("# %d s buckets; %g%% intervals per point; * = the point's interval includes 0; DRAWS = noise draws "
          "per cell combined; RUNNING = total since the first bucket" % (s.step, 100 * conf))
    print("%-*s  %-20s  %12s  %-24s %6s  %12s  %-24s %6s" % (width, "LINE", "FROM (UTC)", "ESTIMATE", "INTERVAL",
                                                            "DRAWS", "RUNNING", "INTERVAL", "DRAWS"))
    for ln in s.lines:
        for p in ln.points:
            if p.answer is None:
                line = "%-*s  %-20s  %12s  (%s)" % (width, labels[id(ln)][:width], iso(p.t0), "-", p.error)
            else:
                line = "%-*s  %-20s  %12s  %-24s %6d" % (
                    width, labels[id(ln)][:width], iso(p.t0), query._fmt(p.answer.estimate),
                    "[%s, %s]" % (query._fmt(p.answer.lo), query._fmt(p.answer.hi)), p.answer.noise_draws)
            r = p.running
            if r is not None:
                line += "  %12s  %-24s %6d" % (query._fmt(r.estimate), "[%s, %s]" % (query._fmt(r.lo), query._fmt(r.hi)),
                                               r.noise_draws)
            if p.answer is not None and p.includes_zero:
                line += " *"  # the point's interval (not the running one) includes 0
            print(line)
    return 0
