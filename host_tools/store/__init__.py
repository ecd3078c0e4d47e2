"""Store: the release store and what it keeps.

records (the validated release, its shape, the refusal), core (the SQL store
shared by both backends, and its SQLite backend), pg (the PostgreSQL backend),
backend (``open_store``: which backend serves ``[aggregator] db``), pgserver
(a throwaway PostgreSQL server) and ledger (the privacy ledger).
May import: agent, host_tools.hostconfig, host_tools.fasthash, host_tools.cborscan. Nothing else of
host_tools: ingest and query build on the store, never the other way round.
"""
