"""Event sources of the Pi daemon: stdin, a followed file, a local MQTT topic.

CPython only (threads, paho-mqtt, json): **not** part of the MicroPython
device core.

A source runs in its own thread and hands *batches* to the daemon through a
bounded queue: ``(items, weights)`` where ``weights`` is None when every
event has weight 1, and :data:`EOF` when a finite input ended. Only the
daemon's main thread touches the Recorder. A batch holds raw events for
the few milliseconds until it is counted into the noisy sketch; nothing
else keeps them, and sources keep no counters (docs/ARCHITECTURE.md: an intruder
reading memory must not learn exact counts). The reading loops drop their
references to the bytes just read (``del data, chunks``) before blocking
for more input, so the last lines are not kept alive while the input is
quiet. (CPython does not wipe freed memory: the bytes may remain in the
heap until reused. LimitCORE=0 in the systemd unit keeps them out of core
dumps.)

Line format (stdin and file): one item per line, UTF-8 text (invalid bytes
become U+FFFD), optionally followed by a TAB and an integer weight; the
last TAB separates the weight. Empty lines are ignored. Lines with a bad
weight are skipped with a rate-limited warning that does not echo the line.
"""

from __future__ import annotations

import json
import os
import queue
import select
import sys
import threading
import time
from typing import Any, Callable, Optional, Union

from pansketch.agent.pi.config import SourceConfig, field_path
from pansketch.agent.pi.memwipe import wipe_bytes

EOF = None  # end-of-input marker put on the queue


class SourceFailed:
    """Put on the queue when a source cannot go on (the daemon exits non-zero)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
Batch = tuple[list[Any], Optional[list[int]]]


class RawLines:
    """Complete input lines as read (``raw`` sources): the daemon's batch path
    (pansketch.agent.pi.batch.add_raw) splits, counts and hashes them in bulk, and parses
    them with :func:`parse_lines` only when they hold a TAB, a CR or non-ASCII
    bytes. At most CHUNK_LINES lines: the exposure window of one chunk."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


QueueItem = Union[Batch, RawLines, None, SourceFailed]

# Lines per chunk: the most raw lines (and so events) one add_many counts at once, and the most whose
# exact per-line totals exist at once (docs/PRIVACY.md "The intruder's view"; tests/test_feed_chunks.py
# states the bound). A chunk is cut after at most CHUNK_LINES newlines; the unfinished last line of an
# input (no newline before EOF) is a chunk of its own. Raw lines in flight are more: the daemon's queue
# (maxsize 8, agent/pi/daemon.py) plus the chunk being counted and the one the reader is putting.
CHUNK_LINES = 1 << 15
# Bytes per read (so at most this plus one unfinished line per chunk). A read returns what is
# available: a file gives READ_BYTES at once, a pipe what its buffer holds (64 KiB on Linux), to which
# the stdin reader adds what else is already waiting (no batching delay: it never waits for more).
READ_BYTES = 1 << 20


def split_lines(buf: bytes, most: int = CHUNK_LINES, n: int = -1) -> list[bytes]:
    """Complete lines ``buf`` (``n`` of them, -1: count them) cut at line ends into chunks of at
    most ``most`` lines each (in order)."""
    return [buf[a:b] for a, b, _ in _line_ranges(buf, 0, len(buf), most, n)]


def _line_ranges(buf: bytes, a: int, b: int, most: int, n: int = -1) -> list[tuple[int, int, int]]:
    """``buf[a:b]`` (complete lines) cut at line ends into (start, end, lines) ranges of at most
    ``most`` lines, by halving: index arithmetic, no copies."""
    if n < 0:
        n = buf.count(b"\n", a, b)
    if n <= most:
        return [(a, b, n)] if b > a else []
    mid = a + (b - a) // 2
    half = buf.rfind(b"\n", a, mid) + 1  # after a line end in the first half ...
    if half <= a:
        half = buf.find(b"\n", mid, b) + 1  # ... or the first one after it (a long first line)
    nh = buf.count(b"\n", a, half)
    return _line_ranges(buf, a, half, most, nh) + _line_ranges(buf, half, b, most, n - nh)


