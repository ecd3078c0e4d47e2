"""``pansketch query freq | topk``: point estimates of items with intervals (pansketch.host_tools.query.core answers them)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from pansketch.host_tools.output import textsafe
from pansketch.host_tools.query import devicepage, plot
from pansketch.host_tools.query.core import QueryError, _item, _print_table, freq, positive_int, read_candidates, topk
from pansketch.host_tools.store.sql import SQLStore


def add_freq_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("items", nargs="+", metavar="ITEM")
    devicepage.add_arguments(p)


def add_topk_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-k", type=positive_int, required=True, metavar="K",
                   help="how many of the candidates to list, best first (at least 1)")
    p.add_argument("--candidates", required=True, metavar="FILE", help="one item per line ('-' = stdin)")
    devicepage.add_arguments(p)


def _err(msg: str, code: int) -> int:
    print("pansketch query: %s" % msg, file=sys.stderr)
    return code


def run(args: argparse.Namespace, store: SQLStore, salt: str, conf: float, since: Optional[float],
        until: Optional[float]) -> int:
    """``pansketch query freq`` and ``topk``: the table, or JSON lines, and the --plot."""
    t_start = time.perf_counter()
    try:
        if args.qtype == "freq":
            items = [_item(x, args.as_int, "ITEM") for x in args.items]
            answers = freq(store, items, salt=salt, window=args.window, since=since, until=until,
                           device=args.device, confidence=conf, use_rollups=args.use_rollups,
                           consistent=getattr(args, "consistent", True))
        else:
            cands = read_candidates(args.candidates, args.as_int)
            answers = topk(store, cands, args.k, salt=salt, window=args.window, since=since, until=until,
                           device=args.device, confidence=conf, use_rollups=args.use_rollups)
    except (QueryError, ValueError, OSError) as exc:
        return _err(str(exc), 1)
    elapsed = time.perf_counter() - t_start
    if getattr(args, "plot", None) and answers:
        try:
            plot.plot_answers(answers, args.plot, "pansketch query %s" % args.qtype)
        except (ImportError, OSError) as exc:
            return _err(str(exc), 1)
        print("pansketch query: plot written to %s" % args.plot, file=sys.stderr)
    if args.json:
        offset, limit = devicepage.page(args)
        for a in answers:
            print(textsafe.json_text(a.to_dict(offset, limit)))
    else:
        _print_table(answers, args.qtype == "topk", elapsed)
    return 0
