"""Shared test hygiene."""

import os
import tempfile

import pytest

# Caches the host keeps between processes (host_tools.query.distinct's sampling bands) go to a
# directory of this test run, not the user's ~/.cache (set before any test starts a process).
os.environ.setdefault("PANSKETCH_CACHE_DIR", tempfile.mkdtemp(prefix="pansketch-test-cache-"))


@pytest.fixture(autouse=True)
def _stop_leftover_aggregators():
    """A test that fails before stopping its in-process aggregator must not leave it
    running: its helper processes and threads would leak into later tests (a fork
    with live threads can deadlock; helper-process counts would be off)."""
    yield
    from tests import test_e2e_support

    for agg in list(test_e2e_support.LIVE):
        agg.stop()
