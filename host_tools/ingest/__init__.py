"""Ingest: the aggregator service (``pansketch aggregate``) and its helper processes.

MQTT transport (mqttproc), validation (validproc, decode), the child-process
plumbing (child) and device status messages (devstatus). Releases go to the
store. May import: agent, host_tools.store, host_tools.hostconfig,
host_tools.fasthash; never web, query, bench or lab. (After the move the
aggregator still takes its Prometheus metrics from host_tools.web.metrics;
issue 20 moves that edge.)
"""
