"""The ``device_exclusions`` table (pansketch.host_tools.store.exclusions): read by queries and by retention.

Apart from exclusions so that retention (pansketch.host_tools.store.prune, part of the store classes) reads it
without importing what builds on those classes. Created by the first exclusion; a store that never
excluded a device has no such table, and readers take that as "none excluded".
"""

from __future__ import annotations

from typing import Any

TABLE = "device_exclusions"
DDL = ("CREATE TABLE IF NOT EXISTS device_exclusions (device TEXT PRIMARY KEY, since DOUBLE PRECISION NOT NULL, "
       "reason TEXT NOT NULL)")


def is_sqlite(store: Any) -> bool:
    store = getattr(store, "view_of", store)  # a read view over a store (pansketch.host_tools.query.rollupview)
    return any(c.__module__ == "pansketch.host_tools.store.sqlite" for c in type(store).__mro__)


def has_table(store: Any, name: str = TABLE) -> bool:
    if is_sqlite(store):
        return bool(store._q("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)))
    return store._q("SELECT to_regclass(?)", (name,))[0][0] is not None


def excluded(store: Any) -> dict[str, tuple[float, str]]:
    """device -> (since, reason) of every excluded device (empty if none ever was)."""
    if not has_table(store):
        return {}
    return {str(d): (float(s), str(r)) for d, s, r in store._q("SELECT device, since, reason FROM device_exclusions")}
