"""Sampler benchmark: the device's exact samplers against their textbook transcription.

    python -m pansketch.host_tools.bench.samplers [--draws N] [--out DIR]

agent/rng.py and agent/noise.py are tuned (inlined calls, one byte per try
when k <= 8, int.bit_length on CPython). :class:`RefRng` and ``ref_*`` below
are the plain transcription of Canonne, Kamath & Steinke 2020 Algorithms
1-3 as the device ran them before the tuning (a call per byte and per
Bernoulli, the portable bit_length loop), with the same byte-consumption
rules, so both draw *identical* values
from the same byte source (tests/test_sampler_reference.py proves it); this
module times them in the same process, interleaved, over ``os.urandom``,
and writes bench-results/samplers.json. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from pansketch.agent import noise
from pansketch.agent.rng import NoEntropyError, Rng, bit_length


class RefRng:
    """Byte-at-a-time Rng: a CHUNK-byte read per refill, wiped after each sample."""

    def __init__(self, source) -> None:
        self.source = source
        self.buf = b""
        self.pos = Rng.CHUNK

    def byte(self) -> int:
        if self.pos >= Rng.CHUNK:
            self.buf = self.source.read(Rng.CHUNK)
            if len(self.buf) != Rng.CHUNK:
                raise NoEntropyError("short read")
            self.pos = 0
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def wipe(self) -> None:
        self.buf = b""
        self.pos = Rng.CHUNK

    def randbits(self, k: int) -> int:
        v = 0
        nbytes = (k + 7) >> 3
        for _ in range(nbytes):
            v = (v << 8) | self.byte()
        return v >> (nbytes * 8 - k)

    def randbelow(self, m: int) -> int:
        if m == 1:
            return 0
        k = bit_length(m - 1)  # the portable loop, as the device code had it before
        while True:
            v = self.randbits(k)
            if v < m:
                return v

    def bernoulli(self, num: int, den: int) -> bool:
        return self.randbelow(den) < num


def ref_bexp(rng: RefRng, num: int, den: int) -> bool:  # CKS Algorithm 1
    if num <= den:
        k = 1
        while rng.bernoulli(num, den * k):
            k += 1
        return k % 2 == 1
    for _ in range(num // den):
        if not ref_bexp(rng, 1, 1):
            return False
    return ref_bexp(rng, num - (num // den) * den, den)


def ref_dlap(rng: RefRng, t: int, s: int) -> int:  # CKS Algorithm 2, scale t/s
    while True:
        u = rng.randbelow(t)
        if not ref_bexp(rng, u, t):
            continue
        v = 0
        while ref_bexp(rng, 1, 1):
            v += 1
        y = (u + t * v) // s
        neg = rng.bernoulli(1, 2)
        if neg and y == 0:
            continue
        return -y if neg else y


def ref_dgauss(rng: RefRng, n: int, d: int) -> int:  # CKS Algorithm 3, sigma^2 = n/d
    t = noise.isqrt(n // d) + 1
    while True:
        y = ref_dlap(rng, t, 1)
        a = abs(y) * d * t - n
        if ref_bexp(rng, a * a, 2 * n * d * t * t):
            return y


def ref_sample(rng: RefRng, mech: str, num: int, den: int) -> int:
    try:
        return ref_dlap(rng, num, den) if mech == "dlap" else ref_dgauss(rng, num, den)
    finally:
        rng.wipe()


class _Urandom:
    def read(self, n: int) -> bytes:
        return os.urandom(n)


CASES = (("dlap", 8, 1), ("dlap", 200, 1), ("dgauss", 4, 1), ("dgauss", 10000, 1))


def bench(draws: int, rounds: int = 7) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mech, num, den in CASES:
        spec = noise.NoiseSpec(mech, num, den)
        best_ref = best_fast = float("inf")
        for _ in range(rounds):  # interleaved: both see the same machine load
            r = RefRng(_Urandom())
            t = time.process_time()
            for _ in range(draws):
                ref_sample(r, mech, num, den)
            best_ref = min(best_ref, time.process_time() - t)
            f = Rng(_Urandom())
            t = time.process_time()
            for _ in range(draws):
                spec.sample(f)
            best_fast = min(best_fast, time.process_time() - t)
        key = "%s %d/%d" % (mech, num, den)
        out[key] = {"reference_us": 1e6 * best_ref / draws, "device_us": 1e6 * best_fast / draws,
                    "speedup": best_ref / best_fast}
        print("%-16s reference %6.2f us  device %6.2f us  speedup %.2fx" % (
            key, out[key]["reference_us"], out[key]["device_us"], out[key]["speedup"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=5000)
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()
    res = {"cpython": bench(a.draws)}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "samplers.json").write_text(json.dumps(res, indent=1))
    print("wrote %s" % (Path(a.out) / "samplers.json"))


if __name__ == "__main__":
    main()
