"""Shared helpers of the paper reproductions: data, tables, plots, verdicts."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SCALES = ("tiny", "small", "paper")


def check_scale(scale: str) -> None:
    if scale not in SCALES:
        raise ValueError("scale must be one of %s" % ", ".join(SCALES))


def zipf_table(universe: int, a: float) -> np.ndarray:
    """CDF of the bounded Zipf p(k) ∝ k^-a on k = 1..universe (exact, float64)."""
    k = np.arange(1, universe + 1, dtype=np.float64)
    p = k ** (-a)
    c = np.cumsum(p)
    return c / c[-1]


def zipf_stream(gen: np.random.Generator, n: int, universe: int, a: float, exact_upto: int = 1 << 22) -> np.ndarray:
    """n draws of the bounded Zipf(a) on 1..universe (int64; rank k is item k).

    Exact inverse-CDF sampling when universe <= ``exact_upto``. For larger
    universes (intermittent-queries uses 2^29) the first ``exact_upto`` ranks
    are exact and the tail mass is sampled from the continuous density x^-a
    on (exact_upto, universe] -- the relative error of that approximation is
    O(1/exact_upto) per rank. Floats are fine here: this is test data, not noise.
    """
    u = gen.random(n)
    if universe <= exact_upto:
        cdf = zipf_table(universe, a)
        return np.searchsorted(cdf, u, side="right").astype(np.int64) + 1
    K = exact_upto
    head = np.arange(1, K + 1, dtype=np.float64) ** (-a)
    hsum = head.sum()
    if abs(a - 1.0) < 1e-12:
        tail = math.log((universe + 0.5) / (K + 0.5))
    else:
        tail = ((universe + 0.5) ** (1 - a) - (K + 0.5) ** (1 - a)) / (1 - a)
    total = hsum + tail
    cdf = np.cumsum(head) / total
    out = np.searchsorted(cdf, u, side="right").astype(np.int64) + 1
    t = out > K
    if t.any():
        v = (u[t] * total - hsum)  # mass into the tail
        if abs(a - 1.0) < 1e-12:
            x = (K + 0.5) * np.exp(v)
        else:
            x = ((K + 0.5) ** (1 - a) + v * (1 - a)) ** (1 / (1 - a))
        out[t] = np.clip(np.floor(x + 0.5).astype(np.int64), K + 1, universe)
    return out


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v == 0 or (1e-3 <= abs(v) < 1e5):
                return "%.4g" % v
            return "%.3e" % v
        return str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join(fmt(v) for v in r) + " |")
    return "\n".join(out)


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as p

    return p


def save_json(path: Path, obj: Any) -> None:
    def conv(o: Any) -> Any:
        if isinstance(o, (np.integer,)):
            return int(o)
        if isinstance(o, (np.floating,)):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
        raise TypeError(type(o))

    path.write_text(json.dumps(obj, indent=1, default=conv))


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def step(self, what: str) -> None:
        """Progress within a paper, on stderr (stdout keeps the one result line per paper)."""
        print("  %6.1f s  %s ..." % (self.elapsed(), what), file=sys.stderr, flush=True)


def verdict(ok: bool) -> str:
    return "agrees" if ok else "differs"
