"""The README's Quick start outputs against a real run of the same commands (tests/support/quickstart_run.py).

The README shows the outputs of one real run, written by ``python -m tests.support.quickstart_run
--write-readme``; noise makes every run's numbers differ, so this compares what must not drift:
each output's shape (its lines with every number as ``N``), and what the prose says the numbers
mean -- the noise sd per cell and the draws behind it, the check's noise line it quotes, the
release size, and whether estimates can be fractional.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest

from tests.support import quickstart_run as qs

README = qs.REPO / "README.md"
NUM = re.compile(r"-?\d+(?:[.,:]\d+)*")


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, str]:
    d: Path = tmp_path_factory.mktemp("quickstart")
    shutil.copytree(qs.REPO / "examples", d / "examples")
    return qs.run(d)


@pytest.fixture(scope="module")
def shown() -> dict[str, str]:
    blocks = qs.readme_shown(README)
    assert set(blocks) == {name for name, _ in qs.COMMANDS}, \
        "README.md must show every Quick start command's output between <!-- quickstart:NAME --> markers"
    return blocks


def prose() -> str:
    m = re.search(r"<!-- quickstart-prose:begin -->(.*?)<!-- quickstart-prose:end -->", README.read_text(), re.S)
    assert m, "README.md has no <!-- quickstart-prose:begin/end --> section explaining the numbers"
    return " ".join(m.group(1).split())


def shape(text: str) -> list[str]:
    """The lines with every number as N and runs of blanks as one (column widths follow the numbers)."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"\b\d+(?:s|m|h|d) ago\b", "N ago", line)  # "7s ago" on one machine, "1m ago" on a slow one
        line = NUM.sub("N", line)
        out.append(re.sub(r"\s+", " ", line).strip())
    return out


def same_shape(a: list[str], b: list[str]) -> bool:
    """Line by line; a line cut at … (too long for the README) is cut where its numbers' widths put the
    cut, so cut lines are compared up to a little before the shorter one's cut."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.endswith("…") or y.endswith("…"):
            k = min(len(x), len(y)) - 12
            if x[:k] != y[:k]:
                return False
        elif x != y:
            return False
    return True


# feed's "connected to ..." comes from the publisher's thread while the counting goes on, so it is
# printed before or after "counted ..." as the two happen to run: that one line may stand anywhere,
# every other line keeps its order.
MOVABLE = {"feed": re.compile(r"\bconnected to\b")}


def _split_movable(name: str, lines: list[str]) -> tuple[list[str], list[str]]:
    pat = MOVABLE.get(name)
    if pat is None:
        return lines, []
    return [x for x in lines if not pat.search(x)], [x for x in lines if pat.search(x)]


@pytest.mark.parametrize("name", [n for n, _ in qs.COMMANDS])
def test_each_output_has_the_shape_the_readme_shows(real, shown, name):
    (a, a_moved), (b, b_moved) = _split_movable(name, shape(shown[name])), _split_movable(name, shape(real[name]))
    assert a_moved == b_moved, "the README's %r output and the command's differ in their connected line" % name
    assert same_shape(a, b), (
        "the README's %r output is not what the command prints now: rerun python -m tests.support.quickstart_run "
        "--write-readme and check the prose\n--- README\n%s--- real\n%s" % (name, shown[name], real[name]))


def noise_sd(freq: str) -> str:
    m = re.search(r"noise sd ([\d.]+) per cell", freq)
    assert m, freq
    return m.group(1)


def test_the_noise_the_prose_explains_is_the_noise_queries_report(real, shown):
    text = prose()
    sd = noise_sd(real["freq"])
    assert noise_sd(shown["freq"]) == sd
    assert "`noise sd %s per cell`" % sd in text, "the prose explains sd %s? %s" % (sd, text)
    draws = re.search(r"(\d+) noise draws per cell", real["freq"]).group(1)
    assert "from %s draws per cell" % draws in text
    # the check line the prose quotes, as check prints it, and the sd it adds up to
    quoted = re.search(r"`(sigma\^2 = [^`]+)`", text).group(1)
    assert quoted in real["check"], "check no longer prints %r:\n%s" % (quoted, real["check"])
    out_var, int_var = (float(x) for x in re.findall(r"(\d+(?:\.\d+)?)(?= per cell output| internal)", quoted))
    assert "%.1f" % math.sqrt(out_var + int_var) == sd


def test_the_release_size_is_the_one_shown_and_explained(real, shown):
    size = re.search(r"release\s+(\d+) bytes", real["check"]).group(1)
    assert re.search(r"release\s+%s bytes" % size, shown["check"])
    assert "%s bytes" % size in shown["aggregate"] and "%s bytes" % size in real["aggregate"]
    assert "A release is %s bytes" % size in prose()


def test_integer_or_fractional_estimates_as_the_prose_says(real, shown):
    """A CountSketch answer is the median of d rows: with d even it may be a half-integer, and the README
    must say so and may show one; with d odd (or Count-Min) estimates are integers."""
    d = int(re.search(r"sketch\s+(cs|cms) d=(\d+)", real["check"]).group(2))
    kind = re.search(r"sketch\s+(cs|cms)", real["check"]).group(1)
    halves = kind == "cs" and d % 2 == 0
    for out in (real["freq"], shown["freq"]):
        rows = [ln.split() for ln in out.splitlines() if ln.startswith("aa:")]
        values = [float(v.strip("[],")) for r in rows for v in r[1:]]
        assert values and all((2 * v).is_integer() for v in values)
        assert halves or all(v.is_integer() for v in values), out
    assert ("half-integer" in prose()) == halves
    assert "median of d = %d rows" % d in prose()
