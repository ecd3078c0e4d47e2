"""Shared by tests/test_metrics.py and the tests that build on it: scrape, val; scan_twice (the flag scanner)."""

from __future__ import annotations

import urllib.request
from typing import Any


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode("utf-8")
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict[Any, float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), float("nan"))


def scan_twice(db: str, name: str, windows: int = 2) -> tuple[list[str], Any]:
    """Run the aggregator's flag scanner over ``db`` twice (the second scan must log nothing new) and
    return the lines it logged and the scanner."""
    import logging

    from pansketch.host_tools import metrics

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    lg = logging.getLogger(name)
    lg.addHandler(Keep())
    sc = metrics.FlagScanner(db, lg, windows=windows)
    sc.scan()
    sc.scan()
    return lines, sc
