"""Benchmarks that run real services through the test suite's helpers (tests/support): the
firmware on MicroPython's Unix port, a RabbitMQ cluster, the strhh end to end path, the
whole-memory intruder against the Pi daemon. Run as
``python -m benchmarks.NAME`` from the repository root (``make bench`` runs firmware_unix);
the host's own benchmarks are host_tools/bench. May import: agent, host_tools, tests.support."""
