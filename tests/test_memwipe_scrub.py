"""pansketch.agent.pi.memwipe.scrub on its own: after a chunk's lines are counted and freed, no
raw line is left anywhere in the process (docs/PRIVACY.md "Memory residue").

A child process counts a chunk of unique lines the way the batch path does (bytes.split, a
Counter), frees them, scrubs, and waits; this process reads all of the child's memory
(tests/support/memscan.py). 40,000 lines free whole pools, which pymalloc then hands to other
size classes: a pool carved into blocks of a new class keeps the freed lines of its old class
wherever no block of the new class reached (the end of a pool of 512-byte blocks, the part a
class has not carved yet). The scrub must reach those too. Without the scrub (the control),
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
from collections import Counter
from pansketch.agent.pi import memwipe
memwipe.harden()
n = int(sys.argv[1])
data = b"".join(b"secret-mac-" + secrets.token_hex(6).encode() + b"\n" for _ in range(n))
agg = Counter(data.split(b"\n"))
agg.clear()
memwipe.wipe_bytes(data)
del agg, data
if sys.argv[2] == "scrub":
    memwipe.scrub()
sys.stdout.write("ready\n")
sys.stdout.flush()
sys.stdin.read()
"""


def _residue(n: int, mode: str) -> int:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(n), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=agent_env(), cwd=REPO)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        with memscan.stopped([p.pid]):
            snap = memscan.Snapshot.of(p.pid)
        return len(memscan.Scan([snap]).items(rb"secret-mac-[0-9a-f]{12}"))
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("n", [750, 40000])
def test_scrub_leaves_no_freed_line(n):
    assert _residue(n, "scrub") == 0


def test_control_without_scrub_finds_the_lines():
    assert _residue(40000, "none") > 1000
