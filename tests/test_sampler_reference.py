"""The fast samplers draw exactly what the textbook code draws.

agent/rng.py and agent/noise.py inline calls, read one byte per try when
k <= 8 and use int.bit_length on CPython (>= 1.5x faster). This
file keeps the plain transcription of Canonne, Kamath & Steinke 2020
Algorithms 1-3 over a byte-at-a-time Rng -- the same byte consumption
rules -- and checks that both give identical draws from the same byte
source. tests/test_mp_core.py checks CPython against MicroPython.
"""

from __future__ import annotations

import pytest

from pansketch.agent import noise
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools.bench.samplers import RefRng, ref_sample


@pytest.mark.parametrize("mech,num,den", [("dlap", 8, 1), ("dlap", 1, 3), ("dlap", 2000, 7), ("dlap", 70000, 1),
                                          ("dgauss", 4, 1), ("dgauss", 1, 8), ("dgauss", 10**6, 3)])
@pytest.mark.slow
def test_fast_samplers_equal_the_reference(mech, num, den):
    spec = noise.NoiseSpec(mech, num, den)
    fast = Rng(DeterministicSource("ref-%s-%d-%d" % (mech, num, den)))
    ref = RefRng(DeterministicSource("ref-%s-%d-%d" % (mech, num, den)))
    a = [spec.sample(fast) for _ in range(3000)]
    b = [ref_sample(ref, mech, num, den) for _ in range(3000)]
    assert a == b
    assert len(set(a)) >= 3  # really random


def test_randbelow_equals_the_reference_across_byte_widths():
    fast = Rng(DeterministicSource("widths"))
    ref = RefRng(DeterministicSource("widths"))
    ms = [1, 2, 3, 7, 128, 255, 256, 257, 1000, 65535, 65536, 65537, 10**9, 2**40 + 5]
    assert [fast.randbelow(m) for m in ms * 50] == [ref.randbelow(m) for m in ms * 50]
