"""docs/FORMAT.md's worked example is exactly what the encoder produces,
and releases follow the deterministic-CBOR rules it specifies."""

import re
from pathlib import Path

import cbor2

from pansketch.agent import cbor, release
from pansketch.agent.params import Params
from pansketch.agent.sketch import new_counters

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
    from pansketch.host_tools.ingest.decode import decode

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


def strhh_example():
    p = Params({"device": "pico-7", "salt": "fleet-salt-1", "kind": "strhh", "len": 3, "d": 3, "w": 2,
                "mechanism": "dlap", "budget": "1", "persist_noise": "refresh"})
    noisy = [3, -4, 1, 4, -6, 2, -2, 6, -3, -1, 2, 0, 5, 0, 0, 1, 0, 6]
    c = new_counters(18)
    for i, v in enumerate(noisy):
        c[i] = v
    return release.encode(p, 42, 480000, 480001, 0, c)


def test_strhh_worked_example_decodes_as_documented():
    """The strhh example's bytes are the encoder's; the host decodes them to the documented fields;
    the documented columns/signs are hash version 1's; counters minus the documented noise are the
    exact counters of the events ab, ab, x; the documented node estimates are the host's."""
    import numpy as np

    from pansketch.agent import hashing
    from pansketch.agent.strhh import encode_item, level_prefix
    from pansketch.host_tools import fasthash
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.query import strheavy

    b = strhh_example()
    assert _doc_block(len(b)) == b and len(b) == 262
    r = decode(b)
    assert (r.kind, r.levels, r.d, r.w, r.nint, r.L) == ("strhh", 3, 3, 2, (9, 1), 3)
    C = r.counters()
    assert C.shape == (9, 2) and C.ravel().tolist() == list(memoryview(cbor2.loads(b)["ctr"]).cast("i"))
    noise = np.array([3, -1, 0, 2, -4, 1, 0, 5, -2, -1, 1, 0, 2, 0, -3, 1, -1, 4]).reshape(9, 2)
    assert ((C - noise) == strheavy.exact_counters(["ab", "ab", "x"], 3, 3, 2, "fleet-salt-1")).all()
    text = DOC.read_text()
    sec = text[text.index("#### Worked example (strhh)"):text.index("#### Kind `dbits`")]
    pre = hashing.salt_prefix("fleet-salt-1")
    for lv in range(3):
        for it in ("ab", "x"):
            node = encode_item(it, 3)[:lv + 1]
            st = bytes(hashing.digest(level_prefix(pre, lv), node, 3))
            cols, signs = fasthash.cols_signs(np.frombuffer(st, dtype=np.uint8)[None, :], 3, 2)
            row = "| %d | `%s` | `%s` | %s | %s |" % (
                lv, " ".join("%02x" % x for x in node),
                " ".join(st[i:i + 4].hex() for i in (0, 4, 8)), ", ".join(str(x) for x in cols[0]),
                ", ".join("+1" if s > 0 else "\u22121" for s in signs[0]))
            assert row in sec, row
    v = strheavy.PrefixView(C, 3, 3, 2, "fleet-salt-1", [])
    assert v.node_est(1, [b"ab"])[0] == 2 and v.node_est(2, [b"ab\x00"])[0] == 5
