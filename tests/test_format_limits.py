"""docs/FORMAT.md's limits table (section 2.3) is the validator's constants, and the host enforces each limit.

The table is parsed from the doc: every row's ``value`` column must equal the constant its ``constant``
column names (in pansketch.host_tools.ingest.decode, pansketch.host_tools.cborscan or pansketch.agent.params), so a changed constant
or a changed doc fails here. Then the limits where an independent decoder written from the doc once
disagreed with the host are checked on real releases, on both sides of each bound.
"""

from __future__ import annotations

import array
import re
from pathlib import Path
from typing import Any

import cbor2
import pytest

from pansketch.agent import cbor, params as agent_params, release
from pansketch.agent.params import Params
from pansketch.host_tools import cborscan
from pansketch.host_tools.ingest import decode as dec
from pansketch.host_tools.ingest.decode import Rejected, decode

ROOT = Path(__file__).resolve().parent.parent
FORMAT = ROOT / "docs" / "FORMAT.md"
T0 = 1_700_000_000 // 3600 * 3600


def _limits_table() -> list[tuple[str, list[int], str]]:
    text = FORMAT.read_text(encoding="utf-8")
    sec = text.split("### 2.3 Limits the host enforces", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in sec.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 4 or cells[0] in ("limit", "---") or set(cells[0]) <= {"-"}:
            continue
        values = [int(v) for v in re.findall(r"`(\d+)`", cells[-2])]
        rows.append((cells[0], values, cells[-1].strip("`")))
    return rows


def _constant(name: str) -> Any:
    if name.startswith("cborscan."):
        return getattr(cborscan, name.split(".", 1)[1])
    if name == "MAX_LEVELS":
        return agent_params.MAX_LEVELS
    if name.startswith("decode(max_bytes"):
        return decode.__defaults__[1]  # type: ignore[index]
    return getattr(dec, name)


def test_table_parsed() -> None:
    rows = _limits_table()
    assert len(rows) >= 20, rows
    names = {c for _l, _v, c in rows}
    assert {"MAX_U32", "MAX_CLIP", "MAX_SPAN", "MAX_EPOCH", "MAX_SECONDS", "DBITS_NZ"} <= names


@pytest.mark.parametrize("limit,values,name", _limits_table())
def test_doc_limit_is_the_validators_constant(limit: str, values: list[int], name: str) -> None:
    const = _constant(name)
    got = list(const) if isinstance(const, tuple) else [const]
    assert values == got, "docs/FORMAT.md section 2.3 %r says %s, the validator's %s is %s" % (limit, values, name, got)


def test_dbits_eps_limit_is_the_exact_root() -> None:
    """The doc's ε* digits lie on the right side of dbits_eps_ok's exact decision."""
    text = FORMAT.read_text(encoding="utf-8")
    digits = re.search(r"ε\* = (1\.59362426\d+)", text)
    assert digits, "FORMAT.md gives ε* with its digits"
    s = digits.group(1)
    num, den = int(s.replace(".", "")), 10 ** (len(s) - 2)
    lo, hi = num - 1, num + 1  # one unit in the last digit either side
    assert agent_params.dbits_eps_ok(lo, den) and not agent_params.dbits_eps_ok(hi, den)


# -- the limits on real releases --------------------------------------------------------------


def _p(**kw: Any) -> Params:
    cfg = {"device": "dev-a", "salt": "limits-salt", "kind": "cs", "d": 4, "w": 64, "window_s": 3600}
    cfg.update(kw)
    return Params(cfg)


def _release(p: Params, cells: int, **over: Any) -> bytes:
    raw = release.encode(p, 0, T0 // p.epoch_s, T0 // p.epoch_s + 1, 0, array.array("i", [0] * cells))
    if not over:
        return raw
    m = cbor2.loads(raw)
    m.update(over)
    return cbor.dumps(m)


def _code(raw: bytes) -> str:
    try:
        decode(raw, topic="pansketch/dev-a/release")
    except Rejected as exc:
        return exc.code
    return "ok"


def test_seq_and_part_up_to_2_pow_32_minus_1() -> None:
    p = _p()
    assert _code(_release(p, 4 * 64, seq=(1 << 32) - 1, part=(1 << 32) - 1)) == "ok"
    assert _code(_release(p, 4 * 64, seq=1 << 32)) == "schema"
    assert _code(_release(p, 4 * 64, part=1 << 32)) == "schema"


def test_span_up_to_2_pow_20_epochs() -> None:
    p = _p(mode="keep", epoch_s=60)
    elo = T0 // 60
    assert _code(_release(p, 4 * 64, elo=elo, ehi=elo + (1 << 20), win=elo * 60 // 3600)) == "ok"
    assert _code(_release(p, 4 * 64, elo=elo, ehi=elo + (1 << 20) + 1, win=elo * 60 // 3600)) == "schema"


def test_dbits_nz_is_exactly_2() -> None:
    p = _p(kind="dbits", d=3, w=8, mechanism="dlap", budget="1")
    assert _code(_release(p, 3)) == "ok"
    assert _code(_release(p, 3, nz=3)) == "schema"


def test_strhh_needs_d_at_least_3() -> None:
    p = _p(kind="strhh", d=3, w=64, mechanism="dlap", budget="1")
    raw = _release(p, 12 * 3 * 64)
    assert _code(raw) == "ok"
    assert _code(_release(p, 12 * 3 * 64, d=2, ctr=b"\0" * (4 * 12 * 2 * 64))) == "schema"


def test_non_deterministic_encoding_is_refused() -> None:
    raw = _release(_p(), 4 * 64)
    m = cbor2.loads(raw)
    assert cbor2.dumps(m) == raw
    shuffled = dict(reversed(list(m.items())))  # same content, keys out of the deterministic order
    assert _code(cbor2.dumps(shuffled)) == "encoding"
    m["seq"] = 0
    long_head = raw.replace(b"cseq\x00", b"cseq\x18\x00")  # seq 0 with a non-shortest head
    assert cbor2.loads(long_head) == m and _code(long_head) == "encoding"
