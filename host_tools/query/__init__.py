"""Query: estimators, merging, every query kind (``pansketch query``: freq, topk, series, quantile, cdf, heavy, distinct), fleet status and plots.

May import: agent, host_tools.store, host_tools.hostconfig, host_tools.fasthash.
Never ingest, web, bench or lab: the dashboard and the CLI call in here.
"""
