"""Shared test hygiene, and the test tiers.

Tiers: a test module that needs a service (a broker, a database, a browser, a
MicroPython VM) is marked with it, read from its source: the helpers and
names it uses (SERVICES), also through the helper modules it imports from
``tests``. ``make test-fast`` deselects every such marker (pyproject.toml
lists them); ``make test`` runs everything.
"""

import os
import re
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# marker -> what in a module's source means it needs that service
SERVICES = {
    "mosquitto": r"needs_mosquitto|start_mosquitto|mosquitto_path|\bMosquitto\b|AggThread|start_broker",
    "postgresql": r"pgserver|postgres|PostgreSQL",
    "rabbitmq": r"needs_rabbitmq|start_cluster|rabbitmq",
    "chromium": r"needs_chromium|chromium",
    "micropython": r"\bmpvm\b|\bunixvm\b|\bmpunix\b",
}
_IMPORT = re.compile(r"^\s*(?:from tests(?:\.support)?(?:\.(\w+))? import ([\w, ]+)|import tests\.(\w+))", re.M)


def _service_marks(path, seen=None):
    """The SERVICES a test or helper module needs: its own, and those of the tests modules it imports."""
    seen = set() if seen is None else seen
    if path in seen or not path.is_file():
        return set()
    seen.add(path)
    text = path.read_text()
    marks = {m for m, rx in SERVICES.items() if re.search(rx, text)}
    for mod, names, plain in _IMPORT.findall(text):
        for name in ([mod] if mod else [] if plain else [n.strip().split(" ")[0] for n in names.split(",")]) + (
                [plain] if plain else []):
            for cand in (TESTS / (name + ".py"), TESTS / "support" / (name + ".py")):
                marks |= _service_marks(cand, seen)
    return marks


_MARKS = {}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path not in _MARKS:
            _MARKS[path] = _service_marks(path)
        for m in sorted(_MARKS[path]):
            item.add_marker(m)

# Caches the host keeps between processes (pansketch.host_tools.query.distinct's sampling bands) go to a
# directory of this test run, not the user's ~/.cache (set before any test starts a process).
os.environ.setdefault("PANSKETCH_CACHE_DIR", tempfile.mkdtemp(prefix="pansketch-test-cache-"))


@pytest.fixture(autouse=True)
def _stop_leftover_aggregators():
    """A test that fails before stopping its in-process aggregator must not leave it
    running: its helper processes and threads would leak into later tests (a fork
    with live threads can deadlock; helper-process counts would be off)."""
    yield
    from tests.support import e2e

    for agg in list(e2e.LIVE):
        agg.stop()
