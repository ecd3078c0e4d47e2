"""Store: the release store (SQLite in core, PostgreSQL in pg), the throwaway PostgreSQL server (pgserver) and the privacy ledger.

May import: agent, host_tools.ingest.decode (the release and rejection types it
stores), host_tools.hostconfig, host_tools.fasthash. Nothing else of
host_tools: ingest and query build on the store, never the other way round.
"""
