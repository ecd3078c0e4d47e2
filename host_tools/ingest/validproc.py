"""Release validation, in a process of its own for the aggregator (``python -m host_tools.ingest.validproc``).

:func:`verdict` is the one validation step of the aggregator: decode and
check a message (host_tools.ingest.decode) and say ``("ok", state)`` (the
validated release without its payload: :meth:`Release.state`) or
``("rejected", code, reason)``. ``Aggregator.validate`` runs it in
process; ``pansketch aggregate`` runs it here, in a helper process
(host_tools/ingest/child.py), so that decoding does not compete with the writer
for the parent's GIL. The parent sends ``[(topic, payload), ...]`` and gets
the verdicts back in order; the payloads do not travel back (the parent
has them), so a verdict costs little to send.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from host_tools.ingest import child
from host_tools.ingest.decode import Rejected, decode

log = logging.getLogger("pansketch.aggregator")

Verdict = tuple  # ("ok", Release.state()) | ("rejected", code, reason)


@dataclass(frozen=True)
class Settings:
    fleet: Any  # hostconfig.FleetConfig: fleet-wide salt id, kind, d, w, mechanism
    max_bytes: int


def verdict(s: Settings, topic: Optional[str], payload: bytes) -> Verdict:
    """Validate one message (no storage); a validator bug becomes the rejection ``internal``."""
    try:
        try:
            rel = decode(payload, topic=topic, max_bytes=s.max_bytes, fleet=s.fleet)
        except Rejected:
            raise
        except Exception as exc:  # a validator bug must not turn one message into a crash loop
            log.exception("validating message on %s failed unexpectedly", topic)
            raise Rejected("internal", "validation failed unexpectedly: %s: %s" % (type(exc).__name__, exc))
    except Rejected as rej:
        return ("rejected", rej.code, rej.reason)
    return ("ok", rel.state())


class ValidatorDied(Exception):
    """The validation process is gone (nothing it was asked is lost: the messages are not acknowledged)."""


class ValidatorProcess:
    """The parent's handle: :meth:`validate` a batch in the helper process (one caller at a time)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.proc, self.conn = child.spawn("host_tools.ingest.validproc", self.settings)

    def validate(self, msgs: Sequence[tuple[str, bytes]]) -> list[Verdict]:
        """The verdicts for ``[(topic, payload), ...]``, in order; :class:`ValidatorDied` if the helper is gone."""
        assert self.proc is not None
        try:
            with self._lock:
                self.conn.send(list(msgs))
                out: list[Verdict] = self.conn.recv()
            return out
        except (EOFError, OSError):
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            raise self._died()

    def check(self) -> None:
        """Raise :class:`ValidatorDied` if the helper has exited (polled while no message comes)."""
        if self.proc is not None and self.proc.poll() is not None:
            raise self._died()

    def _died(self) -> ValidatorDied:
        assert self.proc is not None
        return ValidatorDied("the validation process (pid %d) exited unexpectedly (%s)"
                             % (self.proc.pid, child.exit_status(self.proc.returncode)))

    def close(self, timeout: float = 10.0) -> None:
        """Close our end (the helper exits on EOF) and wait for it."""
        if self.proc is None:
            return
        self.conn.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: Optional[list[str]] = None) -> int:
    """Helper entry point: answer batches until the parent closes its end."""
    try:
        conn, settings = child.attach(argv)
    except (EOFError, OSError):
        return 1
    assert isinstance(settings, Settings)
    child.log_to_stderr()
    while True:
        try:
            msgs = conn.recv()
        except (EOFError, OSError):
            return 0
        conn.send([verdict(settings, t, p) for t, p in msgs])


if __name__ == "__main__":
    from host_tools.ingest.validproc import main as _main  # the module proper, whose Settings the parent pickled

    sys.exit(_main())
