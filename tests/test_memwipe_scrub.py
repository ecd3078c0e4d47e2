"""pansketch.agent.pi.memwipe.scrub on its own: after a chunk's lines are counted and freed, no
raw line is left anywhere in the process (docs/PRIVACY.md "Memory residue").

A child process counts bursts of unique lines chunk by chunk with the batch path
(pansketch.agent.pi.batch.add_raw), frees them, scrubs after each burst, and waits; this
process reads all of the child's memory (tests/support/memscan.py). 40,000 lines free whole pools, which pymalloc then hands to other
size classes: a pool carved into blocks of a new class keeps the freed lines of its old class
wherever no block of the new class reached (the end of a pool of 512-byte blocks, the part a
class has not carved yet), and a fill that stops short of a class's free blocks leaves the
last ones in pymalloc's order unfilled, burst after burst. The scrub must reach those too. Without the scrub (the control),
thousands of lines are found.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import memscan
from tests.support.e2e import REPO, agent_env

why = memscan.can_read_memory()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")

CHILD = r"""
import secrets, sys
from pansketch.agent import hashing
from pansketch.agent.pi import memwipe
from pansketch.agent.pi.batch import add_raw
from pansketch.agent.pi.sources import Warner, split_lines
from pansketch.agent.sketch import Sketch
memwipe.harden()
n, mode, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sk = Sketch("cs", 4, 1024, hashing.salt_prefix("scrub-test"), 1)
warn = Warner(print)
for _ in range(rounds):  # bursts of n unique lines, each twice, counted chunk by chunk as the daemon does
    items = [b"secret-mac-" + secrets.token_hex(6).encode() for _ in range(n)]
    data = b"".join(x + b"\n" for x in items for _ in range(2))
    del items
    for chunk in split_lines(data, 16384):
        add_raw(sk, chunk, warn)
        memwipe.wipe_bytes(chunk)
        del chunk
    memwipe.wipe_bytes(data)
    del data
    if mode == "scrub":
        memwipe.scrub()
sys.stdout.write("ready\n")
sys.stdout.flush()
sys.stdin.read()
"""


def _residue(n: int, mode: str, rounds: int = 1) -> int:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(n), mode, str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=agent_env(), cwd=REPO)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        with memscan.stopped([p.pid]):
            snap = memscan.Snapshot.of(p.pid)
        return len(memscan.Scan([snap]).items(rb"secret-mac-[0-9a-f]{12}"))
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("n,rounds", [(300, 1), (20000, 1), (20000, 3)])
def test_scrub_leaves_no_freed_line(n, rounds):
    assert _residue(n, "scrub", rounds) == 0


def test_pool_layout_is_confirmed():
    """The tails are zeroed only where the fillers confirm pymalloc's pool layout; on the CPython the
    daemon runs on it must be confirmed, or a line left in a pool's tail would go unnoticed here."""
    from collections import deque

    from pansketch.agent.pi import memwipe

    fills = [(size, deque(memwipe._filler(size, 300))) for size in (16, 32, 64, 128, 480)]
    assert memwipe._tail_offsets(fills) == {16: 16384, 32: 16368, 64: 16368, 128: 16304, 480: 16368}
    assert memwipe._zero_tails(fills) > 0


def test_control_without_scrub_finds_the_lines():
    assert _residue(20000, "none") > 1000
