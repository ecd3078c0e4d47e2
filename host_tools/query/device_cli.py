"""``pansketch device exclude|include|purge ID``: take a device out of the fleet's answers.

* ``exclude ID [--reason TEXT]``: every answer from then on (CLI, dashboard,
  ``/metrics``) leaves the device out; its releases stay stored (and
  retention keeps their payloads, so a purge stays possible).
* ``include ID``: undo an exclusion.
* ``purge ID [--since T]``: delete its releases (all, or those whose epochs
  start at or after T) and subtract them from every roll-up, in one
  transaction: every answer is then that of a store that never received them.
  Refused, with nothing changed, if retention pruned one of their payloads
  while a roll-up still holds it (docs/HOST.md "Removing a device").
* ``list``: the excluded devices.

Exit codes: 0 done, 1 refused (store error, pruned payloads), 2 usage or config error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pansketch.host_tools import hostconfig
from pansketch.host_tools.store.backend import open_store


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("device", help="exclude, include or purge a device (a stolen or broken one)",
                              description="Take a device out of the fleet's answers: exclude (reversible), "
                                          "include (undo), purge (delete its releases and correct the roll-ups).")
    p.add_argument("--config", metavar="FILE", help="host config TOML ([aggregator] db)")
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    e = sub.add_parser("exclude", help="leave the device out of every answer from now on")
    e.add_argument("id", metavar="ID")
    e.add_argument("--reason", default="", help="shown in status (default: excluded by the operator)")
    i = sub.add_parser("include", help="undo an exclusion")
    i.add_argument("id", metavar="ID")
    g = sub.add_parser("purge", help="delete the device's releases and subtract them from the roll-ups")
    g.add_argument("id", metavar="ID")
    g.add_argument("--since", metavar="T", help="only releases whose epochs start at or after T (ISO-8601 UTC or "
                                                "unix seconds)")
    g.add_argument("--json", action="store_true", help="the report as one JSON object")
    sub.add_parser("list", help="the excluded devices")
    for q in (e, i, g):
        q.add_argument("--config", dest="config_sub", metavar="FILE", help=argparse.SUPPRESS)
    p.set_defaults(func=main)


def _err(msg: str, code: int) -> int:
    print("pansketch device: %s" % msg, file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    from pansketch.host_tools.query.core import parse_time
    from pansketch.host_tools.store import exclusions

    if not getattr(args, "action", None):
        return _err("choose an action: exclude, include, purge or list (see pansketch device --help)", 2)
    cfg = hostconfig.load_for_subcommand(args, "pansketch device")
    if cfg is None:
        return 2
    since = None
    if getattr(args, "since", None) is not None:
        try:
            since = parse_time(args.since)
        except ValueError as exc:
            return _err(str(exc), 2)
    try:
        store = open_store(cfg.aggregator.db, readonly=args.action == "list")
    except Exception as exc:
        return _err(str(exc), 1)
    try:
        if args.action == "list":
            for dev, (t, reason) in sorted(exclusions.excluded(store).items()):
                print("%s\texcluded since %s\t%s" % (dev, _iso(t), reason))
            return 0
        if args.action in ("exclude", "include"):
            changed = exclusions.set_excluded(store, args.id, args.action == "exclude", args.reason
                                              if args.action == "exclude" else "")
            print("%s %s%s" % (args.id, "excluded" if args.action == "exclude" else "included",
                               "" if changed else " (already)"))
            return 0
        rep = exclusions.purge(store, args.id, since)
        if args.json:
            print(json.dumps(rep.to_dict(), sort_keys=True))
        else:
            print("%s: %d release(s) deleted; %d roll-up(s) corrected, %d deleted (nothing else was in them)"
                  % (args.id, rep.releases, rep.rollups_corrected, rep.rollups_deleted))
        return 0
    except exclusions.PurgeError as exc:
        return _err(str(exc), 1)
    except Exception as exc:  # the store's errors (locked, unreachable)
        return _err("%s: %s" % (type(exc).__name__, exc), 1)
    finally:
        store.close()


def _iso(t: float) -> str:
    from pansketch.host_tools.query.core import iso

    return iso(t) or "?"
