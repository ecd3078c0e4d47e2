"""Hash version 1's row rule for many hash streams at once (numpy).

The vectorised twin of ``pansketch.agent.hashing.row_value`` / ``row_sign``, which
stay the reference (and the only form on a board). Row r of a hash stream
is its little-endian 32-bit word r: the low 30 bits are the row's value,
the column is that value mod w, bit 31 is the CountSketch sign (set:
negative). The Pi daemon's batch path (pansketch.agent.pi.batch) and the host
(pansketch.host_tools.fasthash, the lab) read cells through these functions only, so
a hash version 2 changes them here and in agent/hashing.py;
tests/test_hashvec.py holds the two forms equal.

CPython only (numpy): not part of the frozen core.
"""

from __future__ import annotations

from typing import Any

import numpy as np

VALUE_MASK = 0x3FFFFFFF  # the row value: the word's low 30 bits (bit 30 unused, bit 31 the sign)


def row_words(streams: Any, d: int) -> Any:
    """The first ``d`` row words, (n, d) uint32, of hash streams ``streams``: a (n, L) uint8
    array, L a multiple of 4 (32 bytes per SHA-256 block). A view where ``streams`` is
    contiguous (no copy: the batch path wipes the buffer behind it afterwards)."""
    st = np.ascontiguousarray(streams)
    return st.view("<u4")[:, :d]


def row_values(words: Any) -> Any:
    """The 30-bit row values (before mod w), uint32."""
    return words & np.uint32(VALUE_MASK)


def columns(words: Any, w: int) -> Any:
    """Columns ``row value mod w``, uint32, same shape as ``words``: a new array (callers
    add row offsets in place)."""
    if w > VALUE_MASK:  # every row value is below w
        return row_values(words)
    if w & (w - 1) == 0:  # w a power of two <= 2**30 divides 2**30: the column is the low bits
        return words & np.uint32(w - 1)
    out = words & np.uint32(VALUE_MASK)
    out %= np.uint32(w)  # in place: no temporary of row values left unzeroed (pansketch.agent.pi.batch wipes out)
    return out


def negative(words: Any) -> Any:
    """1 where the row's sign is negative (bit 31 set), else 0; uint32."""
    return words >> 31
