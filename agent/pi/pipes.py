"""Closed output pipes in the command-line entry points (CPython only).

``pansketch status | head -1``: once ``head`` has its line it closes the
pipe, and the next write to stdout raises :class:`BrokenPipeError`.
:func:`run_main` turns that into a quiet exit with status 141 (128 +
SIGPIPE, what the shell reports for a tool killed by SIGPIPE) instead of a
traceback. SIGPIPE itself stays ignored (Python's default): restoring its
default action would also kill a daemon whose MQTT socket breaks.

Only a broken *stdout* or *stderr* is treated this way; a BrokenPipeError
from anything else (a socket) still propagates.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from typing import Callable

EXIT_PIPE = 128 + int(getattr(signal, "SIGPIPE", 13))


def _broken(stream: object) -> bool:
    """True if the reader of this stream's pipe or socket has gone away."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
        p = select.poll()
        p.register(fd, 0)  # POLLERR/POLLHUP are always reported
        return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in p.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _silence(stream: object) -> None:
    """Point the stream's descriptor at /dev/null so the exit-time flush cannot fail loudly."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (AttributeError, OSError, ValueError):
        pass


def run_main(func: Callable[[], int]) -> int:
    """Run ``func`` (a command's body) and flush stdout; a closed stdout/stderr exits 141 quietly."""
    try:
        code = func()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        out, err = _broken(sys.stdout), _broken(sys.stderr)
        if not (out or err):
            raise
        if out:
            _silence(sys.stdout)
        if err:
            _silence(sys.stderr)
        return EXIT_PIPE
