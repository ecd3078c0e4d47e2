"""pansketch.agent.pi.hashvec (numpy, the batch path and the host) against pansketch.agent.hashing.row_value /
row_sign (the scalar reference the boards run): the same column for every w and the same sign.

Streams: random bytes from a fixed seed, plus the words at the rule's edges (all bits set,
none, only bit 30, only bit 31, 2**30 - 1). w: every width from 1 to 1,100, every power of
two up to 2**32, and widths around 2**30 (where the power-of-two shortcut and the
"value below w" case take over)."""

from __future__ import annotations

import random
import struct

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.pi import hashvec

D = 8  # rows per stream: one SHA-256 block


def _streams() -> list[bytes]:
    rnd = random.Random(20261202)
    edges = [0xFFFFFFFF, 0, 1 << 30, 1 << 31, (1 << 30) - 1, (1 << 31) | ((1 << 30) - 1), 0x7FFFFFFF, 0xC0000000]
    out = [struct.pack("<8I", *edges)]
    out += [bytes(rnd.getrandbits(8) for _ in range(32)) for _ in range(160)]
    return out


STREAMS = _streams()
WIDTHS = (list(range(1, 1101)) + [1 << k for k in range(33)]
          + [(1 << 30) - 1, (1 << 30) + 1, (1 << 31) - 1, (1 << 31) + 7, (1 << 32) - 1, 3 * (1 << 28), 1000003])


def test_row_values_and_signs_match_the_reference():
    st = np.frombuffer(b"".join(STREAMS), dtype=np.uint8).reshape(len(STREAMS), 32)
    words = hashvec.row_words(st, D)
    assert words.shape == (len(STREAMS), D)
    ref_v = [[hashing.row_value(s, r) for r in range(D)] for s in STREAMS]
    ref_neg = [[hashing.row_sign(s, r) < 0 for r in range(D)] for s in STREAMS]
    assert hashvec.row_values(words).tolist() == ref_v
    assert (hashvec.negative(words) != 0).tolist() == ref_neg
    assert max(max(r) for r in ref_v) == (1 << 30) - 1 and min(min(r) for r in ref_v) == 0  # the edges are in


def test_columns_match_the_reference_for_every_width():
    st = np.frombuffer(b"".join(STREAMS), dtype=np.uint8).reshape(len(STREAMS), 32)
    words = hashvec.row_words(st, D)
    ref_v = [hashing.row_value(s, r) for s in STREAMS for r in range(D)]
    for w in WIDTHS:
        got = hashvec.columns(words, w)
        assert got.dtype == np.uint32 and got.shape == words.shape
        assert got.ravel().tolist() == [v % w for v in ref_v], w


def test_fewer_rows_than_the_stream_holds_and_a_strided_input():
    """d < 8 reads the first d words; a non-contiguous array of streams gives the same words."""
    st = np.frombuffer(b"".join(STREAMS), dtype=np.uint8).reshape(len(STREAMS), 32)
    for d in (1, 3, 5):
        assert hashvec.row_words(st, d).tolist() == hashvec.row_words(st, D)[:, :d].tolist()
    wide = np.zeros((len(STREAMS), 64), dtype=np.uint8)
    wide[:, 16:48] = st
    assert hashvec.row_words(wide[:, 16:48], D).tolist() == hashvec.row_words(st, D).tolist()
    assert hashvec.row_words(st[::2], D).tolist() == hashvec.row_words(st, D)[::2].tolist()