class Warner:
    """Rate-limited warnings (at most one per ``every`` seconds per kind)."""

    def __init__(self, log: Callable[[str], None], every: float = 60.0) -> None:
        self.log = log
        self.every = every
        self._last: dict[str, float] = {}

    def __call__(self, kind: str, msg: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is None or now - last >= self.every:
            self._last[kind] = now
            self.log(msg + " (similar warnings are suppressed for %d s)" % self.every)


def parse_lines(data: bytes, warn: Warner) -> Batch:
    """Parse complete lines (``data`` ends at a line boundary) into a batch."""
    text = data.decode("utf-8", "replace")
    if "\t" not in text:
        items: list[Any] = [x[:-1] if x.endswith("\r") else x for x in text.split("\n")]
        return [x for x in items if x], None
    items = []
    weights: list[int] = []
    for line in text.split("\n"):
        if line.endswith("\r"):
            line = line[:-1]
        if not line:
            continue
        if "\t" in line:
            item, ws = line.rsplit("\t", 1)
            try:
                wv = int(ws.strip())
            except ValueError:
                warn("weight", "skipped an input line: the text after its last TAB is not an integer weight")
                continue
        else:
            item, wv = line, 1
        items.append(item)
        weights.append(wv)
    return items, weights


class Source:
    """Base: a thread feeding batches into ``q``."""

    finite = False

    def __init__(self, q: "queue.Queue[QueueItem]", log: Callable[[str], None]) -> None:
        self.q = q
        self.log = log
        self.warn = Warner(log)
        self.stopping = threading.Event()
        self.ended = False  # a finite source has read the end of its input (what is left is queued or being put)
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name=type(self).__name__, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _main(self) -> None:
        try:
            self.run()
        except Exception as exc:  # report and stop the daemon rather than count nothing silently
            self.q.put(SourceFailed("%s: %s" % (type(exc).__name__, exc)))

    def run(self) -> None:
        raise NotImplementedError

    raw = False  # True: hand complete lines over unparsed (RawLines), for the cms/cs batch path

    def put(self, batch: Batch) -> None:
        if batch[0]:
            self.q.put(batch)

    def put_lines(self, data: bytes) -> None:
        """Hand over complete lines: as RawLines (``raw``) or parsed."""
        if self.raw:
            self.q.put(RawLines(data))
        else:
            self.put(parse_lines(data, self.warn))


MAX_LINE = READ_BYTES  # bytes of one input line before its newline; a longer line is skipped


class FdLineReader:
    """Split raw reads from a file descriptor into chunks of complete lines (:func:`split_lines`).

    The unfinished last line is carried over to the next read, up to MAX_LINE bytes: a line
    longer than that is skipped, with a rate-limited warning that names no content, and its
    bytes are dropped up to its newline (input without newlines costs bounded memory and time,
    not a buffer that grows and is copied on every read). Every read is at most READ_BYTES =
    MAX_LINE, so a line that starts and ends within one read is never too long."""

    def __init__(self, warn: Optional[Callable[[str, str], None]] = None) -> None:
        self.rest = b""
        self.skipping = False  # inside a line longer than MAX_LINE: drop bytes up to its newline
        self.warn = warn

    def _skip(self) -> None:
        self.rest = b""
        if self.warn is not None:
            self.warn("long", "skipped an input line longer than %d bytes" % MAX_LINE)

    def feed(self, data: bytes) -> list[bytes]:
        # Index arithmetic on ``data``: each chunk is copied out once (the carried-over line is
        # prepended to the first), instead of copying the whole read to join and to cut it.
        start = 0
        if self.skipping:
            nl = data.find(b"\n")
            if nl < 0:
                return []
            self.skipping = False
            start = nl + 1
        cut = data.rfind(b"\n", start) + 1  # after the read's last line end (0: none)
        rest = self.rest
        if not cut:
            if len(rest) + len(data) - start > MAX_LINE:
                self._skip()
                self.skipping = True
            else:
                self.rest = rest + data[start:]
            return []
        head = b""
        if rest:
            first = data.find(b"\n", start) + 1  # the carried-over line ends here
            if len(rest) + first - 1 - start > MAX_LINE:
                self._skip()
            else:
                head = rest + data[start:first]
            start = first
        self.rest = data[cut:]
        if len(self.rest) > MAX_LINE:
            self._skip()
            self.skipping = True
        out = []
        for a, b, n in _line_ranges(data, start, cut, CHUNK_LINES):
            if head and n < CHUNK_LINES:
                out.append(head + data[a:b])
            else:
                if head:
                    out.append(head)  # the first range is full: the carried-over line goes alone
                out.append(data[a:b])
            head = b""
        if head:
            out.append(head)
        return out

    def tail(self) -> bytes:
        out, self.rest = self.rest, b""
        self.skipping = False
        return out


def _waiting(fd: int) -> bool:
    """True if a read of ``fd`` would not block now (more input, or its end)."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # not pollable here: hand over what was read
        return False


def read_available(fd: int) -> tuple[bytes, bool]:
    """One read of up to READ_BYTES (blocking until there is input), plus what else is already
    waiting in a pipe, up to READ_BYTES in all. Returns (data, at_end): ``at_end`` when the input
    ended (``data`` may still hold its last bytes)."""
    data = os.read(fd, READ_BYTES)
    if not data:
        return data, True
    if len(data) >= READ_BYTES or not _waiting(fd):
        return data, False
    parts = [data]
    have = len(data)
    at_end = False
    while have < READ_BYTES:
        more = os.read(fd, READ_BYTES - have)
        if not more:
            at_end = True
            break
        parts.append(more)
        have += len(more)
        if not _waiting(fd):
            break
    data = b"".join(parts)
    for p in parts:
        if p is not data:  # (the join of one part is that part)
            wipe_bytes(p)  # copied into data
    del parts, p
    return data, at_end


def _drop_read(data: bytes, chunks: list[bytes], reader: "FdLineReader") -> None:
    """Zero a read once it is cut into chunks (they are copies, agent.memwipe.wipe_bytes),
    unless a chunk or the reader's carried-over line is the read itself (CPython returns the
    same object for a whole-range slice and for ``b"" + data``)."""
    if reader.rest is data:
        return
    for c in chunks:
        if c is data:
            return
    wipe_bytes(data)


class StdinSource(Source):
    """Standard input until EOF (``feed``, or ``run`` with source.type = 'stdin')."""

    finite = True

    def __init__(self, q: "queue.Queue[QueueItem]", log: Callable[[str], None], fd: Optional[int] = None) -> None:
        Source.__init__(self, q, log)
        self.fd = sys.stdin.fileno() if fd is None else fd
        self.reader: Optional[FdLineReader] = None
        self.at_end = False

    def resume(self, reader: FdLineReader, at_end: bool) -> None:
        """Go on from a reader that already took the input's start (``feed --jobs``, pansketch.agent.pi.countworker.Early)."""
        self.reader = reader
        self.at_end = self.ended = at_end

    def run(self) -> None:
        rd = self.reader if self.reader is not None else FdLineReader(self.warn)
        at_end = self.at_end
        while not at_end and not self.stopping.is_set():
            data, at_end = read_available(self.fd)  # what is available now: no batching delay
            self.ended = at_end
            chunks = rd.feed(data)
            _drop_read(data, chunks, rd)
            del data
            while chunks:
                self.put_lines(chunks.pop(0))
            del chunks  # do not hold the last lines while blocked in the next read
        tail = rd.tail()
        if tail:
            self.put_lines(tail)
        self.q.put(EOF)


