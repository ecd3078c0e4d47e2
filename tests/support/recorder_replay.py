"""One recorder run, the same on CPython and in the MicroPython VM (tests/support/mpvm.py), for the tests that
assert both write the same bytes (tests/test_dcs_device.py, tests/test_strhh.py).

The run: twelve 5-minute steps from :data:`T0`; odd steps feed their events with ``add_many``, even
ones with one ``add`` each; a persist after step 5; a tick after every step and at T0 + 1 h.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import cbor2

from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools.ingest.decode import decode
from tests.support import mpvm

T0 = 200_000 * 3600
STEPS = 12

_GUEST = """
from pansketch.agent.params import Params
from pansketch.agent.recorder import Recorder
from pansketch.agent.rng import Rng, DeterministicSource
EV = %r
rec = Recorder(Params(%r), "/flash/dev", %d, rng=Rng(DeterministicSource(%r)), log=lambda m: None)
def step(k):
    if k %% 2:
        rec.add_many(EV[k])
    else:
        for x in EV[k]:
            rec.add(x)
    if k == 5:
        rec.persist(%d)
    rec.tick(%d + k * 300)
"""


def run_cpython(root: Path, cfg: dict[str, Any], seed: bytes, events: Sequence[list[Any]]) -> None:
    """The run on CPython into ``root``; ``events[k]``: step k's events."""
    rec = Recorder(Params(cfg), str(root), T0, rng=Rng(DeterministicSource(seed)), log=lambda m: None)
    for k in range(STEPS):
        if k % 2:
            rec.add_many(events[k])
        else:
            for x in events[k]:
                rec.add(x)
        if k == 5:
            rec.persist(T0 + 100)
        rec.tick(T0 + k * 300)
    rec.tick(T0 + 3600)


def released(root: Path) -> list[tuple[bytes, dict[str, Any], Any]]:
    """The releases in ``root``'s outbox, oldest first: (the bytes, the CBOR map, the host's decoded Release)."""
    out = []
    for f in sorted((root / "outbox").glob("*.cbor")):
        raw = f.read_bytes()
        out.append((raw, cbor2.loads(raw), decode(raw, "pansketch/pico-7/release")))
    return out


def assert_same_on_micropython(tmp: Path, cfg: dict[str, Any], seed: bytes, events: Sequence[list[Any]],
                               releases: int) -> None:
    """The run in the VM (tmp/mp) and on CPython (tmp/cp): the same files, each byte-identical, and
    ``releases`` of them in the outbox."""
    steps = ([_GUEST % ([list(e) for e in events], cfg, T0, seed, T0 + 100, T0)]
             + ["step(%d)" % k for k in range(STEPS)] + ["rec.tick(%d)" % (T0 + 3600)])
    mp_root = tmp / "mp"
    mpvm.run(steps, heap=256 * 1024, flash=mp_root).check()
    cp_root = tmp / "cp"
    run_cpython(cp_root, cfg, seed, events)
    mp_files = sorted(p.relative_to(mp_root / "dev") for p in (mp_root / "dev").rglob("*") if p.is_file())
    cp_files = sorted(p.relative_to(cp_root) for p in cp_root.rglob("*") if p.is_file())
    assert mp_files == cp_files and len([f for f in cp_files if str(f).startswith("outbox/")]) == releases
    for f in cp_files:
        assert (mp_root / "dev" / f).read_bytes() == (cp_root / f).read_bytes(), f
