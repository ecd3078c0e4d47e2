"""Both MQTT clients turn Nagle's algorithm off on their broker connection.

MQTT packets are small and each waits for an answer: with Nagle on, a
PUBACK or a status publish sent right after another small packet waited
for the peer's delayed ACK (40 ms on Linux). ``feed`` spent 40-100 ms of
its 0.55 s run in its final status exchange because of it (bench.feed).
"""

from __future__ import annotations

import socket
import time

from pansketch.agent.pi.config import BrokerConfig
from pansketch.agent.pi.publisher import Publisher
from pansketch.agent.storage import Outbox
from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest.mqttproc import _client
from pansketch.host_tools.ingest.mqttshared import Settings
from tests.support.broker import needs_mosquitto, start_mosquitto


def _nodelay(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@needs_mosquitto
def test_agent_and_aggregator_connections_have_tcp_nodelay(tmp_path):
    b = start_mosquitto(tmp_path)
    try:
        pub = Publisher(BrokerConfig(host="127.0.0.1", port=b.port), "nd-dev", Outbox(str(tmp_path / "ob")),
                        lambda m: None)
        pub.start()
        deadline = time.monotonic() + 10
        while not pub.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pub.connected
        assert _nodelay(pub.client.socket()) == 1
        pub.stop()

        c = _client(Settings(hostconfig.BrokerConfig(host="127.0.0.1", port=b.port), "nd-agg", (), False, 0, 16))
        c.connect("127.0.0.1", b.port)
        assert _nodelay(c.socket()) == 1
        c.disconnect()
        # a plain socket has it off: the check above is not vacuous
        with socket.create_connection(("127.0.0.1", b.port)) as s:
            assert _nodelay(s) == 0
    finally:
        b.stop()
