"""pansketch host tools: aggregator, store, estimators, query CLI, reproductions."""
