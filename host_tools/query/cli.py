"""``pansketch query``: the command line of every query kind in pansketch.host_tools.query.kinds.

``pansketch query KIND [ARGS] [--config FILE] [selection] [--json] ...``: the
shared options (config, selection, confidence, output) are added here to
each kind's own arguments; the kind's runner prints the answer.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from pansketch.host_tools import hostconfig
from pansketch.host_tools.query import kinds
from pansketch.host_tools.query.core import QueryError, parse_time
from pansketch.host_tools.store.backend import open_store


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", dest="config_sub", metavar="FILE", help="host config TOML (also accepted before the query type)")
    g = p.add_argument_group("selection (default: all releases)")
    g.add_argument("--window", type=int, metavar="ID", help="one window id (see `pansketch status`)")
    g.add_argument("--since", metavar="T", help="start of a time range (ISO-8601 UTC or unix seconds)")
    g.add_argument("--until", metavar="T", help="end of a time range (exclusive)")
    g.add_argument("--device", action="append", metavar="ID", help="only this device (repeatable)")
    g.add_argument("--exclude-device", action="append", metavar="ID", default=[],
                   help="leave this device out (repeatable; as if the store never received its releases; "
                        "devices excluded with `pansketch device exclude` are always left out)")
    p.add_argument("--confidence", type=float, default=None, help="interval confidence (default from [query], 0.95)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--csv", action="store_true", help="CSV: a header row, then the fields of --json, one row each")
    p.add_argument("--int", dest="as_int", action="store_true", help="items are integers (devices counted int items)")
    p.add_argument("--plot", metavar="FILE", help="also draw the answers with their intervals into FILE "
                                                  "(.png, .svg or .pdf; needs matplotlib)")
    p.add_argument("--no-rollups", dest="use_rollups", action="store_false",
                   help="merge the raw releases instead of the per-window roll-ups (same answer, slower)")
    p.add_argument("--no-consistency", dest="consistent", action="store_false",
                   help="tree-mode devices: sum the raw cover nodes (default: least-squares consistent nodes)")



def add_parser(subparsers: Any, words: Optional[Sequence[str]] = None) -> None:
    """``pansketch query`` and its kinds. ``words``: the command line after ``query``; then only the kinds
    it names get their arguments (and import their modules), the others a parser that lists them."""
    p = subparsers.add_parser("query", help="estimate frequencies / top-k with intervals",
                              description="Query merged releases. Every answer carries an interval [lo, hi] "
                                          "at the stated confidence (docs/HOST.md).")
    p.add_argument("--config", metavar="FILE", help="host config TOML ([fleet] salt, [aggregator] db)")
    sub = p.add_subparsers(dest="qtype", metavar="QUERY")
    named = None if words is None else set(words) & set(kinds.BY_NAME)
    for kind in kinds.KINDS:
        k = sub.add_parser(kind.name, help=kind.help)
        if named is None or kind.name in named:
            kind.add_arguments(k)
            _common(k)
    p.set_defaults(func=main)


add_parser_for = add_parser  # pansketch.host_tools.cli passes the words when the command names `query` first


def _err(msg: str, code: int) -> int:
    print("pansketch query: %s" % msg, file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    if not getattr(args, "csv", False):
        return _main(args)
    if args.json:
        return _err("give --json or --csv, not both", 2)
    import contextlib
    import io

    from pansketch.host_tools.query import csvout

    args.json = True  # the JSON objects, converted: the same fields by construction
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = _main(args)
    if code == 0:
        csvout.from_json_lines(buf.getvalue(), sys.stdout)
    return code


def _main(args: argparse.Namespace) -> int:
    if not getattr(args, "qtype", None):
        return _err("choose a query: %s (see pansketch query --help)" % _names(), 2)
    cfg = hostconfig.load_for_subcommand(args, "pansketch query")
    if cfg is None:
        return 2
    try:
        salt = cfg.require_salt()
    except hostconfig.ConfigError as exc:
        print("pansketch: config error: %s" % exc, file=sys.stderr)
        return 2
    conf = args.confidence if args.confidence is not None else cfg.query.confidence
    if not 0.5 <= conf < 1:
        return _err("--confidence must be in [0.5, 1)", 2)
    try:
        since = parse_time(args.since) if args.since is not None else None
        until = parse_time(args.until) if args.until is not None else None
    except ValueError as exc:
        return _err(str(exc), 2)
    if args.window is not None and (since is not None or until is not None):
        return _err("give either a window id (--window) or a time range (--since/--until), not both", 2)
    if since is not None and until is not None and until <= since:
        return _err("empty time range: --until %s is not after --since %s" % (args.until, args.since), 2)
    if getattr(args, "plot", None):
        from pansketch.host_tools.query import plot

        try:
            plot.check_path(args.plot)
            plot.available()
        except (ValueError, ImportError) as exc:
            return _err(str(exc), 2)
    try:
        store = open_store(cfg.aggregator.db, readonly=True)
    except Exception as exc:  # missing file, PostgreSQL unreachable, ...
        return _err(str(exc), 1)
    # read by pansketch.host_tools.query.core.select_merged, which every query kind merges through
    store.query_exclude = tuple(getattr(args, "exclude_device", None) or ())  # type: ignore[attr-defined]
    try:
        code = kinds.get(args.qtype).run(args, store, salt, conf, since, until)
        if code == 0:
            _flag_note(store, set(store.query_exclude), cfg.fleet.max_events)  # type: ignore[attr-defined]
        return code
    except BrokenPipeError:
        raise  # a closed stdout ends the command quietly (pansketch.agent.pi.pipes.run_main)
    except (QueryError, ValueError, OSError) as exc:
        return _err(str(exc), 1)
    finally:
        store.close()


def _flag_note(store: Any, exclude: set[str], max_events: Any) -> None:
    """Next to the answer (on stderr: the answer's own output stays as it is): devices flagged in the latest
    windows (pansketch.host_tools.query.influence), which the answer merges unless they are excluded.
    ``max_events``: [fleet]'s contribution limits, those the aggregator's flag scanner keeps flags with, so
    that the windows it kept are read from the store rather than computed from every payload again."""
    from pansketch.host_tools.query import influence
    from pansketch.host_tools.store import exclusions

    ex = set(exclusions.excluded(store)) | exclude
    flags = influence.recent_flags(store, windows=CLI_FLAG_WINDOWS, exclude=ex, max_events=max_events)
    if flags:
        devs = sorted({f.device for f in flags})
        print("pansketch query: note: %d flagged device-window(s) in the latest %d window(s), device(s) %s: out of "
              "line with the rest of the fleet (pansketch status shows where); --exclude-device ID leaves one out"
              % (len(flags), CLI_FLAG_WINDOWS, ", ".join(devs[:8]) + (" ..." if len(devs) > 8 else "")),
              file=sys.stderr)


CLI_FLAG_WINDOWS = 6  # the note reads these windows' payloads: a few, so that a query stays fast


def _names() -> str:
    """'freq, topk, ... or distinct'."""
    names = [k.name for k in kinds.KINDS]
    return ", ".join(names[:-1]) + " or " + names[-1]
