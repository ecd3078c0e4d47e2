"""Store: the release store and what it keeps.

records (the validated release, its shape, the refusal); the SQL store shared
by both backends, one concern per module: schema (tables, columns, in-place
upgrades), errors, rows (what the store takes and hands back: Pending, Limits,
StoredRelease, ...), base (state, backend hooks, running SQL), write (group
commit, quarantine, refusal logs, roll-ups), prune (retention), read (the
queries), sql (``SQLStore``, the type readers and writers hold); the backends
sqlite (``Store``) and pg (``PgStore``); backend (``open_store``: which backend
serves ``[aggregator] db``), pgserver (a throwaway PostgreSQL server),
ledger (the privacy ledger) and numeric (the golden-section search that the
noise bounds here and in query share). Import each name from the module that
defines it.
May import: agent, pansketch.host_tools.hostconfig, pansketch.host_tools.fasthash, pansketch.host_tools.cborscan. Nothing else of
host_tools: ingest and query build on the store, never the other way round.
"""
