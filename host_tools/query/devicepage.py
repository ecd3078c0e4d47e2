"""The contributing devices of an answer's JSON, as a page: ``--devices-limit``, ``--devices-offset``, ``--all-devices``.

A fleet-wide answer merges every device; listing them all made each ``--json`` answer about 140 KB
at 10^4 devices (a top-10, ten such lists). By default an answer lists the first
:data:`pansketch.host_tools.query.core.DEVICES_LIMIT` devices (device order) and says how many there
are in all: ``"devices_page": {"offset", "limit", "total"}``, as ``pansketch status --json --limit``
pages its devices. ``--all-devices`` lists every one, in the format without ``devices_page``.
"""

from __future__ import annotations

import argparse
from typing import Optional

from pansketch.host_tools.query.core import DEVICES_LIMIT, int_at_least


def _count(txt: str) -> int:
    return int_at_least(txt, 0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of freq, topk and series (used by --json and --csv; the table names the first 8)."""
    g = p.add_argument_group("contributing devices in --json / --csv")
    g.add_argument("--devices-limit", type=_count, default=DEVICES_LIMIT, metavar="N",
                   help="list N of each answer's devices (default %d), with devices_page {offset, limit, total}"
                        % DEVICES_LIMIT)
    g.add_argument("--devices-offset", type=_count, default=0, metavar="K", help="from the K-th device (device order)")
    g.add_argument("--all-devices", action="store_true",
                   help="list every contributing device (no devices_page; about 14 bytes per device per answer)")


def page(args: argparse.Namespace) -> tuple[int, Optional[int]]:
    """(offset, limit) for :meth:`pansketch.host_tools.query.core.Answer.to_dict`; limit None: every device."""
    if getattr(args, "all_devices", False):
        return 0, None
    return int(getattr(args, "devices_offset", 0) or 0), int(getattr(args, "devices_limit", DEVICES_LIMIT))
