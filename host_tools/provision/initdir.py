"""``pansketch init DIR``: the files a user of the package needs to follow the README without a checkout.

The wheel installs them under the environment's data directory (``<prefix>/share/pansketch``,
pyproject.toml's data-files); this copies them into DIR laid out as in the repository, so the README's
commands read the same in DIR as in a checkout: ``examples/agent.toml``, ``examples/host.toml``,
``deploy/board/*.example.json``, ``deploy/systemd/*.service`` and ``deploy/flash.sh``. From an editable
install (a checkout) the repository's own files are copied.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any, Optional

# layout in DIR -> (directory under share/pansketch, directory in a checkout)
LAYOUT = (("examples", "examples", "examples"), ("deploy/board", "board", "deploy/board"),
          ("deploy/systemd", "systemd", "deploy/systemd"))
FLASH = ("deploy/flash.sh", "flash.sh", "deploy/flash.sh")


def _share() -> Optional[Path]:
    """Where the installed copies are: the data directory of this interpreter's install scheme."""
    for base in (sysconfig.get_path("data"), sys.prefix, sysconfig.get_path("data", "posix_user")):
        d = Path(base) / "share" / "pansketch"
        if (d / "flash.sh").is_file():
            return d
    return None


def _checkout() -> Optional[Path]:
    root = Path(__file__).resolve().parents[1]
    return root if (root / "deploy" / "flash.sh").is_file() and (root / "examples").is_dir() else None


def sources() -> list[tuple[Path, str]]:
    """(file to copy, its path in DIR)."""
    share, co = _share(), _checkout()
    out: list[tuple[Path, str]] = []
    for dst, in_share, in_co in LAYOUT + (FLASH,):
        src = (share / in_share) if share else (co / in_co) if co else None
        if src is None:
            raise FileNotFoundError("the package's data files (share/pansketch) are not installed next to it")
        if src.is_file():
            out.append((src, dst))
        else:
            out += [(f, "%s/%s" % (dst, f.name)) for f in sorted(src.iterdir())
                    if f.is_file() and f.suffix in (".toml", ".json", ".service")]
    return out


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "init", help="write the example configs, board configs, systemd units and flash.sh into DIR",
        description="Copy what the README's Quick start and board recipe use (examples/, deploy/board/, "
        "deploy/systemd/, deploy/flash.sh) into DIR, laid out as in the repository. Existing files are kept "
        "unless --force.")
    p.add_argument("dir", help="directory to write into (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files that exist")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        files = sources()
    except FileNotFoundError as exc:
        print("pansketch init: %s" % exc, file=sys.stderr)
        return 1
    root = Path(args.dir)
    kept = 0
    for src, rel in files:
        dst = root / rel
        if dst.exists() and not args.force:
            kept += 1
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        if rel.endswith(".sh"):
            os.chmod(dst, 0o755)  # wheels do not keep the executable bit of data files
        print("  %s" % dst)
    print("pansketch init: %d file(s) in %s%s" % (len(files) - kept, root,
                                                 "; %d kept (exist already; --force overwrites)" % kept if kept else ""))
    return 0
