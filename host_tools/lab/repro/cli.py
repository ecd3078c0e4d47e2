"""``pansketch repro``: run the paper reproductions and write plots + tables."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from . import PAPERS
from .common import SCALES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "repro", help="reproduce the papers' figures (PNG + markdown table per paper)",
        description="Reproduce the experiments of the papers the product builds on with the library "
        "algorithms (pansketch.host_tools.lab.algorithms): dp-linear, Zhao et al., differentially private linear "
        "sketches; intermittent, Yildirim et al., intermittent queries on a DP count sketch; lazy, Holland, "
        "lazy sketches under continual observation; panprivate, Mir et al., pan-private algorithms via "
        "statistics on sketches. Their claims next to ours: docs/REPRODUCTION.md. 'all' runs every paper "
        "into OUT/<paper>/.")
    p.add_argument("paper", choices=sorted(PAPERS) + ["all"], help="which paper")
    p.add_argument("--scale", choices=SCALES, default="small",
                   help="tiny: seconds (tests); small: the whole suite in < 20 min on 2 cores; "
                   "paper: the papers' sizes where feasible (long)")
    p.add_argument("--out", type=Path, default=Path("repro-out"), help="output directory")
    p.add_argument("--seed", type=int, default=1, help="seed of the data, hashes and noise (simulation)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    names = sorted(PAPERS) if args.paper == "all" else [args.paper]
    total = time.perf_counter()
    for name in names:
        mod = importlib.import_module(PAPERS[name])
        out = args.out / name if args.paper == "all" else args.out
        t = time.perf_counter()
        try:
            mod.run(args.scale, out, args.seed)
        except (ValueError, OSError) as exc:
            print("repro %s: error: %s" % (name, exc), file=sys.stderr)
            return 1
        print("repro %s (%s): %.1f s -> %s" % (name, args.scale, time.perf_counter() - t, out))
    if len(names) > 1:
        print("repro all (%s): %.1f s" % (args.scale, time.perf_counter() - total))
    return 0
