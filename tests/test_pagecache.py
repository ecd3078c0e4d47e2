"""The database file's pages leave the kernel's page cache once they are on disk (pansketch.host_tools.store.pagecache).

Resident pages are counted with mincore(2) on a read-only mapping of the file (mapping faults nothing in).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time
from typing import Any

import pytest

from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.store import pagecache
from tests.support.host import T0, encoded, host_cfg, params, topic

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not pagecache.supported(),
                                reason="posix_fadvise and mincore: Linux")

MiB = 1 << 20


def resident(path: str) -> int:
    """Bytes of ``path`` in the page cache."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    n = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * n)()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec) * page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.fixture
def advice_taken(tmp_path):
    """Skip where the filesystem ignores the advice (tmpfs: its page cache is the data): a probe file
    dropped by a direct posix_fadvise call, not through the code under test."""
    probe = str(tmp_path / "probe.bin")
    _append(probe, 4 * MiB, sync=True)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    kept = resident(probe)
    os.unlink(probe)
    if kept > MiB:
        pytest.skip("this filesystem keeps pages advised DONTNEED (%d KiB of 4 MiB stayed)" % (kept >> 10))


def _append(path: str, n: int, sync: bool) -> None:
    with open(path, "ab") as f:
        f.write(os.urandom(n))
        f.flush()
        if sync:
            os.fsync(f.fileno())


def test_written_tail_drops_all_but_the_tail_and_covers_its_last_range_again(tmp_path, advice_taken):
    path = str(tmp_path / "f.bin")
    _append(path, 24 * MiB, sync=True)
    before = hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert resident(path) >= 20 * MiB  # just written: cached (else this test could not tell)
    tail = pagecache.WrittenTail(path, 4 * MiB)
    assert tail.forget() == 20 * MiB
    assert resident(path) <= 4 * MiB
    assert tail.forget() == 0  # the end has not moved
    # 8 MiB more, not yet on disk: advice may skip those pages, so the next call covers the last
    # `behind` bytes it advised before once more
    _append(path, 8 * MiB, sync=False)
    assert tail.forget() == 12 * MiB  # [16, 20) again and [20, 28)
    _append(path, 4 * MiB, sync=True)
    assert tail.forget() == 8 * MiB  # [24, 32)
    assert resident(path) <= 4 * MiB
    tail.close()
    # advice only: the bytes are the same
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read(24 * MiB)).hexdigest() == before


def test_written_tail_needs_a_positive_distance(tmp_path):
    path = str(tmp_path / "f.bin")
    open(path, "wb").close()
    with pytest.raises(ValueError):
        pagecache.WrittenTail(path, 0)


def _fill(tmp_path: Any, drop_mb: int) -> tuple[str, int, Aggregator]:
    """An aggregator with background checkpoints (every 50 ms) that stores 900 releases of 16 KiB."""
    db = str(tmp_path / ("drop%d.db" % drop_mb))
    a = Aggregator(host_cfg(tmp_path, aggregator={"db": db, "drop_cache_behind_mb": drop_mb}))
    a.store.background_checkpoints(interval=0.05, drop_behind=a.cfg.aggregator.drop_cache_behind_mb * MiB)
    e = T0 // 3600
    n = 0
    for dv in range(45):
        p = params("pc%02d" % dv, d=4, w=1024)
        for k in range(20):
            assert a.handle(topic(p.device), encoded(p, seq=k, elo=e + k, fill=dv + k)).stored
            n += 1
    return db, n, a


def _settled(a: Aggregator, db: str, want: Any, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    r = resident(db)
    while not want(r) and time.monotonic() < deadline:
        time.sleep(0.05)
        r = resident(db)
    return r


@pytest.mark.slow
def test_the_aggregators_checkpoints_leave_only_the_files_tail_cached_and_lose_nothing(tmp_path, advice_taken):
    db, n, a = _fill(tmp_path, 1)
    size = os.path.getsize(db)
    assert size >= 15 * MiB
    # once a checkpoint has copied the whole WAL, everything but the last MiB (and its rounding to a
    # MiB) may go; pages that SQLite writes again after their advice come back and stay: the schema,
    # devices and roll-ups near the file's start (about 1 MiB here), and in some runs a few whole MiB in
    # the file's middle (no disk reads meanwhile: written, not read back; 13-36% of the file resident in
    # 12 runs of this fill, up to 44% in 8 runs of a fill in time order). The bound: the drop took effect
    # for at least half of the file (without it, >= 90% stays: the control below)
    r = _settled(a, db, lambda r: r <= 0.5 * size)
    assert r <= 0.5 * size, (r, size)
    assert a.store.written_tail is not None and a.store.written_tail.done >= size - 2 * MiB
    a.close()
    assert a.store.written_tail is None
    ro = hostconfig.from_dict({"fleet": {"salt": a.cfg.fleet.salt}, "aggregator": {"db": db}})
    b = Aggregator(ro)
    assert b.store.release_count() == n
    assert sum(int(c.sum()) for c in b.store.iter_counters()) == sum(
        4 * 1024 * (dv + k) for dv in range(45) for k in range(20))
    b.close()


@pytest.mark.slow
def test_with_the_drop_off_the_file_stays_cached(tmp_path, advice_taken):
    """The control: the same ingest with ``drop_cache_behind_mb = 0`` leaves the file in the page cache,
    so the test above sees the advice, not the kernel's own eviction."""
    db, _n, a = _fill(tmp_path, 0)
    time.sleep(0.3)
    assert a.store.written_tail is None
    assert resident(db) >= 0.9 * os.path.getsize(db)
    a.close()


def test_drop_cache_behind_mb_is_read_from_the_config_and_checked(tmp_path):
    assert host_cfg(tmp_path).aggregator.drop_cache_behind_mb == 64
    assert host_cfg(tmp_path, aggregator={"drop_cache_behind_mb": 0}).aggregator.drop_cache_behind_mb == 0
    with pytest.raises(hostconfig.ConfigError) as exc:
        host_cfg(tmp_path, aggregator={"drop_cache_behind_mb": -1})
    assert exc.value.key == "aggregator.drop_cache_behind_mb"


@pytest.mark.slow
def test_a_failing_advice_is_logged_once_and_turned_off_and_ingest_goes_on(tmp_path, monkeypatch, caplog):
    calls = []

    def broken(*args: Any) -> None:
        calls.append(args)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "posix_fadvise", broken)
    with caplog.at_level("WARNING", logger="pansketch.store"):
        db, n, a = _fill(tmp_path, 1)
        deadline = time.monotonic() + 10
        while a.store.written_tail is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.store.written_tail is None
        p = params("pc-late", d=4, w=1024)
        assert a.handle(topic(p.device), encoded(p, seq=0, elo=T0 // 3600)).stored
        time.sleep(0.2)
        a.close()
    assert len(calls) == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "pansketch.store"]
    assert warnings == ["not dropping cached database pages any more: [Errno 5] Input/output error"]
    b = Aggregator(host_cfg(tmp_path, aggregator={"db": db}))
    assert b.store.release_count() == n + 1
    b.close()
