"""``pansketch`` command: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``
which registers its arguments and sets ``func`` (called with the parsed
namespace, returning an exit code). Modules are imported lazily so that a
missing optional dependency (e.g. matplotlib for ``repro``) only affects
its own subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from pansketch.agent.pi.pipes import run_main

# subcommand name -> module path (module must define add_parser(subparsers))
SUBCOMMANDS: dict[str, str] = {
    "aggregate": "pansketch.host_tools.ingest.service",
    "status": "pansketch.host_tools.query.status",
    "device": "pansketch.host_tools.query.device_cli",
    "query": "pansketch.host_tools.query.cli",
    "serve": "pansketch.host_tools.web.serve",
    "demo": "pansketch.host_tools.demo",
    "repro": "pansketch.host_tools.lab.repro.cli",
    "audit": "pansketch.host_tools.audit.cli",
    "fit": "pansketch.host_tools.provision.fitcheck",
    "init": "pansketch.host_tools.provision.initdir",
}


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, also for an editable install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pansketch")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


class _Version(argparse.Action):
    """``--version``: reads the installed version only when asked (importlib.metadata costs every command
    about 14 ms of imports)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: str = argparse.SUPPRESS,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print("pansketch %s" % package_version())
        parser.exit()


class OneLineParser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit 2 (subparsers inherit the class); --help has the rest."""

    def error(self, message: str) -> "NoReturn":
        self.exit(2, "%s: error: %s (see %s --help)\n" % (self.prog, message, self.prog))


def build_parser(only: str | None = None, words: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``only``: register that subcommand alone (its module the only one
    imported: importing every subcommand's module cost a query about 0.4 s of CPU on every call).
    ``words``: the command line after ``only``, for a module with ``add_parser_for(subparsers, words)``
    that registers only what they name (``pansketch query freq``: the freq kind's module alone)."""
    parser = OneLineParser(
        prog="pansketch",
        description="Host tools for pansketch: aggregate noisy sketch releases from MQTT, "
        "inspect the privacy ledger, query frequencies with error bars, run the demo "
        "and the paper reproductions, audit a device config's privacy empirically.",
    )
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:  # keep the other subcommands usable
            p = sub.add_parser(name, help="(unavailable: %s)" % exc)
            p.set_defaults(func=lambda _a, _e=exc, _n=name: _unavailable(_n, _e))
            continue
        add_for = getattr(mod, "add_parser_for", None) if words is not None else None
        if add_for is not None:
            add_for(sub, list(words or ()))
        else:
            mod.add_parser(sub)
    return parser


def _unavailable(name: str, exc: Exception) -> int:
    print("pansketch %s: unavailable: %s" % (name, exc), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    # a subcommand named first: its parser alone (the top-level help and options need them all)
    first = words[0] if words and words[0] in SUBCOMMANDS else None
    parser = build_parser(first, words[1:] if first else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # `pansketch status | head -1`: a closed stdout ends the command quietly (exit 141)
    return run_main(lambda: int(args.func(args) or 0))


if __name__ == "__main__":
    sys.exit(main())
