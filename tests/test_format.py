"""docs/FORMAT.md's worked example is exactly what the encoder produces,
and releases follow the deterministic-CBOR rules it specifies."""

import re
from pathlib import Path

import cbor2

from agent import cbor, release
from agent.params import Params
from agent.sketch import new_counters

DOC = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def _ctr():
    c = new_counters(6)
    for i, v in enumerate([5, -2, 0, 1, 70000, -1]):
        c[i] = v
    return c


def example_bytes():
    """The version-1 example: what a device before format v2 sent (no lvl)."""
    p = Params({"device": "pico-7", "salt": "fleet-salt-1", "kind": "cs", "d": 2, "w": 3, "mode": "keep",
                "window_s": 3600, "epoch_s": 600, "mechanism": "dgauss", "budget": "1/2"})
    m = release.release_map(p, 42, 1200000, 1200001, 0, _ctr(), nz=3)
    del m["lvl"]
    m["v"] = 1
    m["ctr"] = bytes(m["ctr"])
    return cbor.dumps(m)


def tree_example_bytes():
    p = Params({"device": "pico-7", "salt": "fleet-salt-1", "kind": "cs", "d": 2, "w": 3, "mode": "tree",
                "levels": 4, "epoch_s": 3600, "mechanism": "dgauss", "budget": "1/2"})
    return release.encode(p, 42, 480000, 480004, 0, _ctr(), nz=3, lvl=2)


def _doc_block(n):
    text = DOC.read_text()
    return bytes.fromhex(re.search(r"%d bytes:\n\n```\n([0-9a-f\n]+)```" % n, text).group(1).replace("\n", ""))


def test_worked_example_matches_encoder():
    assert _doc_block(len(example_bytes())) == example_bytes()


def test_tree_worked_example_matches_encoder_and_host():
    from host_tools.ingest.decode import decode

    b = tree_example_bytes()
    assert _doc_block(len(b)) == b
    r = decode(b)
    assert (r.v, r.mode, r.lvl, r.L, r.win, r.win_s, r.nint) == (2, "tree", 2, 4, 60000, 28800, (8, 1))
    r1 = decode(example_bytes())  # hosts still read version 1
    assert (r1.v, r1.lvl, r1.mode) == (1, 0, "keep")


def test_release_is_canonical_cbor_without_tags_or_floats():
    assert len(cbor2.loads(tree_example_bytes())) == 24
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
