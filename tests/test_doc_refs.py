"""Every doc section that code or docs cite exists, and nothing cites a design file outside the repository.

References found in the repository's text files:

* ``FILE.md "Section"`` (also ``FILE.md, "Section"``): a heading of FILE.md that starts with the
  quoted text (backticks ignored, case-insensitive), so a short form of a long heading resolves;
* ``FILE.md §2.1`` / ``FILE.md section 7``: a heading numbered 2.1 / 7;
* markdown links and paths ``FILE.md#anchor``: a heading whose GitHub anchor is ``anchor``.

A heading is a markdown ``#`` heading or the bold lead of a paragraph (``**Retention.**``), the run-in
sections HOST.md and OPERATIONS.md are written in.

FILE.md is looked up as written (``docs/FORMAT.md``) or, for a bare name, in ``docs/``, ``deploy/``
and the repository root. A reference to a file that does not exist fails too.
"""

from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".py", ".md", ".sh", ".toml", ".cfg", ".service", ".conf", ".txt", ".html", ".js")
NAMES = ("Makefile", "run")
DIRS = ("docs", "deploy", "")

QUOTED = re.compile(r"((?:[\w./-]*/)?[A-Z][A-Z_-]*\.md),? \"([^\"\n]+)\"")
NUMBERED = re.compile(r"((?:[\w./-]*/)?[A-Z][A-Z_-]*\.md),? (?:§ ?|section )(\d+(?:\.\d+)*)")
ANCHOR = re.compile(r"((?:[\w./-]*/)?[A-Za-z][A-Za-z_-]*\.md)#([A-Za-z0-9_-]+)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
# a paragraph that starts with a bold (or italic) lead is a run-in section: **Retention.** / *Retention.*
LEAD = re.compile(r"^(?:\*\*(.+?)\*\*|\*([^*\s][^*]*?)\*)", re.M)
FORBIDDEN = re.compile(r"DESIGN\.md|\b[Ii]ssue \d+")


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    keep = []
    for name in out:
        p = ROOT / name
        if (p.suffix in SUFFIXES or p.name in NAMES) and p.is_file() and "node_modules" not in p.parts:
            keep.append(p)
    return keep


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.replace("`", "").replace("*", "")).strip().lower()


def _anchor(heading: str) -> str:
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


@lru_cache(maxsize=None)
def _headings(path: Path) -> tuple[str, ...]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return tuple(m.group(1) for m in HEADING.finditer(text)) + tuple(
        (m.group(1) or m.group(2)) for m in LEAD.finditer(text))


def _candidates(src: Path, ref: str) -> list[Path]:
    if "/" in ref:
        for base in (ROOT, src.parent):
            p = (base / ref).resolve()
            if p.is_file():
                return [p]
        return []
    return [p for p in ((ROOT / d / ref) if d else ROOT / ref for d in DIRS) if p.is_file()] + (
        [src.parent / ref] if (src.parent / ref).is_file() else [])


def _resolves(src: Path, ref: str, kind: str, target: str) -> bool:
    for p in _candidates(src, ref):
        hs = _headings(p)
        if kind == "quoted" and any(_norm(h).startswith(_norm(target)) for h in hs):
            return True
        if kind == "numbered" and any(re.match(re.escape(target) + r"\.? ", h) for h in hs):
            return True
        if kind == "anchor" and any(_anchor(h) == target.lower() for h in hs):
            return True
    return False


def _references() -> list[tuple[str, str, str, str]]:
    refs = []
    for p in _files():
        if p == Path(__file__).resolve():
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        rel = str(p.relative_to(ROOT))
        for kind, rx in (("quoted", QUOTED), ("numbered", NUMBERED), ("anchor", ANCHOR)):
            for m in rx.finditer(text):
                refs.append((rel, kind, m.group(1), m.group(2)))
    return refs


def test_references_found() -> None:
    """The scanner sees the references it is meant to check (a broken pattern would pass everything)."""
    kinds = {k for _f, k, _r, _t in _references()}
    assert kinds >= {"quoted", "numbered"}
    assert len(_references()) > 50


def test_every_cited_section_exists() -> None:
    bad = sorted({"%s: %s %s %r" % (f, r, k, t) for f, k, r, t in _references()
                  if not _resolves(ROOT / f, r, k, t)})
    assert not bad, "dangling doc references:\n" + "\n".join(bad)


@pytest.mark.parametrize("ref,target,ok", [
    ("PRIVACY.md", "Heavy-hitter strings", True),
    ("PRIVACY.md", "Kind strhh", False),
    ("FIRMWARE.md", "TLS on the board", False),
])
def test_resolver(ref: str, target: str, ok: bool) -> None:
    assert _resolves(ROOT / "docs" / "x.md", ref, "quoted", target) is ok


def test_no_design_brief_or_issue_numbers() -> None:
    """Code and docs say what a thing is: no design file outside the repository, no tracker numbers."""
    bad = []
    for p in _files():
        if p == Path(__file__).resolve():
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                bad.append("%s:%d: %s" % (p.relative_to(ROOT), n, line.strip()[:120]))
    assert not bad, "\n".join(bad)


def test_architecture_names_modules_that_exist() -> None:
    """docs/ARCHITECTURE.md says where each rule is enforced: every path it names is in the tree."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    paths = set(re.findall(r"`((?:agent|firmware|host_tools|tests|deploy)/[\w/.]*)`", text))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, "docs/ARCHITECTURE.md names paths that do not exist: %s" % missing
