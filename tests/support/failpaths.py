"""Shared by tests/test_failpaths.py and the tests that build on it: BASE, CASES, EXCS, KINDS, MODES, P, _collect, _null_leak, _signed, _stages, cfg_for, leak_moments, run_py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
import numpy as np
from tests.support import failpaths_scenario as fs


P = 2147483647


BASE = {"device": "dev-f", "salt": "fleet-salt-1", "mechanism": "dlap", "budget": "1/2", "persist_s": 200,
        "epoch_s": 600}


MODES = {"window": {"mode": "window", "window_s": 600}, "keep": {"mode": "keep", "window_s": 1800},
         "tree": {"mode": "tree", "levels": 3}}


KINDS = {"cms": {"kind": "cms", "d": 4, "w": 32}, "cs": {"kind": "cs", "d": 4, "w": 32},
         "dcs": {"kind": "dcs", "b": 4, "map": [2, 1, 10], "d": 2, "w": 16}}


def cfg_for(kind: str, mode: str, scheme: str) -> dict[str, Any]:
    c = dict(BASE)
    c.update(KINDS[kind])
    c.update(MODES[mode])
    c["persist_noise"] = scheme
    return c


# every kind x mode x scheme the config accepts (tree: cms and cs only; dbits: below)
CASES = [(k, m, s) for k in ("cms", "cs", "dcs") for m in ("window", "keep", "tree") for s in ("refresh", "shadow")
         if not (m == "tree" and k == "dcs")]


def _null_leak(noise: np.ndarray, ev: np.ndarray) -> bool:
    """True if some c has c . noise = 0 (mod P) for every cell and c . ev != 0."""
    v, c = noise.shape
    m = np.concatenate([noise % P, np.eye(v, dtype=np.int64)], axis=1)
    r = 0
    for col in range(c):
        nz = np.nonzero(m[r:, col])[0]
        if len(nz) == 0:
            continue
        piv = r + int(nz[0])
        if piv != r:
            m[[r, piv]] = m[[piv, r]]
        m[r] = (m[r] * pow(int(m[r, col]), P - 2, P)) % P
        f = m[:, col].copy()
        f[r] = 0
        rows = np.nonzero(f)[0]
        if len(rows):
            m[rows] = (m[rows] - (f[rows, None] * m[r]) % P) % P
        r += 1
        if r == v:
            return False
    null = m[r:, c:]
    if null.size == 0:
        return False
    # ev is small (event counts): the products stay far below 2**63
    return bool((((null @ ev) % P) != 0).any())


def _signed(vals: list[int]) -> list[int]:
    return [((x + 2**31) % 2**32) - 2**31 for x in vals]


def _collect(res: dict[str, Any], k: int) -> list[list[int]]:
    """The arrays an intrusion right after operation k reads."""
    out = [a for a in res["views"][k - 1][1]]
    for path, op, arrs in res["sessions"]:
        if op <= k:
            out.extend(arrs)
    for path, op, arrs in res["sessions"]:  # releases published later (the adversary sees every release)
        if op > k and path.endswith(".tmp.new"):
            seq = int(path.rsplit("/", 1)[1][:10])
            if seq in res["published"] and len(arrs) == 1 and len(arrs[0]) == len(out[0]):
                out.extend(arrs)
    return out


def leak_moments(a: dict[str, Any], b: dict[str, Any]) -> list[int]:
    """Operations after which an intrusion recovers exact events by a linear combination."""
    assert len(a["sessions"]) == len(b["sessions"]) and a["stages"] == b["stages"]
    bad = []
    for k in range(1, len(a["views"]) + 1):
        va = _collect(a, k)
        vb = _collect(b, k)
        assert [len(x) for x in va] == [len(x) for x in vb]
        n = max(len(x) for x in va)
        lens = sorted(set(len(x) for x in va) | {n})
        lo = 0
        leak = False
        for hi in lens:
            if hi <= lo:
                continue
            idx = [i for i, x in enumerate(va) if len(x) >= hi]
            nb = np.array([_signed(vb[i][lo:hi]) for i in idx], dtype=np.int64)
            ne = np.array([_signed(va[i][lo:hi]) for i in idx], dtype=np.int64) - nb
            ne = (ne + 2**31) % 2**32 - 2**31
            assert nb.shape[1] >= nb.shape[0] + 4, "too few cells for an exact null space: %s" % (nb.shape,)
            if _null_leak(nb, ne):
                leak = True
            lo = hi
        if leak:
            bad.append(k)
    return bad


def run_py(cfg: dict[str, Any], root: Path, events: bool, fail_at: int, exc: str) -> dict[str, Any]:
    return json.loads(fs.dump(cfg, str(root), "seed-1", events, fail_at, exc))


EXCS = ("enospc", "memory", "eio")


def _stages(cfg: dict[str, Any], root: Path) -> list[tuple[int, str, str]]:
    views, fl, _ = fs.run(cfg, str(root), "seed-1", True)
    return fl.stages
