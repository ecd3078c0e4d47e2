"""Query: estimators, merging, every query kind (``pansketch query``: freq, topk, series, quantile, cdf, heavy, distinct), fleet status and plots.

kinds is the registry of query kinds (the CLI in cli, the dashboard and the
JSON API take them from there); core answers freq/topk, series, dyadic_cli
and distinct the others; point_cli and series_cli print them.
May import: agent, pansketch.host_tools.store, pansketch.host_tools.hostconfig, pansketch.host_tools.fasthash.
Never ingest, web, metrics, bench or lab: the dashboard and the CLI call in here.
"""
