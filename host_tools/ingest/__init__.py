"""Ingest: the aggregator service (``pansketch aggregate``) and its helper processes.

The service (service: ``run`` and the CLI), the transport-free core
(aggregator: validate, store, say what happened), the validate -> store ->
acknowledge threads (pipeline), the host's acknowledgements to devices (acks)
and the log lines (loglines). MQTT transport (the process: mqttproc; the
aggregator's handle on it: mqttparent; what both share: mqttshared), validation
(validproc, decode), the child-process plumbing (child) and device status
messages (devstatus). Releases go to the
store. May import: agent, pansketch.host_tools.store, pansketch.host_tools.hostconfig,
pansketch.host_tools.fasthash, pansketch.host_tools.cborscan (the bounded reader of release
bytes), pansketch.host_tools.logsetup and pansketch.host_tools.metrics (the
exporter of ``aggregate --metrics-port``); never web, query, bench or lab.
"""
