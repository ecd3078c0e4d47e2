"""pansketch host tools, one package per role.

ingest (the aggregator service) and query (every query kind, status) build on
store (the release store); web (dashboard, JSON API) shows query; metrics
exports the aggregator's and the store's Prometheus metrics; audit (privacy
audit), bench (benchmarks) and lab (paper algorithms and reproductions) stand
apart. cli and demo are the entry points and alone import web, bench and lab;
hostconfig, fasthash, cborscan, logsetup and localnet serve every role. tests/test_layering.py
checks these directions and that there are no import cycles.
"""
