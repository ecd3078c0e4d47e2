"""pahofast's behaviour check: the installed paho passes it; a paho whose internals changed meaning
(names still there) fails it, and the MQTT process then builds paho's plain client and says why.

No broker: the check runs on a socket pair, and the client is built, not connected.
"""

from __future__ import annotations

import logging
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from pansketch.host_tools import hostconfig
from pansketch.host_tools.ingest import pahofast
from pansketch.host_tools.ingest.mqttproc import _client
from pansketch.host_tools.ingest.mqttshared import Settings


@pytest.fixture(autouse=True)
def fresh_check() -> Any:
    """check() is cached per process: each test sees the paho it set up."""
    pahofast.check.cache_clear()
    yield
    pahofast.check.cache_clear()


def _settings() -> Settings:
    return Settings(hostconfig.BrokerConfig(host="127.0.0.1", port=1883), "check-agg", (), False, 0, 16)


def test_the_installed_paho_passes_and_the_mqtt_process_uses_the_buffered_client(caplog):
    assert pahofast.check() is None
    assert pahofast.supported()
    with caplog.at_level(logging.WARNING, logger="pansketch.aggregator"):
        c = _client(_settings())
    assert type(c) is pahofast.BufferedClient
    assert not [r for r in caplog.records if "pahofast" in r.getMessage()]


def test_a_paho_whose_write_queue_changed_meaning_falls_back_to_the_plain_client_loudly(monkeypatch, caplog):
    """Every name pahofast uses is still there, but ``_packet_queue`` now keeps a packet as a list of
    buffers and leaves the write to the network loop (as a writev-style paho might): pahofast's
    one-write batches would not go out as it assumes. The check sees the bytes that did not go out, and
    the MQTT process's client is paho's own, with a warning that names the paho version and the reason."""

    def queued_as_parts(self: Any, command: int, packet: Any, mid: int, qos: int, info: Any = None) -> Any:
        self._out_packet.append({"command": command, "mid": mid, "qos": qos, "pos": 0, "to_process": len(packet),
                                 "packet": [bytes(packet)], "info": info})
        return mqtt.MQTT_ERR_SUCCESS

    monkeypatch.setattr(mqtt.Client, "_packet_queue", queued_as_parts)
    assert all(hasattr(mqtt.Client, n) for n in pahofast.CLIENT_NAMES)  # the old presence check would pass
    why = pahofast.check()
    assert why is not None and "went out as" in why, why
    assert not pahofast.supported()
    with caplog.at_level(logging.WARNING, logger="pansketch.aggregator"):
        c = _client(_settings())
    assert type(c) is mqtt.Client
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("does not behave as pansketch.host_tools.ingest.pahofast reads it" in m and why in m
               and "plain client" in m for m in lines), lines


def test_a_paho_that_reads_incoming_packets_differently_fails_the_check(monkeypatch):
    """A paho whose packet handler reads the packet's bytes from another field of ``_in_packet`` (the
    dictionary pahofast fills for paho's handler) would misread every publish with properties: refused."""
    real = mqtt.Client._packet_handle

    def handle(self: Any) -> Any:
        self._in_packet["packet"] = bytearray(b"\0" * len(self._in_packet["packet"]))  # not where it reads
        return real(self)

    monkeypatch.setattr(mqtt.Client, "_packet_handle", handle)
    why = pahofast.check()
    assert why is not None, "a changed reader passed the check"


def test_a_paho_without_one_of_the_names_fails_the_check(monkeypatch):
    monkeypatch.delattr(mqtt.Client, "_mid_generate")
    assert pahofast.check() == "paho has no _mid_generate"
