"""What firmware/manifest.py puts on a board, read by running the manifest as
MicroPython's freezer does (tools/manifestfile.py): under CPython, with the
manifest's folder as working directory and the freezer's functions recorded
instead of performed. deploy/flash.sh stages from the same run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_manifest(root: Path = REPO, unix_port: Any = None) -> dict[str, list[Any]]:
    """The manifest's calls: include and require names, (package, files, base_path), (module, base_path)."""
    manifest = root / "firmware" / "manifest.py"
    calls: dict[str, list[Any]] = {"include": [], "require": [], "package": [], "module": []}

    class Options:  # MicroPython's IncludeOptions: include() keywords, None when not given
        pass

    opts = Options()
    opts.unix_port = unix_port  # type: ignore[attr-defined]
    env = {
        "options": opts,
        "include": lambda p, **kw: calls["include"].append(p),
        "require": lambda n, **kw: calls["require"].append(n),
        "package": lambda p, files=None, base_path=".", opt=None: calls["package"].append((p, files, base_path)),
        "module": lambda p, base_path=".", opt=None: calls["module"].append((p, base_path)),
    }
    cwd = os.getcwd()
    os.chdir(manifest.parent)
    try:
        exec(compile(manifest.read_text(), str(manifest), "exec"), env)
    finally:
        os.chdir(cwd)
    return calls


def manifest_files(root: Path = REPO) -> list[tuple[str, Path]]:
    """The modules the manifest freezes: (path on the board, e.g. ``pansketch/agent/sketch.py``, source file)."""
    manifest_dir = root / "firmware"
    return [(pkg + "/" + f, (manifest_dir / base / pkg / f).resolve())
            for pkg, files, base in run_manifest(root)["package"] for f in files]
