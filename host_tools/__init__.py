"""pansketch host tools, one package per role: ingest (the aggregator), store, query, web (dashboard, metrics), audit, bench, lab (algorithms, repro); cli and demo are the entry points."""
