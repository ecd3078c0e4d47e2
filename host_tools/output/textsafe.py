"""Device-derived text made safe to print: on a terminal, in a CSV cell, in a log line, in JSON.

Strings a device chooses (strhh heavy hitters, fields of its status
message, MQTT topics and the reasons quoting them) reach the operator's
terminal, spreadsheet and journal. A device is untrusted even when it is
authenticated, so none of those strings may act as anything but text:

* :func:`term` shows every control character as an escape (``\\x1b``,
  ``\\r``, ``\\u009b``): C0 controls and DEL (ESC starts the sequences that
  clear a screen or write OSC 8 links; ``\\r`` and ``\\n`` overwrite or
  forge lines), C1 controls (U+0080-U+009F: some terminals read U+009B as
  ESC ``[``), and the Unicode format characters that reorder or split what
  is shown (bidi overrides and isolates, line and paragraph separators).
  Everything else, non-ASCII letters included, is kept as it is.
* :func:`csv_cell` makes a cell a spreadsheet shows as text: one starting
  with ``= + - @``, tab or CR is a formula to Excel and LibreOffice, so it
  gets a leading ``'`` (OWASP's advice), unless it is a plain number.
* :func:`json_text` is ``json.dumps`` whose output has no control
  character either (json escapes C0 itself, not DEL, C1 or bidi marks).
* :class:`SafeFormatter` escapes the message of every log record, so a
  reason quoting a device string cannot forge a journal line.

One module, so every place that prints device text uses the same rule.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from pansketch.host_tools.output import finitejson

# C0, DEL, C1; bidi embeddings/overrides (U+202A-U+202E) and isolates (U+2066-U+2069), the
# line/paragraph separators (U+2028/U+2029) and other zero-width format characters that
# change how the text around them is shown (U+200B-U+200F, U+061C, U+FEFF).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")
# what json.dumps leaves unescaped (it escapes C0 itself; its indent newlines must stay)
_UNSAFE_JSON = re.compile("[\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    o = ord(c)
    # C0 as \xNN (what Python shows); the rest as \uNNNN, which is also a valid escape inside JSON
    return "\\x%02x" % o if o < 0x20 else "\\u%04x" % o


def term(text: Any) -> str:
    """``text`` as a string with every control and format character shown as an escape."""
    s = text if isinstance(text, str) else str(text)
    return _UNSAFE.sub(_escape, s) if _UNSAFE.search(s) else s


def csv_cell(value: Any) -> Any:
    """A CSV cell value that a spreadsheet shows as text and a terminal shows as text.

    Numbers and booleans stay as they are; a string is escaped as by :func:`term` (so a cell
    never holds a CR or LF either) and gets a leading ``'`` when it would start a formula."""
    if not isinstance(value, str):
        return value
    if value.startswith(_FORMULA_START) and not _NUMBER.fullmatch(value):
        # the check runs on the raw value: a leading tab or CR is escaped below, but a spreadsheet
        # importer that undoes escapes must still not see a formula
        return "'" + term(value)
    return term(value)


def json_text(obj: Any, **kw: Any) -> str:
    """``json.dumps(obj, ensure_ascii=False, **kw)`` with DEL, C1 and format characters as ``\\uNNNN``
    escapes (json already escapes C0). Outside its strings JSON text is ASCII, so the escapes land
    inside strings, where they are valid JSON and decode back to the same characters. Non-finite
    numbers are ``null`` with a reason (pansketch.host_tools.output.finitejson): the text is always strict JSON."""
    kw.setdefault("ensure_ascii", False)
    try:  # the common case, nothing non-finite: finite() would return obj itself (its walk cost a large
        text = json.dumps(obj, allow_nan=False, **kw)  # status of 10^4 devices 0.5 s)
    except ValueError:  # a NaN or infinity somewhere (or what finite() refuses as well)
        text = json.dumps(finitejson.finite(obj), allow_nan=False, **kw)
    return _UNSAFE_JSON.sub(_escape, text)


class SafeFormatter(logging.Formatter):
    """A Formatter that escapes the message (``msg % args``) of each record with :func:`term`.

    The traceback of an exception is left alone: its lines come from the host's own code."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = term(record.message)
        return super().formatMessage(record)
