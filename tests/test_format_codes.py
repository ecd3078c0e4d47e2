"""The rejection code docs/FORMAT.md (sections 2 and 2.4) gives for the cases where a decoder written from the
doc alone and the host once chose different codes: a handful of messages per case, each with its code.

The cases: the origin of the nesting depth (the top-level item is depth 1), major-type-7 heads that are not
well-formed (``cbor``, not ``type``), ``cbor`` decided over the whole message before ``type``, a top-level item
that is not a map (``version``), the ``L`` rule (``schema``) before the length of ``ctr`` (``shape``), zero
fractions, dbits ``w`` and ``encoding`` before ``noise``.
"""

from __future__ import annotations

import array
from typing import Any

import cbor2
import pytest

from pansketch.agent import cbor, release
from pansketch.agent.params import Params
from pansketch.host_tools import cborscan
from pansketch.host_tools.ingest.decode import Rejected, decode

TOPIC = "pansketch/dev-a/release"
T0 = 1_700_000_000 // 3600

# (hex, code): short messages, most of them a map {"v": X} (a16176 X) or a bare item
BYTE_LEVEL = [
    # depth: the top-level item is at depth 1; an item at depth 5 is refused
    ("8181818100", "cbor"),  # [[[[0]]]]: the 0 at depth 5
    ("81818100", "version"),  # [[[0]]]: depth 4, well-formed, not a map
    ("a1617681818100", "cbor"),  # {"v": [[[0]]]}
    ("a16176818100", "version"),  # {"v": [[0]]}: depth 4
    ("a1617681c0818100", "cbor"),  # {"v": [tag([[0]])]}: a tag adds no depth, the 0 is at depth 5
    # major type 7: reserved and two-byte simple values below 32 are not well-formed (RFC 8949 3.3)
    ("a16176fc", "cbor"),
    ("a16176fd", "cbor"),
    ("a16176fe", "cbor"),
    ("a16176f800", "cbor"),
    ("a16176f81f", "cbor"),
    ("a16176ff", "cbor"),  # break outside an indefinite item
    ("a16176f820", "type"),  # simple value 32
    ("a16176f7", "type"),  # undefined
    ("a16176e0", "type"),  # simple value 0
    ("a16176f93c00", "type"),  # half float 1.0
    ("a16176f93c", "cbor"),  # a half float with a byte missing
    # cbor over the whole message before type
    ("c0", "cbor"),  # a tag without content
    ("c000", "type"),
    ("f93c0000", "cbor"),  # a float and a trailing byte
    ("a1c0617601", "cbor"),  # a tagged text as map key: not text
    ("a1f93c0001", "cbor"),  # a float as map key
    ("a2617602c0", "cbor"),  # a tag early, the message truncated later
    ("a26176f93c006164", "cbor"),  # a float early, a value missing later
    ("a26176f93c0061645f", "cbor"),  # a float early, an indefinite length later
    ("a26176c0026164c002", "type"),  # tags only: well-formed
    ("a2617602617602", "cbor"),  # duplicate key
    # a top-level item that is not a map has no v
    ("02", "version"),
    ("80", "version"),
    ("60", "version"),
    ("40", "version"),
    ("f6", "version"),
    ("a0", "version"),
]


def _code(raw: bytes) -> str:
    try:
        decode(raw, topic=TOPIC)
    except Rejected as exc:
        return exc.code
    return "ok"


@pytest.mark.parametrize("hexmsg,code", BYTE_LEVEL, ids=[h for h, _c in BYTE_LEVEL])
def test_byte_level_code(hexmsg: str, code: str) -> None:
    assert _code(bytes.fromhex(hexmsg)) == code


@pytest.mark.parametrize("hexmsg,code", [(h, c) for h, c in BYTE_LEVEL if c in ("cbor", "type")],
                         ids=[h for h, c in BYTE_LEVEL if c in ("cbor", "type")])
def test_scanner_alone_gives_the_byte_level_code(hexmsg: str, code: str) -> None:
    with pytest.raises(cborscan.ScanError) as ei:
        cborscan.scan(bytes.fromhex(hexmsg))
    assert ei.value.code == code
    with pytest.raises(cborscan.ScanError):  # the one-pass readers hand it to the general reader
        cborscan.scan(bytes.fromhex(hexmsg), known=cborscan.key_table(["v", "d"]))


def _release(**over: Any) -> bytes:
    cfg = {"device": "dev-a", "salt": "codes-salt", "kind": "cs", "d": 2, "w": 3, "window_s": 3600}
    kind = over.pop("cfg_kind", None)
    if kind == "dbits":
        cfg.update(kind="dbits", d=3, w=8, mechanism="dlap", budget="1")
    p = Params(cfg)
    raw = release.encode(p, 0, T0, T0 + 1, 0, array.array("i", [0] * p.cells))
    if not over:
        return raw
    m = cbor2.loads(raw)
    m.update(over)
    return cbor.dumps(m)


def test_valid_releases_still_pass() -> None:
    assert _code(_release()) == "ok" and _code(_release(cfg_kind="dbits")) == "ok"


def test_value_nesting_in_a_release() -> None:
    assert _code(_release(salt=[[0]])) == "schema"  # the 0 at depth 4
    assert _code(_release(salt=[[[0]]])) == "cbor"  # at depth 5


def test_tag_or_float_in_a_release_with_a_later_fault() -> None:
    raw = cbor2.dumps(cbor2.loads(_release()) | {"salt": cbor2.CBORTag(0, "x")}, canonical=True)
    assert _code(raw) == "type"
    assert _code(raw[:-1]) == "cbor"  # truncated after the tag
    assert _code(raw + b"\x00") == "cbor"  # trailing byte after it
    raw = cbor2.dumps(cbor2.loads(_release()) | {"clip": 1.5}, canonical=True)
    assert _code(raw) == "type" and _code(raw[:-1]) == "cbor"


def test_L_rule_is_schema_before_shape() -> None:
    assert _code(_release(L=2, ctr=b"\0" * 20)) == "schema"  # wrong L and wrong ctr length: L first
    assert _code(_release(ctr=b"\0" * 20)) == "shape"


@pytest.mark.parametrize("field", ["budget", "nint", "nout"])
def test_zero_numerator_or_denominator_is_schema(field: str) -> None:
    assert _code(_release(**{field: [0, 1]})) == "schema"
    assert _code(_release(**{field: [1, 0]})) == "schema"


def test_dbits_w_multiple_of_8() -> None:
    assert _code(_release(cfg_kind="dbits", w=12)) == "schema"
    assert _code(_release(cfg_kind="dbits", w=16)) == "ok"


def test_encoding_before_noise() -> None:
    raw = _release(nout=[3, 1])
    assert _code(raw) == "noise"
    long_v = raw.replace(b"\x61v\x02", b"\x61v\x18\x02")  # v = 2 with a non-shortest head
    assert long_v != raw and _code(long_v) == "encoding"
