"""Failed dashboard token attempts: slowed per client address and logged at most once a minute.

A token of at least :data:`MIN_TOKEN_CHARS` characters is far beyond
guessing; the limit here keeps a guesser from trying at the rate the server
answers (the failure mode seen was 1,500 guesses a second, unlogged) and
tells the operator that someone tries.

Each client address has a bucket of :data:`BURST` failures that refills one
every :data:`REFILL_S` seconds. While a bucket is empty, requests from that
address are answered 429 *without the token being checked*, so a guess made
then teaches nothing: a guesser gets at most one answer per ``REFILL_S``.
Nothing sleeps, so guessers never hold one of the server's few worker
threads. The table of addresses is bounded (:data:`MAX_SOURCES`, the
oldest dropped first). Behind a reverse proxy every request comes from the
proxy's address unless ``pansketch serve --trusted-proxy`` lets waitress
take the client from ``X-Forwarded-For``.

Logging: the first failure is logged at once, then one summary line per
:data:`LOG_INTERVAL_S` while failures go on (count, addresses, how many
were refused unchecked), so a flood of guesses cannot flood the journal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

from pansketch.host_tools.output import textsafe

log = logging.getLogger("pansketch.serve")

MIN_TOKEN_CHARS = 16
BURST = 5
REFILL_S = 2.0
MAX_SOURCES = 10000
LOG_INTERVAL_S = 60.0


class FailureLimit:
    """Per-address buckets of failed token attempts, and the rate-limited log of them."""

    def __init__(self, burst: int = BURST, refill_s: float = REFILL_S, log_interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.refill_s, self.log_interval_s, self.clock = burst, refill_s, log_interval_s, clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # addr -> (failures, as of)
        self._last_log: Optional[float] = None
        self._failed = self._refused = 0
        self._addrs: set[str] = set()

    def _level(self, addr: str, now: float) -> float:
        level, since = self._buckets.get(addr, (0.0, now))
        return max(0.0, level - (now - since) / self.refill_s)

    def blocked(self, addr: str) -> bool:
        """True when ``addr`` has used up its failures: answer 429 without checking its token."""
        with self._lock:
            now = self.clock()
            if addr not in self._buckets or self._level(addr, now) + 1 <= self.burst:
                return False
            self._refused += 1
            self._addrs.add(addr)
            self._maybe_log(now, addr)
            return True

    def failed(self, addr: str) -> None:
        """Count one failed attempt from ``addr``."""
        with self._lock:
            now = self.clock()
            self._buckets[addr] = (self._level(addr, now) + 1, now)
            self._buckets.move_to_end(addr)
            while len(self._buckets) > MAX_SOURCES:
                self._buckets.popitem(last=False)
            self._failed += 1
            if len(self._addrs) < 1000:
                self._addrs.add(addr)
            self._maybe_log(now, addr)

    def retry_after(self, addr: str) -> int:
        """Seconds until ``addr`` may try again."""
        with self._lock:
            over = self._level(addr, self.clock()) + 1 - self.burst
            return max(1, int(over * self.refill_s + 0.999))

    def _maybe_log(self, now: float, addr: str) -> None:
        if self._last_log is not None and now - self._last_log < self.log_interval_s:
            return
        if self._last_log is None:
            log.warning("dashboard: failed token attempt from %s (further ones summarised every %d s)",
                        textsafe.term(addr), self.log_interval_s)
        else:
            log.warning("dashboard: %d failed token attempt(s) and %d refused unchecked (over %d per %d s) in "
                        "the last %d s from %d address(es), latest %s", self._failed, self._refused, self.burst,
                        int(self.burst * self.refill_s), int(now - self._last_log), len(self._addrs),
                        textsafe.term(addr))
        self._last_log = now
        self._failed = self._refused = 0
        self._addrs = set()