class FileSource(Source):
    """A file, read once or followed like ``tail -F`` (rotation and truncation aware).

    Following starts at the end of the file unless ``from_start``; the read
    position is not persisted (it would be an event count), so lines
    written while the agent is stopped are not counted.
    """

    POLL_S = 0.2

    def __init__(self, q: "queue.Queue[QueueItem]", log: Callable[[str], None], cfg: SourceConfig) -> None:
        Source.__init__(self, q, log)
        assert cfg.path is not None
        self.path = cfg.path
        self.follow = cfg.follow
        self.from_start = cfg.from_start
        self.finite = not cfg.follow

    def _open(self, at_end: bool) -> Optional[tuple[int, os.stat_result]]:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            self.warn("open", "cannot open %s: %s; retrying" % (self.path, exc.strerror))
            return None
        st = os.fstat(fd)
        if at_end:
            os.lseek(fd, 0, os.SEEK_END)
        return fd, st

    def run(self) -> None:
        if not self.follow:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except OSError as exc:
                raise OSError("cannot open %s: %s" % (self.path, exc.strerror))
            rd = FdLineReader(self.warn)
            try:
                while not self.stopping.is_set():
                    data = os.read(fd, READ_BYTES)
                    if not data:
                        break
                    chunks = rd.feed(data)
                    _drop_read(data, chunks, rd)
                    del data
                    while chunks:
                        self.put_lines(chunks.pop(0))
                    del chunks
            finally:
                os.close(fd)
            tail = rd.tail()
            if tail:
                self.put_lines(tail)
            self.q.put(EOF)
            return
        opened = None
        first = True
        while opened is None and not self.stopping.is_set():
            opened = self._open(at_end=first and not self.from_start)
            if opened is None:
                first = False  # a file that appears later is read from its start
                self.stopping.wait(self.POLL_S * 5)
        if opened is None:
            return
        fd, st = opened
        rd = FdLineReader(self.warn)
        pos = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            while not self.stopping.is_set():
                data = os.read(fd, READ_BYTES)
                if data:
                    pos += len(data)
                    chunks = rd.feed(data)
                    _drop_read(data, chunks, rd)
                    del data
                    while chunks:
                        self.put_lines(chunks.pop(0))
                    del chunks  # nothing read stays referenced while following
                    continue
                # at EOF: rotated (new inode) or truncated?
                try:
                    cur = os.stat(self.path)
                except OSError:
                    cur = None
                if cur is not None and (cur.st_ino != st.st_ino or cur.st_dev != st.st_dev):
                    rest = rd.tail()
                    if rest:
                        self.put_lines(rest)
                    del rest
                    os.close(fd)
                    reopened = self._open(at_end=False)
                    while reopened is None and not self.stopping.is_set():
                        self.stopping.wait(self.POLL_S)
                        reopened = self._open(at_end=False)
                    if reopened is None:
                        return
                    fd, st = reopened
                    pos = 0
                    continue
                if cur is not None and cur.st_size < pos:
                    self.log("%s was truncated; reading it from the start" % self.path)
                    os.lseek(fd, 0, os.SEEK_SET)
                    pos = 0
                    rd.tail()
                    continue
                self.stopping.wait(self.POLL_S)
        finally:
            try:
                os.close(fd)
            except OSError:
                pass


