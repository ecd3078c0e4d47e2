"""Shared by tests/test_aggregator_mqtt.py and the tests that build on it: AggThread, REPO, _toml, counts, publish_all, wait_for."""

from __future__ import annotations

import os
import threading
import time
from typing import Any
import paho.mqtt.client as mqtt
from pansketch.host_tools.ingest import service
from pansketch.host_tools.store.sqlite import Store
from tests.support.host import SALT


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def publish_all(port: int, msgs: list[tuple[str, bytes]], client_id: str = "pub", qos: int = 1) -> None:
    """Publish and wait until the broker acknowledged every message."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        infos = [c.publish(t, p, qos=qos) for t, p in msgs]
        for i in infos:
            i.wait_for_publish(10)
            assert i.is_published()
    finally:
        c.disconnect()
        c.loop_stop()


class AggThread:
    """service.run in a thread, stopped on exit."""

    def __init__(self, cfg: Any, until_idle: float | None = None) -> None:
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.rc: list[int] = []
        self.counts: dict[str, int] = {}
        self.t = threading.Thread(target=lambda: self.rc.append(service.run(cfg, until_idle, self.stop, self.ready,
                                                                                self.counts)),
                                  daemon=True)
        self.t.start()
        assert self.ready.wait(15), "aggregator did not subscribe"

    def close(self) -> int:
        self.stop.set()
        self.t.join(20)
        assert not self.t.is_alive()
        return self.rc[0]


def wait_for(pred: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met within %.0f s" % timeout)


def counts(db: str) -> tuple[int, int, int]:
    st = Store(db, readonly=True)
    try:
        return st.release_count(), st.rejection_count(), st.duplicate_count()
    finally:
        st.close()


def _toml(path: Any, port: int, extra: str = "") -> str:
    text = """
[broker]
host = "127.0.0.1"
port = %d

[aggregator]
db = "agg.db"

[fleet]
salt = "%s"
%s
""" % (port, SALT, extra)
    path.write_text(text)
    return str(path)
