"""docs/FORMAT.md's worked example is exactly what the encoder produces,
and releases follow the deterministic-CBOR rules it specifies."""

import re
from pathlib import Path

import cbor2

from agent import cbor, release
from agent.params import Params
from agent.sketch import new_counters

DOC = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def example_bytes():
    p = Params({"device": "pico-7", "salt": "fleet-salt-1", "kind": "cs", "d": 2, "w": 3, "mode": "keep",
                "window_s": 3600, "epoch_s": 600, "mechanism": "dgauss", "budget": "1/2"})
    c = new_counters(6)
    for i, v in enumerate([5, -2, 0, 1, 70000, -1]):
        c[i] = v
    return release.encode(p, 42, 1200000, 1200001, 0, c, nz=3)


def test_worked_example_matches_encoder():
    text = DOC.read_text()
    block = re.search(r"%d bytes:\n\n```\n([0-9a-f\n]+)```" % len(example_bytes()), text).group(1)
    assert bytes.fromhex(block.replace("\n", "")) == example_bytes()


def test_release_is_canonical_cbor_without_tags_or_floats():
    b = example_bytes()
    m = cbor2.loads(b)
    assert len(m) == 23
    assert cbor2.dumps(m, canonical=True) == b  # cbor2's canonical form agrees byte for byte
    assert list(memoryview(m["ctr"]).cast("i")) == [5, -2, 0, 1, 70000, -1]


def test_cbor_heads_shortest_form():
    for n, enc in [(0, "00"), (23, "17"), (24, "1818"), (255, "18ff"), (256, "190100"), (65536, "1a00010000"),
                   (2**32, "1b0000000100000000"), (-1, "20"), (-25, "3818")]:
        assert cbor.dumps(n).hex() == enc
        assert cbor2.loads(cbor.dumps(n)) == n
