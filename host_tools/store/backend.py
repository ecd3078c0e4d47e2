"""Which store serves ``[aggregator] db``: SQLite (pansketch.host_tools.store.sqlite) or PostgreSQL (pansketch.host_tools.store.pg).

The one place that picks a backend; every reader and writer opens its store here.
"""

from __future__ import annotations

from pansketch.host_tools.store.sql import SQLStore
from pansketch.host_tools.store.sqlite import Store

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(db: str) -> bool:
    """True when ``db`` is a PostgreSQL URL rather than a SQLite file path."""
    return db.startswith(POSTGRES_SCHEMES)


def open_store(db: str, readonly: bool = False, timeout: float = 30.0) -> SQLStore:
    """The store for ``[aggregator] db``: a SQLite file path or a ``postgresql://`` URL."""
    if is_postgres(db):
        from pansketch.host_tools.store.pg import PgStore  # psycopg only when PostgreSQL is used

        return PgStore(db, readonly=readonly, timeout=timeout)
    return Store(db, readonly=readonly, timeout=timeout)
