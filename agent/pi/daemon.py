"""``pansketch-agent``: the Raspberry Pi daemon (source -> Recorder -> outbox -> MQTT).

CPython only (argparse, threads, paho-mqtt): **not** part of the MicroPython
device core. The counting, noise and crash-safe commit protocol are the
device core's (pansketch.agent.recorder). This module is the command line; the
commands live beside it: :mod:`pansketch.agent.pi.run` (run, feed), :mod:`pansketch.agent.pi.check`
(check), :mod:`pansketch.agent.pi.loop` (the agent loop they drive), :mod:`pansketch.agent.pi.common`
(exit codes, log lines, config loading).

Commands::

    pansketch-agent run   --config FILE   # long-running daemon
    pansketch-agent feed  --config FILE   # events on stdin, deliver, exit
    pansketch-agent check --config FILE   # validate, print noise and guarantee

Exit codes: 0 success, 1 could not deliver within --timeout (releases stay in
the outbox and go out with the next run), 2 configuration error (one line
naming the key), 3 other runtime errors (state directory unusable, ...).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, Optional

from pansketch.agent.pi import common
from pansketch.agent.pi.check import cmd_check
from pansketch.agent.pi.common import EXIT_CONFIG, PROG, SEED_ENV
from pansketch.agent.pi.run import cmd_run


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors: one line on stderr, exit 2 (subparsers inherit the class)."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_CONFIG, "%s: error: %s (see %s --help)\n" % (self.prog, message, self.prog))


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError("must be a whole number from 1 to 64, not %r" % text)
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=PROG,
        description="pansketch device agent: count events into a pan-private noisy sketch and publish only "
        "noisy releases (CBOR, MQTT QoS 1) at clock-aligned window/epoch boundaries. The config file "
        "format is documented in docs/AGENT.md; see examples/agent.toml.",
        epilog="Exit codes: 0 ok, 1 releases not stored by the host within --timeout (they stay in the outbox), "
        "2 configuration error, 3 runtime error.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def common_options(p: argparse.ArgumentParser, timeout: float) -> None:
        p.add_argument("--config", "-c", required=True, metavar="FILE", help="agent TOML config (docs/AGENT.md)")
        p.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                       help="at end of a finite input, how long to wait until the host (pansketch aggregate) "
                       "has stored every release (0 = forever; default %(default)s)")
        p.add_argument("--quiet", "-q", action="store_true", help="no log lines on stderr")
        t = p.add_argument_group("testing and demos only")
        t.add_argument("--clock-start", type=float, metavar="UTC_SECONDS",
                       help="pretend the UTC clock reads this at start-up")
        t.add_argument("--clock-speed", type=float, default=1.0, metavar="X",
                       help="run the clock X times as fast (0 freezes it); windows close sooner")
        t.add_argument("--insecure-seed", metavar="SEED",
                       help="deterministic noise from SEED (also env %s): NO PRIVACY, for tests only" % SEED_ENV)

    p = sub.add_parser("run", help="run the daemon with the configured event source",
                       description="Run the agent: read events from [source], release at every window/epoch "
                       "boundary of the UTC clock, publish the outbox in order. A finite source (stdin, file "
                       "with follow = false) releases what it counted at its end and exits once delivered. "
                       "SIGTERM saves the noisy state and exits.")
    common_options(p, 0.0)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("feed", help="count events from stdin, release at the end, wait for delivery",
                       description="Read events from standard input (one item per line, optional TAB and "
                       "integer weight), release at window/epoch boundaries and at end of input, wait until "
                       "the host has stored every release (its acknowledgement, not the broker's), exit 0. "
                       "Exit 1 if that takes longer than --timeout; nothing is lost, the releases stay in the "
                       "outbox and are re-sent by the next run or feed.")
    common_options(p, 60.0)
    p.add_argument("--jobs", "-j", type=_jobs, default=None, metavar="N",
                   help="count with N processes (cms/cs sketches): N - 1 helpers count input chunks on other "
                   "cores, each handed at most two chunks at a time, one counted and one waiting "
                   "(docs/PRIVACY.md); the releases are the same bytes (default: 2 with two or more CPUs, else 1)")
    p.add_argument("--no-flush", action="store_true",
                   help="at end of input do not release the open window early (it is released at its boundary "
                   "by the next run or feed): `feed --no-flush < /dev/null` only delivers the outbox. Without it "
                   "the end of input always releases, also with no events: skipping an empty window would make "
                   "the release depend on the data")
    p.set_defaults(func=lambda a: cmd_run(a, feed=True))
    p = sub.add_parser("check", help="validate a config, print the noise, guarantee and release size, try the broker",
                       description="Validate the config file, print the per-cell noise, the per-event guarantee "
                       "and the release size, and connect once to the broker with the configured TLS settings "
                       "and credentials (nothing is published), and to the local source broker of an mqtt source. "
                       "Exit 0 if all is well, 1 if a broker cannot "
                       "be reached or refuses the connection, 2 for a config error. Warns when the salt is an "
                       "example placeholder.")
    p.add_argument("--config", "-c", required=True, metavar="FILE")
    p.add_argument("--offline", action="store_true",
                   help="do not try the broker (e.g. ExecStartPre of a service that must start while the broker "
                   "is down)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for the broker (default %(default)s)")
    p.add_argument("--range-epochs", type=int, action="append", metavar="K",
                   help="range lengths (epochs) your queries use: compares window/keep and tree noise for them "
                        "(repeatable; default 1, 24, 168, 720, 10080)")
    p.add_argument("--levels", type=int, metavar="L", help="tree levels to compare with (default: the config's, or 8)")
    p.add_argument("--events", type=int, metavar="N",
                   help="expected events (dbits: distinct items) per release: print the expected interval width "
                        "and warn, with suggested d and w, when it will be uninformative")
    p.add_argument("--target-error", type=float, default=0.05, metavar="F",
                   help="relative half-width the suggestion aims at (default %(default)s)")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    # numpy's OpenBLAS starts one thread per core when numpy is imported (agent/pi/bulknoise.py), which
    # costs about 60 ms of CPU on 2 cores (half of numpy's import); the daemon's numpy work is
    # elementwise integer arithmetic, never BLAS. An operator's own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from pansketch.agent.pi.pipes import run_main

    def body() -> int:
        try:
            return int(args.func(args) or 0)
        except SystemExit as exc:
            return int(exc.code or 0)

    # `pansketch-agent check | head -1`: a closed stdout ends the command quietly (exit 141)
    return run_main(body)


def cli() -> None:
    """The command's entry point (``pansketch-agent``, ``python -m pansketch.agent.pi.daemon``): :func:`main`,
    then an exit without the interpreter's teardown. Before ``main`` returns every file the agent
    wrote is fsynced and closed, the broker connection closed and the count workers reaped; tearing
    down numpy's and paho-mqtt's modules after that does nothing and cost 20-30 ms per run, a tenth
    of ``feed``'s time for a million lines. Output is flushed first; an exception still ends with
    its traceback and the normal exit. Tests call :func:`main`, which returns.

    The cyclic garbage collector is held off while the modules load (numpy's and paho-mqtt's
    imports made it run about 60 times, 6 ms, finding nothing to free); Agent.main turns it back on
    before counting."""
    common.gc_held = True
    gc.disable()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: main() has already chosen the exit status
            pass
    os._exit(code)


if __name__ == "__main__":
    cli()
