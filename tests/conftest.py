"""Shared test hygiene."""

import pytest


@pytest.fixture(autouse=True)
def _stop_leftover_aggregators():
    """A test that fails before stopping its in-process aggregator must not leave it
    running: its helper processes and threads would leak into later tests (a fork
    with live threads can deadlock; helper-process counts would be off)."""
    yield
    from tests import test_e2e_support

    for agg in list(test_e2e_support.LIVE):
        agg.stop()