def extract(obj: dict[str, Any], path: list[str]) -> Any:
    """Follow a field path (from :func:`pansketch.agent.pi.config.field_path`); KeyError if absent."""
    cur: Any = obj
    for i, p in enumerate(path):
        if i == 1 and path[0] == "topic":
            levels = cur.split("/")
            try:
                return levels[int(p)]
            except (ValueError, IndexError):
                raise KeyError(p)
        if isinstance(cur, dict):
            cur = cur[p]
        elif isinstance(cur, list):
            try:
                cur = cur[int(p)]
            except (ValueError, IndexError):
                raise KeyError(p)
        else:
            raise KeyError(p)
    return cur


def as_item(v: Any) -> Optional[str]:
    """JSON value -> item text (numbers as their decimal text); None if unusable."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    return None


class MqttSource(Source):
    """Raw readings from a *local* MQTT broker (Tasmota / Zigbee2MQTT style).

    Each message on ``topic`` becomes the object ``{"topic": t, "payload": p}``
    (p = the JSON-decoded payload, or its text if it is not JSON); ``field``
    selects the item (a JSON list gives one event per element) and
    ``weight_field`` the optional integer weight. Messages without the field
    are ignored: such brokers also carry state, LWT and other traffic.
    """

    def __init__(self, q: "queue.Queue[QueueItem]", log: Callable[[str], None], cfg: SourceConfig, client_id: str) -> None:
        Source.__init__(self, q, log)
        self.cfg = cfg
        self.client_id = client_id
        self.fpath = field_path(cfg.field, "source.field")
        self.wpath = field_path(cfg.weight_field, "source.weight_field") if cfg.weight_field else None
        self.client: Any = None

    def handle(self, topic: str, payload: bytes) -> Optional[Batch]:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            self.warn("utf8", "ignored a message on %s that is not UTF-8" % topic)
            return None
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = text
        obj = {"topic": topic, "payload": body}
        try:
            v = extract(obj, self.fpath)
        except (KeyError, TypeError):
            return None
        w = 1
        if self.wpath is not None:
            try:
                wv = extract(obj, self.wpath)
            except (KeyError, TypeError):
                wv = None
            if isinstance(wv, float) and wv.is_integer():
                wv = int(wv)
            if isinstance(wv, bool) or not isinstance(wv, int):
                self.warn("weight", "ignored a message on %s: %s is not an integer" % (topic, self.cfg.weight_field))
                return None
            w = wv
        vals = v if isinstance(v, list) else [v]
        items = []
        for x in vals:
            it = as_item(x)
            if it is None:
                self.warn("item", "ignored a value of %s on %s that is not text or a number" % (self.cfg.field, topic))
                continue
            items.append(it)
        if not items:
            return None
        return items, (None if w == 1 else [w] * len(items))

    def run(self) -> None:
        import paho.mqtt.client as mqtt

        cfg = self.cfg
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id)
        if cfg.username:
            c.username_pw_set(cfg.username, cfg.password)
        if cfg.tls is not None:
            c.tls_set(ca_certs=cfg.tls.ca, certfile=cfg.tls.cert, keyfile=cfg.tls.key)
        c.reconnect_delay_set(1, 30)

        def on_connect(client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
            if rc.is_failure:
                self.warn("connect", "local broker %s:%d refused the source connection: %s" % (cfg.host, cfg.port, rc))
                return
            client.subscribe(cfg.topic, qos=cfg.qos)
            self.log("source subscribed to %s on %s:%d" % (cfg.topic, cfg.host, cfg.port))

        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            payload = msg.payload
            b = self.handle(msg.topic, payload)
            # paho made this object for this message and drops it once this returns (a QoS 2
            # message is delivered once, at its PUBREL): zeroed now rather than at the next scrub.
            # Its other copies (the socket read, the packet bytearray, struct.unpack's pieces, the
            # topic) are paho's, freed within this read: the scrub and M_PERTURB reach those.
            wipe_bytes(payload)
            del payload
            if b is not None:
                self.q.put(b)

        def on_connect_fail(client: Any, userdata: Any) -> None:
            # paho calls neither on_connect nor on_disconnect when the TCP connect itself fails
            # (broker down, wrong port): without this the agent would count nothing, silently.
            self.warn("connect", "cannot connect to the local source broker %s:%d (is it running?); "
                      "counting nothing until it answers, retrying" % (cfg.host, cfg.port))

        def on_disconnect(client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
            if not self.stopping.is_set():
                self.warn("disconnect", "lost the local source broker %s:%d (%s); reconnecting"
                          % (cfg.host, cfg.port, rc))

        c.on_connect = on_connect
        c.on_message = on_message
        c.on_connect_fail = on_connect_fail
        c.on_disconnect = on_disconnect
        self.client = c
        c.connect_async(cfg.host, cfg.port, keepalive=60)
        c.loop_start()
        self.stopping.wait()
        c.disconnect()
        c.loop_stop()


def make_source(cfg: SourceConfig, q: "queue.Queue[QueueItem]", log: Callable[[str], None], client_id: str) -> Source:
    if cfg.type == "stdin":
        return StdinSource(q, log)
    if cfg.type == "file":
        return FileSource(q, log, cfg)
    if cfg.type == "mqtt":
        return MqttSource(q, log, cfg, client_id)
    raise ValueError("unknown source type %r" % cfg.type)
