"""The feed path's raw chunks: equal to the parsed batch path, and the exposure bound per chunk.

``pansketch-agent feed`` (and ``run`` with a stdin/file source) hands complete input lines to the
daemon as RawLines of at most READ_CHUNK bytes; agent.batch.add_raw counts one chunk into the noisy
sketch at once. docs/PRIVACY.md ("The intruder's view") bounds what exists un-noised at a time to
one chunk: its raw lines and, while add_raw runs, their exact per-line totals.
"""

from __future__ import annotations

import os
import queue
import threading

import pytest

from agent import hashing
from agent.batch import add_batch, add_raw
from agent.sketch import Sketch
from agent.sources import EOF, READ_CHUNK, RawLines, StdinSource, Warner, parse_lines

PREFIX = hashing.salt_prefix("fleet-salt-raw")
CHUNKS = [
    b"a\nb\na\n\n\nccc\n" * 50 + b"".join(b"dev-%05d\n" % (i % 777) for i in range(5000)),
    "café\nü-1\ncafé\n".encode() * 30,  # valid UTF-8: the bytes are the hash's canonical bytes
    b"caf\xe9\nok\n\xff\xfe\nok\n" * 20,  # invalid UTF-8: U+FFFD replacement, via parse_lines
    b"w1\t3\nw2\t-2\nw1\nbad\tx\nw3\t 9 \n" * 40,  # TAB weights (clipped), a bad weight skipped
    b"crlf\r\nlf\ncrlf\r\n" * 40,  # CR stripped
    b"\n\n\n",  # nothing
]


@pytest.mark.parametrize("kind,d,w", [("cms", 4, 2048), ("cs", 4, 512), ("cs", 9, 64), ("cms", 2, 33)])
def test_add_raw_equals_parsed_batch(kind, d, w):
    warn = Warner(lambda m: None)
    for data in CHUNKS:
        raw = Sketch(kind, d, w, PREFIX, clip=4)
        ref = Sketch(kind, d, w, PREFIX, clip=4)
        add_raw(raw, data, warn)
        items, weights = parse_lines(data, warn)
        for i, x in enumerate(items):  # the per-event device path
            ref.update(x, 1 if weights is None else weights[i])
        assert list(raw.counters) == list(ref.counters), data[:40]


def test_add_raw_into_every_tree_level():
    sk = Sketch("cs", 4, 128, PREFIX)
    levels = [sk.counters, type(sk.counters)("i", bytes(4 * 512)), type(sk.counters)("i", bytes(4 * 512))]
    sk.arrays = levels
    add_raw(sk, CHUNKS[0], Warner(lambda m: None))
    ref = Sketch("cs", 4, 128, PREFIX)
    add_batch(ref, *parse_lines(CHUNKS[0], Warner(lambda m: None)))
    for a in levels:
        assert list(a) == list(ref.counters)


def events_bound() -> int:
    """Most events one chunk can hold: READ_CHUNK bytes of the shortest non-empty line ("x\\n"),
    plus the one unfinished line carried over from the previous read."""
    return READ_CHUNK // 2 + 1


def test_a_chunk_never_holds_more_than_the_bound():
    r, w = os.pipe()
    q: "queue.Queue" = queue.Queue()
    src = StdinSource(q, lambda m: None, fd=r)
    src.raw = True
    src.start()
    payload = b"x\n" * (3 * READ_CHUNK) + b"y" * (2 * READ_CHUNK) + b"\n" + b"z\n" * READ_CHUNK

    def writer() -> None:
        for i in range(0, len(payload), 4093):  # odd-sized writes: lines split across reads
            os.write(w, payload[i:i + 4093])
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    chunks = []
    while True:
        b = q.get(timeout=10)
        if b is EOF:
            break
        assert type(b) is RawLines
        chunks.append(b.data)
    t.join()
    os.close(r)
    assert b"".join(chunks) == payload  # nothing lost or repeated
    assert len(chunks) > 3
    for c in chunks:
        assert c.endswith(b"\n")  # complete lines only
        events = len([x for x in c.split(b"\n") if x])
        assert events <= events_bound(), (events, events_bound())
    # chunks of the shortest lines come near the bound (a pipe read returns what is there)
    assert max(len([x for x in c.split(b"\n") if x]) for c in chunks) >= READ_CHUNK // 8
    assert READ_CHUNK <= 1 << 16, "docs/PRIVACY.md promises at most 64 KiB of lines per chunk"
