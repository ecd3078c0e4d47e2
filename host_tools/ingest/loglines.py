"""The aggregator's log lines: one per stored release, written a group at once; warnings for refused
messages, rate-limited; the times shown in them."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

LINE_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"  # pansketch.host_tools.logsetup's


def _plain_handler(lg: logging.Logger) -> Optional[logging.StreamHandler]:  # type: ignore[type-arg]
    """The one handler ``lg``'s INFO records reach, if it is a plain stream handler with the line format
    of pansketch.host_tools.logsetup, nothing filters them and no other handler sees them (``pansketch
    aggregate``); None otherwise (e.g. under pytest's log capture)."""
    if lg.filters:
        return None
    found: Optional[logging.StreamHandler] = None  # type: ignore[type-arg]
    c: Optional[logging.Logger] = lg
    while c is not None:
        for h in c.handlers:
            f = h.formatter
            if (found is not None or type(h) is not logging.StreamHandler or h.filters or h.level > logging.INFO
                    or f is None or type(f) is not logging.Formatter or f._fmt != LINE_FORMAT):
                return None
            found = h
        if not c.propagate:
            break
        c = c.parent
    return found


def info_lines(lg: logging.Logger, lines: list[str]) -> None:
    """Log ``lines`` at INFO, one record each (operators and tests read one line per stored release).

    To the plain stderr handler of ``pansketch aggregate`` (:func:`_plain_handler`) they are written
    as logging would write them, with the time of the group, in one write: one LogRecord per line,
    its caller lookup, formatting and a flushed write each cost about as much as storing the
    release's row. Otherwise one record per line through the logger's handlers.
    """
    h = _plain_handler(lg)
    if h is None:
        for line in lines:
            lg.handle(lg.makeRecord(lg.name, logging.INFO, "aggregator.py", 0, "%s", (line,), None))
        return
    prefix = h.format(lg.makeRecord(lg.name, logging.INFO, "aggregator.py", 0, "", (), None))
    text = "".join([prefix + line + h.terminator for line in lines])
    h.acquire()
    try:
        h.stream.write(text)
        h.flush()
    except Exception:  # what logging does with a failed write: report it, never raise
        h.handleError(lg.makeRecord(lg.name, logging.INFO, "aggregator.py", 0, "%s", (text[:200],), None))
    finally:
        h.release()


class RateLimitedWarnings:
    """Warning lines for refused messages, at most ``burst`` per ``interval`` s; then one summary line per
    interval with the counts per code of those not shown (a flood of garbage must not flood the log)."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, burst: int = 10) -> None:
        self.log = logger
        self.interval = interval
        self.burst = burst
        self._start = time.monotonic()
        self._shown = 0
        self._hidden: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, code: str, line: str) -> None:
        with self._lock:
            self._roll(time.monotonic())
            if self._shown < self.burst:
                self._shown += 1
                self.log.warning("%s", line)
            else:
                self._hidden[code] = self._hidden.get(code, 0) + 1

    def flush(self) -> None:
        """Say what was not shown (called at exit, and whenever an interval ends)."""
        with self._lock:
            self._roll(time.monotonic(), force=True)

    def _roll(self, now: float, force: bool = False) -> None:
        if not force and now - self._start < self.interval:
            return
        if self._hidden:
            self.log.warning("%d more message(s) refused or quarantined in the last %.0f s (not shown one by one): %s",
                             sum(self._hidden.values()), now - self._start,
                             ", ".join("%s %d" % kv for kv in sorted(self._hidden.items(), key=lambda kv: -kv[1])))
        self._start = now
        self._shown = 0
        self._hidden = {}


_UTC: dict[int, str] = {}  # epoch boundaries shown in the log lines (a few per window; cleared when large)


def _utc(t: int) -> str:
    s = _UTC.get(t)
    if s is None:
        if len(_UTC) >= 4096:
            _UTC.clear()
        s = _UTC[t] = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(t))
    return s


def _span(rel: Any) -> str:
    """What a release covers, for one log line: its window, or its epochs inside the window."""
    if rel.mode == "window" and rel.ehi - rel.elo == 1:
        what = "window %s (%d s)" % (_utc(rel.elo * rel.ep_s), rel.win_s)
    else:
        what = "epochs %s..%s (window %s)" % (_utc(rel.elo * rel.ep_s), _utc(rel.ehi * rel.ep_s),
                                            _utc(rel.win * rel.win_s))
    return what + (" part %d" % rel.part if rel.part else "")
