"""Helper processes of the aggregator: started with ``python -m <module> FD``, one socket pair each.

The aggregator keeps validation and the MQTT client out of the process
that stores, so that their CPU work does not compete with the writer for
the GIL (docs/PERFORMANCE-HISTORY.md). Each helper is a plain
``python -m host_tools.<module>`` process (no fork of a threaded parent);
it talks to the aggregator over a socket pair with pickled objects framed
by :class:`multiprocessing.connection.Connection`. The first object the
parent sends is the helper's settings.

Helpers ignore SIGINT and SIGTERM (Ctrl-C and systemd signal the whole
process group; the parent decides when they stop, after draining) and exit
when the parent's end of the socket closes. A helper busy in C code reads
no socket, so on Linux each one also asks the kernel for SIGKILL when its
parent dies (``prctl(PR_SET_PDEATHSIG)``), and checks it was not orphaned
before that took effect: a ``kill -9`` of the aggregator never leaves a
helper behind, spinning or not.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple, NoReturn, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn(module: str, settings: Any) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start ``python -m module FD`` and send it ``settings``; the process and our end of the socket pair."""
    mine, theirs = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # this checkout, not another install
    env["PANSKETCH_PARENT_PID"] = str(os.getpid())
    with theirs:
        proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                env=env, stdin=subprocess.DEVNULL)
    conn = Connection(mine.detach())
    conn.send(settings)
    return proc, conn


IOV_BATCH = 512  # buffers per writev (Linux IOV_MAX is 1024)
BATCH = 0x50  # first byte of a batch frame ("P"); a pickled object starts with 0x80 (protocol 2 and up)


def send_batch(conn: Connection, meta: list[tuple[Any, ...]], payloads: list[Any]) -> None:
    """Send a batch of messages as one frame: ``meta`` (one tuple per message, its size at index 1) and the
    payloads (bytes-like), read with :func:`recv_frame`.

    Message bytes are not pickled, nor joined into one copy: the frame
    (:class:`Connection`'s framing: a 4-byte length, or -1 and an 8-byte
    one; then the marker byte, the pickled ``meta`` with its length, the
    payloads back to back) goes out in one ``writev`` straight from the
    messages, and the reader receives it into one buffer. (A pickled list
    of bytes costs a copy per message on each side, and more in
    Connection's reassembly.) One frame per batch, as many system calls as
    ``Connection.send``: batches of one or two messages cost no more than
    before.
    """
    hdr = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    n = 5 + len(hdr) + sum(len(p) for p in payloads)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    bufs: list[Any] = [head + struct.pack("!BI", BATCH, len(hdr)) + hdr] + [p for p in payloads if len(p)]
    fd = conn.fileno()
    i = 0
    while i < len(bufs):
        k = os.writev(fd, bufs[i:i + IOV_BATCH])
        while k > 0:  # drop what was written; a partly written buffer goes on from where it stopped
            m = len(bufs[i])
            if k >= m:
                k -= m
                i += 1
            else:
                bufs[i] = memoryview(bufs[i])[k:]
                k = 0


class Frame(NamedTuple):
    """What :func:`recv_frame` read: a pickled object (``batch`` False: ``obj``), or a batch (``obj`` = its
    meta list, ``payloads`` = a view of each message's bytes in ``buf``)."""

    batch: bool
    obj: Any
    payloads: list[memoryview]
    buf: bytearray


def recv_frame(conn: Connection, buf: Optional[bytearray] = None) -> Frame:
    """The next frame from ``conn``: an object sent with ``Connection.send`` or a batch from :func:`send_batch`.

    The frame is read straight into ``buf`` when it is large enough (a new
    buffer otherwise; never resized, so views of an earlier frame cannot
    stop it; pass the returned ``buf`` back next time), so a batch's views
    stay valid until the buffer is reused. EOFError when the peer is gone;
    ValueError for a batch whose sizes do not add up (a protocol error).
    """
    fd = conn.fileno()
    n = struct.unpack("!i", _read_exact(fd, 4))[0]
    if n == -1:
        n = struct.unpack("!Q", _read_exact(fd, 8))[0]
    if buf is None or len(buf) < n:
        buf = bytearray(n if buf is None else max(n, 2 * len(buf)))
    mv = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [mv[got:n]])
        if k == 0:
            raise EOFError("peer closed the connection in a frame")
        got += k
    if n == 0 or mv[0] != BATCH:
        return Frame(False, pickle.loads(mv[:n]), [], buf)
    hl = struct.unpack_from("!I", mv, 1)[0]
    meta = pickle.loads(mv[5:5 + hl])
    off = 5 + hl
    out = []
    for m in meta:
        out.append(mv[off:off + m[1]])
        off += m[1]
    if off != n:
        raise ValueError("batch frame of %d bytes for messages of %d bytes" % (n - 5 - hl, off - 5 - hl))
    return Frame(True, meta, out, buf)


