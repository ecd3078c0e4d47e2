"""Shared by tests/test_feed_chunks.py and the tests that build on it: CHUNKS."""

from __future__ import annotations



CHUNKS = [
    b"a\nb\na\n\n\nccc\n" * 50 + b"".join(b"dev-%05d\n" % (i % 777) for i in range(5000)),
    "café\nü-1\ncafé\n".encode() * 30,  # valid UTF-8: the bytes are the hash's canonical bytes
    b"caf\xe9\nok\n\xff\xfe\nok\n" * 20,  # invalid UTF-8: U+FFFD replacement, via parse_lines
    b"w1\t3\nw2\t-2\nw1\nbad\tx\nw3\t 9 \n" * 40,  # TAB weights (clipped), a bad weight skipped
    b"crlf\r\nlf\ncrlf\r\n" * 40,  # CR stripped
    b"\n\n\n",  # nothing
]
