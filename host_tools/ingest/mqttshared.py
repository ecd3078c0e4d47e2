"""What the MQTT process and the aggregator's handle on it share: the message and settings types, the
layout of ``Msg.mid`` and of the watch file, the poison rule (pansketch.host_tools.ingest.mqttproc is the child,
pansketch.host_tools.ingest.mqttparent the parent)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional


class Msg(NamedTuple):
    """One received message, as the aggregator needs it (paho's MQTTMessage does not cross processes).

    ``verdict``: the validation verdict (pansketch.host_tools.ingest.validproc.verdict) when the transport
    validated the message already (the MQTT process does, for releases); None otherwise."""

    topic: str
    payload: bytes
    mid: int
    qos: int
    verdict: Any = None


@dataclass(frozen=True)
class Settings:
    """What the child needs to connect: broker ([broker] of host.toml) and session; and how to validate."""

    broker: Any  # hostconfig.BrokerConfig
    client_id: str
    subscriptions: tuple[tuple[str, int], ...]  # (topic filter, QoS)
    persistent: bool  # clean_start off, session expiry below
    session_expiry_s: int
    receive_maximum: int  # unacknowledged QoS 1 messages the broker may send us (MQTT v5 Receive Maximum)
    verbose: bool = False  # -v: paho's packet log on stderr
    validation: Any = None  # validproc.Settings: validate releases here (None: forward them unvalidated)
    watch: Optional[str] = None  # the file where the child records the message it is validating (set by MQTTProcess)
    poison: tuple[tuple[bytes, int, str], ...] = ()  # (message key, deaths, code) of messages that killed a child


GEN_SHIFT = 32  # Msg.mid = child generation << GEN_SHIFT | connection << EPOCH_SHIFT | MQTT packet id (acks of a dead child's messages, or from before a reconnect, are dropped)
EPOCH_SHIFT = 16  # below GEN_SHIFT: Msg.mid's bits 16..31 are the child's connection (MQTT packet ids are 16 bits)
EPOCH_MASK = (1 << (GEN_SHIFT - EPOCH_SHIFT)) - 1
PID_MASK = (1 << EPOCH_SHIFT) - 1
POISON_DEATHS = 2  # a message that killed the child this many times is refused without validating it again
POISON_MAX = 1024  # messages remembered as poison (each cost a CPU budget and a restart; bounded anyway)
_WATCH = struct.Struct("=QB32sHI")  # counter, validating (0/1), message key, topic length, payload size
_WATCH_TOPIC = 64  # the topic's bytes (at most 1024) from this offset
WATCH_SIZE = _WATCH_TOPIC + 1024


def message_key(topic: str, digest: bytes) -> bytes:
    """What identifies a message again when it is redelivered or re-sent: SHA-256 of the topic and of
    the payload's SHA-256 (which the release needs anyway)."""
    return hashlib.sha256(topic.encode("utf-8", "replace") + b"\0" + digest).digest()


class Watched(NamedTuple):
    """What the watch file says: the message the child was validating (``validating``) or last validated."""

    counter: int
    validating: bool
    key: bytes
    topic: str
    size: int


def read_watch(mm: Any) -> Watched:
    counter, st, key, tl, size = _WATCH.unpack_from(mm, 0)
    topic = bytes(mm[_WATCH_TOPIC:_WATCH_TOPIC + min(tl, 1024)]).decode("utf-8", "replace")
    return Watched(counter, st == 1, key, topic, size)
