"""The release store: an SQL backend interface, with SQLite (default) and PostgreSQL.

:func:`open_store` picks the backend from ``[aggregator] db``: a file path
is SQLite (:class:`Store`, this module; WAL, several aggregator processes
on one host may share the file), a ``postgresql://`` URL is PostgreSQL
(:class:`pansketch.host_tools.store.pg.PgStore`; any number of aggregators on any
number of hosts). Both run the same SQL from :class:`SQLStore`; a backend
supplies the connection, the transaction start, its DDL and its error types.

Import :class:`SQLStore` (the type every reader and writer holds) from here,
:class:`pansketch.host_tools.store.sqlite.Store` and :func:`pansketch.host_tools.store.backend.open_store`
from theirs.
"""

from __future__ import annotations

from typing import Any

from pansketch.host_tools.store.prune import Pruner
from pansketch.host_tools.store.read import Reader
from pansketch.host_tools.store.write import GroupWriter


class SQLStore(GroupWriter, Pruner, Reader):
    """Backend-independent store logic (SQL written with ``?`` placeholders): writes
    (pansketch.host_tools.store.write), retention (pansketch.host_tools.store.prune), reads (pansketch.host_tools.store.read)."""

    def __enter__(self) -> "SQLStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
