"""Release validation, in a process of its own for the aggregator (``python -m pansketch.host_tools.ingest.validproc``).

:func:`verdict` is the one validation step of the aggregator: decode and
check a message (pansketch.host_tools.ingest.decode) and say ``("ok", state)`` (the
validated release without its payload: :meth:`Release.state`) or
``("rejected", code, reason, dev, seq)`` (``dev``/``seq``: what the
message's top-level map says, read by pansketch.host_tools.cborscan as far as its
bytes are well formed; for the device's acknowledgement and ``status``).
``Aggregator.validate`` runs it in process; with MQTT, ``pansketch
aggregate`` runs it in the MQTT process (pansketch.host_tools.ingest.mqttproc, with
the same CPU budget); with AMQP (pansketch.host_tools.ingest.amqp, whose client runs
in the aggregator's process) it runs here, in a helper process
(host_tools/ingest/child.py), so that decoding does not compete with the
writer for the parent's GIL. The parent sends
``[(topic, size), ...]`` and the payloads in one batch frame
(:func:`pansketch.host_tools.ingest.child.send_batch`), which the helper reads
into one reused buffer and validates in place (no pickling or copying of
message bytes); it gets the verdicts back in order. The payloads do not
travel back (the parent has them), so a verdict costs little to send.

CPU budget (``[aggregator] validate_cpu_s``, default 1 s; docs/HOST.md):
the helper arms ``ITIMER_PROF`` for each message, so a message that takes
more CPU time than that kills the helper with SIGPROF, even inside C code.
The parent then restarts the helper and validates that batch again one
message at a time; the message that kills the helper again is refused
with code ``timeout`` (it costs at most two budgets; a redelivery after a
restart is refused the same way). A helper that neither answers nor
burns CPU is killed after a wall-clock backstop. The byte-level reader
(pansketch.host_tools.cborscan) keeps every message far below the budget; the
budget is the guard for what nobody thought of.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional, Sequence, Union, cast

from pansketch.host_tools import cborscan
from pansketch.host_tools.ingest import child
from pansketch.host_tools.store import bounds
from pansketch.host_tools.ingest.decode import DEFAULT_TOPIC, Rejected, decode_state
from pansketch.host_tools.store.records import Release

log = logging.getLogger("pansketch.aggregator")

# ("ok", Release.state()) | ("ok", Release.state(), "bound", reason): valid, but over the fleet's contribution
# limit (pansketch.host_tools.store.bounds: quarantined and refused in the acknowledgement) | ("rejected", code, reason,
# dev, seq)
Verdict = tuple

DEFAULT_CPU_S = 1.0
MAX_RESTARTS = 5  # helper deaths in a row without one verdict (not a CPU timeout): the aggregator stops


@dataclass(frozen=True)
class Settings:
    fleet: Any  # hostconfig.FleetConfig: fleet-wide salt id, kind, d, w, mechanism
    max_bytes: int
    topic_filter: str = DEFAULT_TOPIC  # [aggregator] topic: a release topic must be exactly this
    cpu_s: float = DEFAULT_CPU_S  # per-message CPU budget in the helper
    spin_topic: Optional[str] = None  # tests only: a message on this topic spins the CPU (exercises the budget)


def rejected(code: str, reason: str, payload: Optional[bytes]) -> Verdict:
    """The verdict refusing ``payload``, with the ``dev`` and ``seq`` its well-formed prefix names."""
    dev, seq = cborscan.peek(payload)
    return ("rejected", code, reason, dev, seq)


def verdict(s: Settings, topic: Optional[str], payload: Union[bytes, memoryview], sha256: Optional[str] = None) -> Verdict:
    """Validate one message (no storage); a validator bug becomes the rejection ``internal``.

    ``payload`` may be a view into the helper's receive buffer (decode reads it in place); ``sha256``
    its SHA-256 in hex, if the caller has it."""
    if s.spin_topic is not None and topic == s.spin_topic:
        while True:  # a stand-in for a validation bug that never ends (tests/test_hostile.py)
            pass
    try:
        try:
            state = decode_state(cast(bytes, payload), topic=topic, max_bytes=s.max_bytes, fleet=s.fleet,
                                 topic_filter=s.topic_filter, sha256=sha256)
            # bounded influence: a valid release no device with max_events_per_window events could have
            # made (a few numpy passes over the counters, read in place)
            rel = Release.from_state(state, cast(bytes, payload))
            over = (bounds.check(rel, s.fleet.max_events(rel.kind), max_clip=s.fleet.max_clip) if s.fleet is not None
                    else bounds.check(rel, bounds.DEFAULT_MAX_EVENTS))
        except Rejected:
            raise
        except Exception as exc:  # a validator bug must not turn one message into a crash loop
            log.exception("validating message on %s failed unexpectedly", topic)
            raise Rejected("internal", "validation failed unexpectedly: %s: %s" % (type(exc).__name__, exc))
    except Rejected as rej:
        return rejected(rej.code, rej.reason, bytes(payload) if rej.code != "size" else None)
    if over is not None:
        return ("ok", state, over.code, over.reason)
    return ("ok", state)


class ValidatorDied(Exception):
    """The validation process is gone for good (nothing it was asked is lost: the messages are not acknowledged)."""


class ValidatorProcess:
    """The parent's handle: :meth:`validate` a batch in the helper process (one caller at a time).

    A helper that dies while validating is restarted and the batch
    validated again message by message; the message it dies on is refused
    (``timeout`` when the CPU budget or the wall-clock backstop killed it,
    ``internal`` otherwise). :class:`ValidatorDied` only when the helper
    dies :data:`MAX_RESTARTS` times in a row for other reasons, or when it
    exits while idle.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._lock = threading.Lock()
        self.closing = False
        self.restarts = 0  # helper restarts so far (timeouts and crashes)
        self.timeouts = 0  # messages refused with code 'timeout'
        self._deaths = 0  # deaths in a row that were not CPU timeouts

    def start(self) -> None:
        self.proc, self.conn = child.spawn("pansketch.host_tools.ingest.validproc", self.settings)

    def _wall_limit(self, n: int) -> float:
        """Backstop for a helper that stops answering without burning CPU (SIGPROF handles CPU)."""
        return 10.0 + 4.0 * self.settings.cpu_s * n

    def _ask(self, msgs: Sequence[tuple[str, bytes]]) -> Optional[list[Verdict]]:
        """The helper's verdicts, or None if it died (or was killed by the backstop) meanwhile."""
        assert self.proc is not None
        try:
            child.send_batch(self.conn, [(t, len(p)) for t, p in msgs], [p for _t, p in msgs])
            if not self.conn.poll(self._wall_limit(len(msgs))):
                log.error("validation process %d gave no verdict for %d message(s) within %.0f s; killing it",
                          self.proc.pid, len(msgs), self._wall_limit(len(msgs)))
                self.proc.kill()
                self.proc.wait()
                self.proc.returncode = -signal.SIGPROF  # treated as a timeout
                return None
            out: list[Verdict] = self.conn.recv()
            return out
        except (EOFError, OSError):
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            return None

    def _restart(self) -> None:
        assert self.proc is not None
        rc = self.proc.returncode
        try:
            self.conn.close()
        except OSError:
            pass
        if self.closing:
            raise ValidatorDied("the validation process was stopped")
        if rc != -signal.SIGPROF:
            self._deaths += 1
            if self._deaths >= MAX_RESTARTS:
                raise self._died()
        self.restarts += 1
        self.start()

    def validate(self, msgs: Sequence[tuple[str, bytes]]) -> list[Verdict]:
        """The verdicts for ``[(topic, payload), ...]``, in order; :class:`ValidatorDied` if the helper is gone."""
        with self._lock:
            return self._validate(list(msgs))

    def _validate(self, msgs: list[tuple[str, bytes]]) -> list[Verdict]:
        if not msgs:
            return []
        out = self._ask(msgs)
        if out is not None:
            self._deaths = 0
            return out
        assert self.proc is not None
        rc = self.proc.returncode
        if self.closing:
            raise ValidatorDied("the validation process was stopped")
        self._restart()
        if len(msgs) > 1:  # which one? again, one at a time
            return [v for m in msgs for v in self._validate([m])]
        topic, payload = msgs[0]
        if rc == -signal.SIGPROF:
            self.timeouts += 1
            log.warning("validating a message on %s (%d bytes) took more than %g s of CPU: refused (timeout), "
                        "validation process restarted", str(topic)[:200], len(payload), self.settings.cpu_s)
            # the dev and seq its bytes give, as every refusal names them where readable (the rejection
            # row, pansketch status); cborscan.peek is bounded on any bytes (Store.reject runs it here too)
            return [rejected("timeout", "validation took more than %g s of CPU (aggregator.validate_cpu_s)"
                             % self.settings.cpu_s, payload if len(payload) <= self.settings.max_bytes else None)]
        log.error("the validation process died on a message on %s (%s); refused, process restarted",
                  str(topic)[:200], child.exit_status(rc))
        return [rejected("internal", "the validation process died on this message (%s)" % child.exit_status(rc),
                         payload if len(payload) <= self.settings.max_bytes else None)]

    def check(self) -> None:
        """Raise :class:`ValidatorDied` if the helper has exited while idle (polled while no message comes)."""
        if not self._lock.acquire(blocking=False):
            return  # validating (and restarting if need be)
        try:
            if self.proc is not None and self.proc.poll() is not None:
                raise self._died()
        finally:
            self._lock.release()

    def _died(self) -> ValidatorDied:
        assert self.proc is not None
        return ValidatorDied("the validation process (pid %d) exited unexpectedly (%s)"
                             % (self.proc.pid, child.exit_status(self.proc.returncode)))

    def close(self, timeout: float = 2.0) -> None:
        """Close our end (the helper exits on EOF) and wait for it; kill it after ``timeout`` (it may be busy
        with a message, for at most its CPU budget: nothing it was validating is acknowledged)."""
        self.closing = True
        if self.proc is None:
            return
        try:
            self.conn.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: Optional[list[str]] = None) -> int:
    """Helper entry point: ``python -m pansketch.host_tools.ingest.validproc FD`` (FD: our end of the socket pair)."""
    return child.helper_main(serve, Settings, argv)


