"""The aggregator's handle on its MQTT process (:class:`MQTTProcess`): start it, acknowledge through it,
restart it when a message killed it, stop it. The process itself, and the protocol between the two, is
pansketch.host_tools.ingest.mqttproc."""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import signal
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from pansketch.host_tools.ingest import child
from pansketch.host_tools.ingest.mqttshared import (GEN_SHIFT, POISON_DEATHS, POISON_MAX, WATCH_SIZE, Msg, Settings,
                                          read_watch)

log = logging.getLogger("pansketch.aggregator")


class MQTTProcess:
    """The parent's handle on the transport child: start it, acknowledge through it, stop it.

    ``on_messages`` gets each batch of :class:`Msg` and ``on_event`` each
    connection event (docstring above), both on a receiver thread;
    ``on_event(("exited", returncode))`` when the child's end closes
    without :meth:`close` having been called, except when it died while
    validating a message (:class:`_Judge`): then that message is remembered
    (``poison``), the child restarted, and ``on_event(("restarted", why))``.
    Five such deaths in a row that are not CPU timeouts are an exit. A
    child that validates one message for longer than a wall-clock backstop
    (10 s + 4 budgets) without the CPU timer firing is killed (a timeout).

    ``Msg.mid`` carries the child's generation: after a restart, the
    acknowledgements of what the dead child received are dropped (with a
    clean session its packet ids mean other messages now; the broker
    redelivers, or the devices re-send, what was not acknowledged, and
    storing is idempotent). It also carries the child's connection to the
    broker (bits 16..31, :func:`serve`): the child drops acknowledgements of
    what it received before it reconnected, for the same reason.
    """

    MAX_RESTARTS = 5  # deaths in a row while validating that were not CPU timeouts

    def __init__(self, settings: Settings, on_messages: Callable[[list[Msg]], None],
                 on_event: Callable[[tuple[Any, ...]], None]) -> None:
        self.settings = settings
        self.on_messages = on_messages
        self.on_event = on_event
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.conn: Optional[Connection] = None
        self._send_lock = threading.Lock()
        self._closing = False
        self._lost_logged = False
        self._reader: Optional[threading.Thread] = None
        self.cpu_s = 0.0  # CPU time of the reader thread spent receiving message batches (stage timer)
        self.gen = 0  # children started so far (Msg.mid's high bits)
        self.restarts = 0  # child restarts after a death while validating
        self.timeouts = 0  # messages refused with code 'timeout' (after their second death)
        self._deaths = 0  # deaths while validating in a row that were not CPU timeouts
        self.poison: dict[bytes, tuple[int, str]] = {}  # message key -> (deaths, code)
        self._watch_path: Optional[str] = None
        self._mm: Any = None
        self._backstop_killed = False

    def start(self) -> None:
        if self.settings.validation is not None:
            fd, self._watch_path = tempfile.mkstemp(prefix="pansketch-mqtt-watch-",
                                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.ftruncate(fd, WATCH_SIZE)
            self._mm = mmap.mmap(fd, WATCH_SIZE)
            os.close(fd)
        self._spawn()
        self._reader = threading.Thread(target=self._read_loop, name="pansketch-mqtt-reader", daemon=True)
        self._reader.start()
        if self._mm is not None:
            threading.Thread(target=self._backstop, name="pansketch-mqtt-backstop", daemon=True).start()

    def _spawn(self) -> bool:
        """Start a child (False, and none started, once :meth:`close` was called after the first).

        All under the lock acknowledgements are sent under: the old end is closed here, so no
        acknowledgement is being written to it (its descriptor number may be the new socket's), and
        close() either stops the new child or sees that none was started."""
        s = dataclasses.replace(self.settings, watch=self._watch_path,
                                poison=tuple((k, n, c) for k, (n, c) in self.poison.items()))
        with self._send_lock:
            if self._closing and self.proc is not None:
                return False
            if self.conn is not None:
                try:
                    self.conn.close()
                except OSError:
                    pass
            if self._mm is not None:
                self._mm[:WATCH_SIZE] = bytes(WATCH_SIZE)
            proc, conn = child.spawn("pansketch.host_tools.ingest.mqttproc", s)
            self.gen += 1
            self.proc, self.conn = proc, conn
            self._backstop_killed = False
        return True

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def acknowledge(self, acks: list[tuple[int, int]], publishes: list[tuple[str, bytes]]) -> None:
        """PUBACK ``(mid, qos)`` pairs, then publish ``(topic, payload)`` at QoS 1 (after a commit).

        Acknowledgements of messages a dead child received are dropped (see the class docstring)."""
        with self._send_lock:
            g = self.gen
            mask = (1 << GEN_SHIFT) - 1
            acks = [(mid & mask, q) for mid, q in acks if mid >> GEN_SHIFT == g]
            if acks or publishes:
                self._send_locked(("ack", acks, publishes))

    def ack(self, mid: int, qos: int) -> None:
        """paho's ``Client.ack``, for pansketch.host_tools.ingest.devstatus."""
        self.acknowledge([(mid, qos)], [])

    def close(self, timeout: float = 10.0) -> Optional[int]:
        """Tell the child to disconnect (after what was sent before) and wait; its exit code."""
        self._closing = True
        if self.proc is None:
            return None
        with self._send_lock:
            self._send_locked(("stop",))
            proc = self.proc
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("MQTT process %d did not stop within %.0f s; killing it", proc.pid, timeout)
            proc.kill()
            rc = proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self.conn is not None:
            self.conn.close()
        if self._watch_path is not None:
            try:
                os.unlink(self._watch_path)
            except OSError:
                pass
        return rc

    def _send_locked(self, obj: Any) -> None:
        assert self.conn is not None
        try:
            self.conn.send(obj)
        except OSError as exc:  # the child is gone; the reader reports it, the broker redelivers
            if not self._lost_logged:
                self._lost_logged = True
                log.warning("cannot reach the MQTT process: %s", exc)

    def _backstop(self) -> None:
        """Kill a child that has been validating one message for longer than the wall-clock backstop."""
        assert self._mm is not None
        limit = 10.0 + 4.0 * float(self.settings.validation.cpu_s)
        last, since = -1, time.monotonic()
        last_proc: Any = None
        while not self._closing:
            time.sleep(0.25)
            proc = self.proc  # before the watch: a restart clears the watch, then replaces the process
            w = read_watch(self._mm)
            now = time.monotonic()
            if not w.validating or w.counter != last or proc is not last_proc:
                last, since, last_proc = w.counter if w.validating else -1, now, proc
                continue
            if now - since > limit and proc is not None:
                with self._send_lock:  # the lock _spawn replaces the process under: never a successor
                    p: subprocess.Popen[bytes] = proc
                    if p is not self.proc or p.poll() is not None:
                        continue
                    log.error("MQTT process %d has been validating one message for %.0f s; killing it",
                              p.pid, now - since)
                    self._backstop_killed = True
                    p.kill()
                last, since = -1, now

    def _read_loop(self) -> None:
        rbuf: Optional[bytearray] = None
        while True:
            assert self.conn is not None and self.proc is not None
            conn, gen = self.conn, self.gen << GEN_SHIFT
            try:
                t0 = time.thread_time()
                fr = child.recv_frame(conn, rbuf)
            except (EOFError, OSError, ValueError):
                if self._closing or not self._died_validating():
                    break
                rbuf = None
                continue
            rbuf = fr.buf
            try:
                if fr.batch:
                    # bytes from here on (the store keeps them): the one copy out of the received frame,
                    # whose buffer is reused for the next batch
                    msgs = [Msg(m[0], v.tobytes(), gen | m[2], m[3], m[4]) for m, v in zip(fr.obj, fr.payloads)]
                    del fr
                    self.cpu_s += time.thread_time() - t0
                    self.on_messages(msgs)
                else:
                    self.on_event(fr.obj)
            except Exception:  # a bug in one handler must not stop every later message
                log.exception("handling a message from the MQTT process failed")
        if not self._closing:
            assert self.proc is not None
            try:
                rc: Optional[int] = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                rc = None
            self.on_event(("exited", rc))

    def _died_validating(self) -> bool:
        """The child's end closed: if it died while validating a message, remember the message and start
        a new child (True); otherwise False (the aggregator stops)."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return False
        if self._mm is None or self._closing:
            return False
        w = read_watch(self._mm)
        if not w.validating:
            return False
        timeout = rc == -signal.SIGPROF or self._backstop_killed
        if not timeout:
            self._deaths += 1
            if self._deaths >= self.MAX_RESTARTS:
                return False
        else:
            self._deaths = 0
        code = "timeout" if timeout else "internal"
        n = self.poison.pop(w.key, (0, code))[0] + 1
        if len(self.poison) >= POISON_MAX:
            self.poison.pop(next(iter(self.poison)))
        self.poison[w.key] = (n, code)
        if n >= POISON_DEATHS and timeout:
            self.timeouts += 1
        what = ("took more than %g s of CPU" % self.settings.validation.cpu_s if timeout
                else "crashed it (%s)" % child.exit_status(rc))
        log.warning("validating a message on %s (%d bytes) in the MQTT process %d %s; restarting it (%s)",
                    w.topic[:200], w.size, self.proc.pid, what,
                    "refused as %s when it comes again" % code if n >= POISON_DEATHS
                    else "validated once more when it comes again")
        if not self._spawn():  # stopping meanwhile
            return False
        self.restarts += 1
        self.on_event(("restarted", what))
        return True
