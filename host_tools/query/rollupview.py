"""A series' roll-ups read once: the store as each bucket's range query sees it, from memory.

A fleet-wide series asks :func:`pansketch.host_tools.query.core.select_merged` once per bucket; each
such query read the roll-ups overlapping its bucket (a scan of the roll-up table), their sums, noise
and device counts, and the store's flags, in its own read transaction: about 0.17 ms per bucket, 0.12 s
of a month of hourly buckets. :class:`RollupView` reads the roll-ups overlapping the whole series in
one query each (metadata, sums, noise draws, device counts) and answers those reads per bucket from
memory, passing every other read (boundary releases, devices, exclusions) to the store. The caller
holds one read transaction over the whole series (:meth:`RollupView.read_tx` is then a no-op), so the
prefetched rows and what is read later are one snapshot; the per-bucket code is unchanged, so each
bucket's merge is the one the store itself would give (tests/test_fleet_answers.py compares them).
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from pansketch.host_tools.store.rows import RollupInfo
from pansketch.host_tools.store.sql import SQLStore


class RollupView:
    """``store`` with the roll-ups overlapping [since, until) held in memory (see the module docstring)."""

    def __init__(self, store: SQLStore, since: float, until: float) -> None:
        self._store = store
        self.view_of = store  # what the view reads (pansketch.host_tools.store.excltable.is_sqlite)
        self._infos = store.rollups(since=since, until=until)  # ORDER BY win_s, win, id
        self._pos = {i.id: n for n, i in enumerate(self._infos)}
        by_t0 = sorted(range(len(self._infos)), key=lambda n: self._infos[n].t0)
        self._t0s = [self._infos[n].t0 for n in by_t0]
        self._by_t0 = by_t0
        self._span = max((i.t1 - i.t0 for i in self._infos), default=0)  # the longest roll-up
        ids = [i.id for i in self._infos]
        # by id: the store's own reads sum over their IN lists and so need no id column
        self._sum_of = {int(rid): np.frombuffer(blob, dtype="<i8").reshape(int(d), int(w))
                        for rid, d, w, blob in store._by_ids("SELECT id, d, w, sums FROM rollups WHERE id IN (%s)", ids)}
        self._noise: dict[int, dict[tuple[str, int, int], int]] = {rid: {} for rid in ids}
        for rid, mech, num, den, c in store._by_ids("SELECT rollup, mech, num, den, count FROM rollup_noise "
                                                    "WHERE rollup IN (%s)", ids):
            k = (mech, int(num), int(den))
            self._noise[int(rid)][k] = self._noise[int(rid)].get(k, 0) + int(c)
        self._counts = store.rollup_device_counts(ids)
        self._flags = (store.has_unrolled(), store.has_tree())
        self._device_count = store.device_count()
        self._all = store.all_devices()
        self.has_rollups = store.has_rollups

    def __getattr__(self, name: str) -> Any:  # every other read: the store's
        return getattr(self._store, name)

    @contextlib.contextmanager
    def read_tx(self) -> Iterator[None]:
        yield  # the caller's transaction spans the series

    def has_unrolled(self) -> bool:
        return self._flags[0]

    def has_tree(self) -> bool:
        return self._flags[1]

    def device_count(self) -> int:
        return self._device_count

    def all_devices(self) -> list[str]:
        return self._all

    def rollups(self, window: Optional[int] = None, since: Optional[float] = None,
                until: Optional[float] = None) -> list[RollupInfo]:
        """As :meth:`pansketch.host_tools.store.read.Reader.rollups` for a range inside the view's."""
        if window is not None or since is None or until is None:
            return self._store.rollups(window, since, until)
        # t0 < until and t1 > since, so t0 > since - the longest roll-up: a range of the t0 order
        lo = bisect.bisect_right(self._t0s, since - self._span)
        hi = bisect.bisect_left(self._t0s, until)
        hit = sorted(self._pos[self._infos[self._by_t0[n]].id] for n in range(lo, hi)
                     if self._infos[self._by_t0[n]].t1 > since)
        return [self._infos[n] for n in hit]

    def rollup_sums(self, ids: Sequence[int]) -> Iterator[np.ndarray]:
        for rid in ids:  # (the caller adds them up: any order)
            yield self._sum_of[rid]

    def rollup_noise(self, ids: Sequence[int]) -> dict[tuple[str, int, int], int]:
        out: dict[tuple[str, int, int], int] = {}
        for rid in ids:
            for k, c in self._noise[rid].items():
                out[k] = out.get(k, 0) + c
        return out

    def rollup_device_counts(self, ids: Sequence[int]) -> Optional[dict[int, int]]:
        if self._counts is None:
            return None
        return {rid: self._counts[rid] for rid in ids if rid in self._counts}
