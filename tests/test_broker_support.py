"""The test broker helper itself: a real mosquitto that starts, restarts on its port, and
keeps its subscribers' reconnects working (tests/support/broker.py, tests/support/e2e.py)."""

from __future__ import annotations

from tests.support.broker import needs_mosquitto, start_mosquitto
from tests.support.e2e import Capture


@needs_mosquitto
def test_support_broker_starts_and_restarts(tmp_path):
    b = start_mosquitto(tmp_path)
    try:
        cap = Capture(b.port, ["x/#"])
        b.restart()
        assert cap.wait(lambda m: False, timeout=0.1) is False
        cap.close()
    finally:
        b.stop()
