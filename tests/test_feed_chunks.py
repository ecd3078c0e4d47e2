"""The feed path's raw chunks: equal to the parsed batch path, and the exposure bound per chunk.

``pansketch-agent feed`` (and ``run`` with a stdin/file source) hands complete input lines to the
daemon as RawLines of at most CHUNK_LINES lines; pansketch.agent.pi.batch.add_raw counts one chunk into the noisy
sketch at once. docs/PRIVACY.md ("The intruder's view") bounds what exists un-noised at a time to
one chunk: its raw lines and, while add_raw runs, their exact per-line totals.
"""

from __future__ import annotations

import os
import queue
import threading

import pytest

from pansketch.agent import hashing
from pansketch.agent.pi.batch import add_batch, add_raw
from pansketch.agent.sketch import Sketch
from pansketch.agent.pi.sources import CHUNK_LINES, EOF, READ_BYTES, RawLines, StdinSource, Warner, parse_lines, split_lines
from tests.support.feed_chunks import CHUNKS

PREFIX = hashing.salt_prefix("fleet-salt-raw")


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
    """Most events one chunk can hold: CHUNK_LINES newline-terminated lines (the unfinished last
    line of an input, with no newline before its end, is a chunk of its own: one event)."""
    return CHUNK_LINES


def _chunks_of(fd: int) -> list:
    q: "queue.Queue" = queue.Queue()
    src = StdinSource(q, lambda m: None, fd=fd)
    src.raw = True
    src.start()
    chunks = []
    while True:
        b = q.get(timeout=20)
        if b is EOF:
            break
        assert type(b) is RawLines
        chunks.append(b.data)
    return chunks


def _check_bound(chunks: list, payload: bytes) -> None:
    assert b"".join(chunks) == payload  # nothing lost or repeated
    for c in chunks[:-1] if not payload.endswith(b"\n") else chunks:
        assert c.endswith(b"\n")  # complete lines only (but an unfinished last line at the end)
    for c in chunks:
        events = len([x for x in c.split(b"\n") if x])
        assert events <= events_bound(), (events, events_bound())
        assert c.count(b"\n") <= CHUNK_LINES


def test_a_chunk_never_holds_more_than_the_bound():
    """Through a pipe, written in odd-sized pieces (lines split across reads)."""
    r, w = os.pipe()
    payload = b"x\n" * (3 * CHUNK_LINES) + b"y" * (2 * CHUNK_LINES) + b"\n" + b"z\n" * CHUNK_LINES + b"\n" * 70000 + b"end"

    def writer() -> None:
        for i in range(0, len(payload), 4093):
            os.write(w, payload[i:i + 4093])
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    chunks = _chunks_of(r)
    t.join()
    os.close(r)
    _check_bound(chunks, payload)
    assert len(chunks) > 3
    assert chunks[-1] == b"end"
    # chunks of the shortest lines come near the bound (a pipe read returns what is there)
    assert max(len([x for x in c.split(b"\n") if x]) for c in chunks) >= CHUNK_LINES // 8
    assert CHUNK_LINES <= 32768, "docs/PRIVACY.md promises at most 32,768 lines per chunk"


def test_a_file_on_stdin_comes_in_chunks_near_the_bound(tmp_path):
    """A regular file (``feed < events.txt``): reads of READ_BYTES, cut at line ends into chunks of
    at most CHUNK_LINES lines, and at least half that many while the input lasts."""
    payload = b"".join(b"dev-%06d\n" % (i % 5000) for i in range(5 * CHUNK_LINES)) + b"x\n" * (READ_BYTES // 2)
    path = tmp_path / "in.txt"
    path.write_bytes(payload)
    fd = os.open(str(path), os.O_RDONLY)
    try:
        chunks = _chunks_of(fd)
    finally:
        os.close(fd)
    _check_bound(chunks, payload)
    sizes = [c.count(b"\n") for c in chunks]
    assert max(sizes) == CHUNK_LINES or min(sizes[:-2]) >= CHUNK_LINES // 2, sizes


@pytest.mark.parametrize("seed", range(5))
def test_split_lines_cuts_at_line_ends_within_the_bound(seed):
    import random

    rnd = random.Random(seed)
    lines = [b"a" * rnd.choice((0, 0, 1, 3, 40, 900)) + b"\n" for _ in range(rnd.randrange(1, 4000))]
    buf = b"".join(lines)
    most = rnd.choice((1, 2, 7, 100, 5000))
    parts = split_lines(buf, most)
    assert b"".join(parts) == buf
    for p in parts:
        assert p.endswith(b"\n") and 1 <= p.count(b"\n") <= most
