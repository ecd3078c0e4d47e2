"""Which store serves ``[aggregator] db``: SQLite (pansketch.host_tools.store.sqlite) or PostgreSQL (pansketch.host_tools.store.pg).

The one place that picks a backend; every reader and writer opens its store here.
"""

from __future__ import annotations

from typing import Optional

from pansketch.host_tools.store.sql import SQLStore
from pansketch.host_tools.store.sqlite import Store

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(db: str) -> bool:
    """True when ``db`` is a PostgreSQL URL rather than a SQLite file path."""
    return db.startswith(POSTGRES_SCHEMES)


def open_store(db: str, readonly: bool = False, timeout: float = 30.0, compress: Optional[bool] = None) -> SQLStore:
    """The store for ``[aggregator] db``: a SQLite file path or a ``postgresql://`` URL. ``compress``
    (``[store] compress``): write payloads in the stored encoding (None: the backend's default,
    SQLStore.compress_default_bytes)."""
    st: SQLStore
    if is_postgres(db):
        from pansketch.host_tools.store.pg import PgStore  # psycopg only when PostgreSQL is used

        st = PgStore(db, readonly=readonly, timeout=timeout)
    else:
        st = Store(db, readonly=readonly, timeout=timeout)
    if compress is not None:
        st.compress = compress
    return st
