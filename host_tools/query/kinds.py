"""The registry of query kinds: ``pansketch query KIND``, the dashboard's pages and the JSON API take them from here.

Each kind names its arguments and its runner (the CLI adds the shared
selection and output options: pansketch.host_tools.query.cli), the device sketch
kinds whose releases it reads, and where the dashboard shows it: ``page``
and ``api`` are paths that ``pansketch.host_tools.web.app.Dashboard`` serves with its
method ``page_<name>`` / ``api_<name>`` (``/item`` -> ``page_item``,
``/api/cdf`` -> ``api_cdf``), listed in the dashboard's menu by ``nav``. The store metrics (pansketch.host_tools.metrics)
count releases per device; a kind with ``metrics`` also exports its answer at every scrape of
``pansketch serve``'s /metrics (kind heavy: the top strings of the last day of strhh releases).

Adding a kind: a module with the query function, ``add_arguments`` and
``run`` (as pansketch.host_tools.query.series_cli), plus one :class:`QueryKind` in
:data:`KINDS`; a dashboard page is a ``page_<name>`` method of the web app.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pansketch.host_tools.store.sql import SQLStore

POINT = ("cms", "cs")  # the point-query sketches (Count-Min, CountSketch)
# run(args, store, salt, confidence, since, until) -> exit code; it prints the answer
Runner = Callable[[argparse.Namespace, SQLStore, str, float, Optional[float], Optional[float]], int]
# metrics(store, salt) -> Prometheus metric families of the kind's answer ([] when the store has none)
MetricsFn = Callable[[SQLStore, str], list[Any]]


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported at the first call: a command imports the module of its own kind only
    (the dcs/dbits/strhh modules cost every `freq` process about 80 ms of imports)."""
    def call(*args: Any, **kw: Any) -> Any:
        return getattr(importlib.import_module("pansketch.host_tools.query." + module), name)(*args, **kw)

    call.__name__ = call.__qualname__ = name
    return call


@dataclass(frozen=True)
class QueryKind:
    """One query kind: ``pansketch query <name>`` and its place on the dashboard."""

    name: str
    help: str  # the one line of ``pansketch query --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]  # its own arguments, before the shared ones
    run: Runner
    sketches: tuple[str, ...]  # the device sketch kinds (pansketch.agent.params) whose releases it reads
    page: Optional[str] = None  # dashboard page showing it
    api: Optional[str] = None  # JSON endpoint answering it
    nav: Optional[tuple[str, str]] = None  # (menu label, page title): the page's menu entry, on one kind per page
    metrics: Optional[MetricsFn] = None  # its answer as Prometheus gauges on /metrics (needs the fleet salt)

    @property
    def hint(self) -> Optional[str]:
        """The menu entry's tooltip: the device kind a page needs, unless it is the default (cms/cs)."""
        return None if self.sketches == POINT else "kind " + "/".join(self.sketches)

    @staticmethod
    def handler(path: str) -> str:
        """The dashboard method serving ``path``: /item -> page_item, /api/cdf -> api_cdf."""
        parts = path.strip("/").split("/")
        return "api_" + parts[1] if parts[0] == "api" else "page_" + parts[0]


KINDS: tuple[QueryKind, ...] = (
    QueryKind("freq", "frequency of items", _lazy("point_cli", "add_freq_arguments"), _lazy("point_cli", "run"),
              POINT,
              page="/item", api="/api/freq", nav=("Item over time", "item")),
    QueryKind("topk", "top-k among candidate items", _lazy("point_cli", "add_topk_arguments"),
              _lazy("point_cli", "run"), POINT,
              page="/topk", api="/api/topk", nav=("Top-k", "top-k")),
    QueryKind("series", "count per window (or --step bucket) with intervals; --plot draws bands",
              _lazy("series_cli", "add_arguments"), _lazy("series_cli", "run"), POINT, page="/item", api="/api/series"),
    QueryKind("quantile", "quantiles of readings (kind dcs) with rank intervals",
              _lazy("dyadic_cli", "add_quantile_arguments"), _lazy("dyadic_cli", "run"), ("dcs",), page="/quantiles",
              api="/api/quantiles", nav=("Quantiles", "quantiles")),
    QueryKind("cdf", "the CDF of readings (kind dcs) with intervals", _lazy("dyadic_cli", "add_cdf_arguments"),
              _lazy("dyadic_cli", "run"), ("dcs",), page="/quantiles", api="/api/cdf"),
    QueryKind("heavy", "heaviest values (kind dcs) or strings (kind strhh), no candidate list",
              _lazy("dyadic_cli", "add_heavy_arguments"), _lazy("dyadic_cli", "run"), ("dcs", "strhh"), page="/heavy",
              api="/api/heavy",
              nav=("Heavy hitters", "heavy hitters"), metrics=_lazy("strheavy_cli", "metric_families")),
    QueryKind("distinct", "distinct items (kind dbits): sum of per-device, per-window counts",
              _lazy("dyadic_cli", "add_distinct_arguments"), _lazy("dyadic_cli", "run"), ("dbits",),
              page="/distinct", api="/api/distinct",
              nav=("Distinct", "distinct")),
)
BY_NAME: dict[str, QueryKind] = {k.name: k for k in KINDS}


def get(name: str) -> QueryKind:
    """The kind called ``name`` (KeyError if none is registered)."""
    return BY_NAME[name]
