"""Publisher PUBACK bookkeeping with a stub paho client (no broker needed).

A release given up after ``ack_timeout`` must never be "acknowledged" by a
late PUBACK of its message id, in particular after paho's ids wrap and a
new publish reuses the id (the outbox would then delete a release the
broker never got).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from pansketch.agent.pi.config import BrokerConfig
from pansketch.agent.pi.publisher import Publisher

OK = ReasonCode(PacketTypes.PUBACK, identifier=0)


class Info:
    def __init__(self, mid: int, rc: int) -> None:
        self.mid = mid
        self.rc = rc


class StubClient:
    """Hands out the given mids; ``on_publish(mid)`` runs inside publish() (a fast broker)."""

    def __init__(self, mids: list[int], rc: int = mqtt.MQTT_ERR_SUCCESS,
                 on_publish: Optional[Callable[[int], None]] = None) -> None:
        self.mids = list(mids)
        self.rc = rc
        self.on_publish = on_publish
        self.sent: list[tuple[int, bytes]] = []

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False, properties: Any = None) -> Info:
        mid = self.mids.pop(0)
        self.sent.append((mid, payload))
        if self.on_publish is not None:
            self.on_publish(mid)
        return Info(mid, self.rc)


def publisher(tmp_path: Any, client: StubClient, ack_timeout: float = 0.2) -> Publisher:
    """``ack_timeout`` here is the broker's PUBACK wait (the host-ack re-send timeout stays default)."""
    from pansketch.agent.storage import Outbox

    p = Publisher(BrokerConfig(), "pi-1", Outbox(str(tmp_path)), lambda m: None, puback_timeout=ack_timeout)
    p.client = client  # type: ignore[assignment]
    p._connected = True
    return p


def test_late_puback_of_an_abandoned_mid_does_not_ack_a_reused_mid(tmp_path):
    c = StubClient([7, 7])  # paho's mids wrapped around to 7 again
    p = publisher(tmp_path, c)
    t0 = time.monotonic()
    ok, why = p._send(p.release_topic, b"release-0")
    assert not ok and why.startswith("no PUBACK")
    assert time.monotonic() - t0 < 3  # the 0.2 s PUBACK wait, not forever
    p._on_publish(None, None, 7, OK)  # the PUBACK of release-0 arrives late
    assert 7 not in p._acks and 7 not in p._abandoned
    # release-1 gets mid 7; the broker never acknowledges it
    ok, why = p._send(p.release_topic, b"release-1")
    assert not ok and why.startswith("no PUBACK"), "a stale PUBACK acknowledged a release the broker never got"


def test_ack_recorded_before_a_publish_is_stale_but_a_fast_ack_counts(tmp_path):
    p = publisher(tmp_path, StubClient([9]))
    p._on_publish(None, None, 9, OK)  # an ack nobody waits for (e.g. of an earlier message with id 9)
    assert p._send(p.release_topic, b"r")[0] is False
    # a broker so fast that the PUBACK is handled before publish() returns
    c = StubClient([9, 10])
    p = publisher(tmp_path, c)
    c.on_publish = lambda mid: p._on_publish(None, None, mid, OK)
    assert p._send(p.release_topic, b"r") == (True, "ok")
    assert p._send(p.release_topic, b"s") == (True, "ok")
    assert p._acks == {} and p._abandoned == set()


def test_failed_puback_and_unqueued_publish(tmp_path):
    c = StubClient([3])
    p = publisher(tmp_path, c)
    c.on_publish = lambda mid: p._on_publish(None, None, mid, ReasonCode(PacketTypes.PUBACK, "Not authorized"))
    assert p._send(p.release_topic, b"r") == (False, "Not authorized")
    # paho refuses to queue (e.g. the id is still in its queue): no waiting on a mid it never sent
    p = publisher(tmp_path, StubClient([4], rc=mqtt.MQTT_ERR_QUEUE_SIZE), ack_timeout=30)
    t0 = time.monotonic()
    ok, why = p._send(p.release_topic, b"r")
    assert not ok and "did not queue" in why and time.monotonic() - t0 < 10  # not the 30 s wait


class Msg:
    def __init__(self, topic: str, payload: bytes) -> None:
        self.topic = topic
        self.payload = payload


def test_host_ack_arriving_while_a_status_is_in_flight_keeps_the_status_dirty(tmp_path):
    """The race behind a red CI: the status with acked_seq=1 was in flight when the
    host's ack of seq 2 arrived; clearing the dirty mark after the PUBACK dropped the
    newer fact, so ``feed`` exited with acked_seq=2 never published."""
    import json

    c = StubClient([1, 2])
    p = publisher(tmp_path, c)
    p.last_acked = 1
    ack2 = Msg(p.ack_topic, json.dumps({"dev": "pi-1", "ok": [2]}).encode())

    def broker(mid: int) -> None:
        if mid == 1:  # the host's ack lands between publish and PUBACK of the status
            p._on_message(None, None, ack2)
        p._on_publish(None, None, mid, OK)

    c.on_publish = broker
    assert p._send_status() is True
    assert json.loads(c.sent[0][1])["acked_seq"] == 1
    assert p.last_acked == 2
    assert p._status_dirty, "the newer acked_seq must still be sent"
    assert p._send_status() is True
    assert json.loads(c.sent[1][1])["acked_seq"] == 2 and not p._status_dirty


def test_status_that_the_broker_did_not_take_stays_dirty(tmp_path):
    p = publisher(tmp_path, StubClient([5], rc=mqtt.MQTT_ERR_QUEUE_SIZE))
    assert p._send_status() is False and p._status_dirty