def _read_exact(fd: int, n: int) -> bytes:
    b = b""
    while len(b) < n:
        chunk = os.read(fd, n - len(b))
        if not chunk:
            raise EOFError("peer closed the connection")
        b += chunk
    return b


PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Linux: SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG); False where unsupported.

    The kernel sends the signal when the parent *thread* that forked us
    exits; the aggregator spawns helpers from threads that live as long as
    it runs (its main thread, or the validator thread for a restart).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return True


def attach(argv: Optional[list[str]] = None) -> tuple[Connection, Any]:
    """In the helper: its connection to the parent and the settings sent first (EOFError: parent gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.environ.get("PANSKETCH_PARENT_PID")
    die_with_parent()
    if parent is not None and str(os.getppid()) != parent:  # the parent died before prctl took effect
        raise EOFError("parent process %s is gone" % parent)
    args = sys.argv[1:] if argv is None else argv
    conn = Connection(int(args[0]))
    return conn, conn.recv()


def helper_main(serve: Callable[[Connection, Any], int], settings_type: type, argv: Optional[list[str]] = None,
                log_level: Callable[[Any], Optional[int]] = lambda _s: None) -> int:
    """The entry point of every helper process: attach to the parent (:func:`attach`; exit 1 if it is
    gone), check the settings it sent are a ``settings_type``, log to stderr at ``log_level(settings)``
    (None: the logger's default), then ``serve(conn, settings)`` (its return value is the exit code)."""
    try:
        conn, settings = attach(argv)
    except (EOFError, OSError):
        return 1
    assert isinstance(settings, settings_type)
    log_to_stderr(log_level(settings))
    return serve(conn, settings)


def run_as_main(module: str) -> NoReturn:
    """A helper module's ``if __name__ == "__main__"``: run ``module.main`` from the module proper, not
    from this ``__main__`` copy of it, whose classes are not the ones the parent pickled."""
    sys.exit(importlib.import_module(module).main())


def exit_status(rc: Optional[int]) -> str:
    """``exit code 1``, ``killed by SIGKILL``, or ``still running``."""
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return "killed by %s" % signal.Signals(-rc).name
        except ValueError:
            return "killed by signal %d" % -rc
    return "exit code %d" % rc


STAGES_LINE = "CPU per message in the %s process (us): "


def log_stage_cpu(role: str, cpu: dict[str, float], messages: int) -> None:
    """One line at exit, also under -q: this process's CPU seconds per stage, as microseconds per message
    (the host benchmark reads it: where a release's cost goes). ``PANSKETCH_STAGE_CPU=0`` in the
    environment leaves it out (the demo, whose terminal is the user's)."""
    if messages <= 0 or os.environ.get("PANSKETCH_STAGE_CPU") == "0":
        return
    import json

    summary = logging.getLogger("pansketch.aggregator.summary")
    summary.setLevel(logging.INFO)
    summary.info("%s%s", STAGES_LINE % role,
                 json.dumps({k: round(v / messages * 1e6, 1) for k, v in sorted(cpu.items())}))


def log_to_stderr(level: Optional[int] = None) -> None:
    """A helper process's logging: the parent's line format on stderr (shared with the parent),
    under the ``pansketch`` logger; ``level`` None keeps the logger's default."""
    from pansketch.host_tools.output.textsafe import SafeFormatter  # messages quote device topics: escaped, one line each

    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(SafeFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger("pansketch")
    root.addHandler(h)
    if level is not None:
        root.setLevel(level)
