"""The growth laws of pansketch.host_tools.bench.fleetscale, at two small sizes (the shape, not the speed).

`series` over all windows, with its running totals (the CLI's default), grows linearly in the windows
(it was quadratic: one scan of every release per bucket, then one merge and one exact noise
distribution of everything since the first bucket per running total), and `status` linearly in the devices (it was quadratic: the ledger scanned
every device's windows per device). A fleet-wide `freq` and `series` do not grow with the devices
(they read one roll-up row per window; each window's N device rows before, so 8x the devices cost
4-5x). Each size is measured as CPU time of the calls alone, best of
two, and the bound on the ratio sits halfway between the linear and the quadratic law in log terms,
so a loaded machine does not flip it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from pansketch.host_tools.bench import fleetscale
from pansketch.host_tools.query import series, status
from pansketch.host_tools.store.sqlite import Store


def _cpu(fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(2):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


@pytest.fixture(scope="module")
def stores(tmp_path_factory: Any) -> dict[tuple[int, int], str]:
    tmp = tmp_path_factory.mktemp("fleetscale")
    out = {}
    for n, w in [(30, 16), (30, 64), (120, 16), (200, 8), (1600, 8)]:
        db = str(tmp / ("s%dx%d.db" % (n, w)))
        fleetscale.build(db, n, w)
        out[(n, w)] = db
    return out


def _series(db: str) -> float:
    st = Store(db, readonly=True)
    series.series(st, ["item-1"], salt=fleetscale.SALT, step=3600, running=True)  # warm: imports, caches
    t = _cpu(lambda: series.series(st, ["item-1"], salt=fleetscale.SALT, step=3600, running=True))
    st.close()
    return t


def _status(db: str) -> float:
    st = Store(db, readonly=True)
    status.report(st, windows=0)
    t = _cpu(lambda: status.report(st, windows=0))
    st.close()
    return t


def test_series_grows_linearly_in_windows(stores: dict[tuple[int, int], str]) -> None:
    small, large = _series(stores[(30, 16)]), _series(stores[(30, 64)])
    assert large / small < 8.0, (small, large)  # 4x windows: linear 4, quadratic 16


def test_status_grows_linearly_in_devices(stores: dict[tuple[int, int], str]) -> None:
    small, large = _status(stores[(30, 16)]), _status(stores[(120, 16)])
    assert large / small < 8.0, (small, large)  # 4x devices: linear 4, quadratic 16


def _fleet_answers(db: str) -> tuple[float, float]:
    from pansketch.host_tools.query import core

    st = Store(db, readonly=True)
    f = lambda: core.freq(st, ["item-1"], salt=fleetscale.SALT)  # noqa: E731
    s = lambda: series.series(st, ["item-1"], salt=fleetscale.SALT, step=3600, running=True)  # noqa: E731
    f(), s()  # warm: imports, caches
    out = _cpu(f), _cpu(s)
    st.close()
    return out


def test_fleet_freq_and_series_do_not_grow_with_the_devices(stores: dict[tuple[int, int], str]) -> None:
    (f0, s0), (f1, s1) = _fleet_answers(stores[(200, 8)]), _fleet_answers(stores[(1600, 8)])
    # 8x devices: flat 1 (measured 1.3), linear 8 (the per-window device rows: 4-5 measured); halfway 2.83
    assert f1 / f0 < 2.83 and s1 / s0 < 2.83, (f0, f1, s0, s1)