def serve(conn: Connection, settings: Settings) -> int:
    """The helper: answer batches until the parent closes its end (0)."""
    budget = float(settings.cpu_s)
    buf = bytearray()  # reused: the messages of one batch are validated in place, then dropped
    cpu = {"receive": 0.0, "validate": 0.0, "reply": 0.0}  # stage timers (thread CPU time, per batch)
    n = 0
    while True:
        try:
            t0 = time.thread_time()
            fr = child.recv_frame(conn, buf)
            buf, heads, views = fr.buf, fr.obj, fr.payloads
            del fr
        except (EOFError, OSError):
            child.log_stage_cpu("validation", cpu, n)
            return 0
        t1 = time.thread_time()
        out = []
        for (t, _n), p in zip(heads, views):
            # SIGPROF (default action: terminate) after `budget` s of this process's CPU time
            signal.setitimer(signal.ITIMER_PROF, budget)
            try:
                out.append(verdict(settings, t, p))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        del views  # the buffer is overwritten by the next batch
        t2 = time.thread_time()
        conn.send(out)
        n += len(out)
        cpu["receive"] += t1 - t0
        cpu["validate"] += t2 - t1
        cpu["reply"] += time.thread_time() - t2

if __name__ == "__main__":
    child.run_as_main("pansketch.host_tools.ingest.validproc")
