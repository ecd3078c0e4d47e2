"""The store's own errors (a refused release is :class:`pansketch.host_tools.store.records.Rejected`)."""

from __future__ import annotations


class StoreError(Exception):
    """The store cannot be opened or used (message says what and where)."""


class PrunedError(StoreError, ValueError):
    """A query needs the counters of a release whose payload retention has pruned."""


class NotAStoreError(StoreError, FileNotFoundError):
    """The database file is empty or another program's: like a missing one (the dashboard shows its
    'no data yet' page for both; the CLI prints the one line and exits 1)."""
