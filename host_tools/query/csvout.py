"""``--csv`` wherever ``--json`` exists: the same fields as the JSON, one header row.

A JSON object becomes one row; nested objects become dotted columns
(``range.since``), lists of plain values one cell joined with ``;``
(``devices``: ``pi-1;pi-2``), other lists their JSON text, null an empty
cell. Rows of one command can differ (a series point without an answer
has ``error`` instead of ``estimate``): the header is the union of the
keys in the order they first appear.

Cells may hold strings a device chose (heavy-hitter strings, status fields):
each goes through :func:`pansketch.host_tools.output.textsafe.csv_cell`, so a spreadsheet
shows ``=HYPERLINK(...)`` as text and no cell holds a raw CR, LF or escape.
"""

from __future__ import annotations

import csv
import json
from typing import Any, Iterable, TextIO

from pansketch.host_tools.output import textsafe


def flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = prefix + str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list):
            plain = all(x is None or isinstance(x, (str, int, float, bool)) for x in v)
            out[key] = ";".join("" if x is None else str(x) for x in v) if plain else json.dumps(v)
        else:
            out[key] = "" if v is None else v
    return out


def write(rows: Iterable[dict[str, Any]], out: TextIO) -> int:
    """Write ``rows`` as CSV with a header row; returns the number of data rows."""
    flat = [flatten(r) for r in rows]
    header: dict[str, None] = {}
    for r in flat:
        for k in r:
            header.setdefault(k, None)
    names = list(header)
    w = csv.writer(out, lineterminator="\n")
    w.writerow([textsafe.csv_cell(k) for k in names])  # keys too: nested dict keys can be device strings
    for r in flat:
        w.writerow([textsafe.csv_cell(r.get(k, "")) for k in names])
    return len(flat)


def from_json_lines(text: str, out: TextIO) -> int:
    """The ``--json`` output of a command (one object per line) as CSV."""
    return write((json.loads(line) for line in text.splitlines() if line.strip()), out)
