"""Ingest: the aggregator service (``pansketch aggregate``) and its helper processes.

The service (service: ``run`` and the CLI), the transport-free core
(aggregator: validate, store, say what happened), the validate -> store ->
acknowledge threads (pipeline), the host's acknowledgements to devices (acks)
and the log lines (loglines). MQTT transport (the process: mqttproc; the
aggregator's handle on it: mqttparent; what both share: mqttshared), validation
(validproc, decode), the child-process plumbing (child) and device status
messages (devstatus). Releases go to the
store. May import: agent, host_tools.store, host_tools.hostconfig,
host_tools.fasthash, host_tools.cborscan (the bounded reader of release
bytes), host_tools.logsetup and host_tools.metrics (the
exporter of ``aggregate --metrics-port``); never web, query, bench or lab.
"""
