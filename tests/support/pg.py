"""What every PostgreSQL test module starts with: psycopg and the server binaries (Debian's
``postgresql``) present, or the module skipped -- failed, not skipped, in CI, which must run them."""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from pansketch.host_tools.store import pgserver

try:
    import psycopg  # noqa: F401

    PSYCOPG = True
except ImportError:  # pragma: no cover
    PSYCOPG = False


def _require() -> None:
    if os.environ.get("CI") and (pgserver.binaries() is None or not PSYCOPG):
        raise RuntimeError("CI must run the PostgreSQL tests: " + (pgserver.MISSING if PSYCOPG else "psycopg missing"))


def marks() -> list[Any]:
    """A whole module's ``pytestmark`` (raises at import in CI when PostgreSQL or psycopg is missing)."""
    _require()
    return [pytest.mark.skipif(pgserver.binaries() is None, reason=pgserver.MISSING),
            pytest.mark.skipif(not PSYCOPG, reason="psycopg 3 is not installed (pip install 'psycopg[binary]')")]


def server() -> Iterator[pgserver.PgServer]:
    """The body of a module fixture for modules whose other tests need no PostgreSQL: one throwaway
    server, or the test skipped (failed in CI)."""
    if pgserver.binaries() is None or not PSYCOPG:
        _require()
        pytest.skip(pgserver.MISSING)
    srv = pgserver.PgServer.start()
    yield srv
    srv.stop()
