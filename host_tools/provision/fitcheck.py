"""``pansketch fit``: does a board config's sketch fit a board, with the code installed the way it will be?

The same estimate deploy/flash.sh makes before it writes anything (firmware/memory.py: the heap model
measured in the MicroPython VMs, the boards' free heap assumed from public figures). When it does not
fit it names the smallest change that does, e.g. "w = 512 fits the picow with .mpy".
"""

from __future__ import annotations

import argparse
from typing import Any

BOARDS = ("esp32", "picow", "esp8266")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fit", help="does a board config's sketch fit the board (heap estimate)?",
        description="Heap estimate of a board config (pansketch.json) on one board with the code installed as "
        "deploy/flash.sh will install it. Exit 0: fits; 3: does not fit (the smallest change that fits is "
        "named); 2: the config is invalid (the key is named).")
    p.add_argument("config", help="the board config file (start from deploy/board/*.example.json)")
    p.add_argument("--board", required=True, choices=BOARDS, help="the board profile")
    p.add_argument("--code", choices=("py", "mpy", "frozen"), default="mpy",
                   help="how the code goes on the board: flash.sh's default .py sources, --mpy, or --frozen "
                   "(default: mpy)")
    p.add_argument("--no-tls", action="store_true", help="assume a plain MQTT connection even if the config has TLS")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pansketch.firmware import memory

    return int(memory.fit_main(args.config, args.board, args.code, tls=not args.no_tls))
