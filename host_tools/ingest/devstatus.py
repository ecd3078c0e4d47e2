"""Device status messages -> the store, for gap detection (docs/FORMAT.md section 3).

A device publishes a retained JSON status on ``<prefix>/<device>/status``:
its ``next_seq`` (every seq below it was released), ``oldest_pending``
(the lowest seq still in its outbox, null when empty), ``pending`` (its
backlog), ``acked_seq``, ``rejected`` and ``ts``; its last will is
``{"state": "offline"}``. ``pansketch status`` compares these numbers with
the store to tell *lost* releases (the device no longer holds them and the
host never stored them) from *pending* ones (still on the device).

For the aggregator (host_tools/ingest/pipeline.py): the MQTT process
subscribes :func:`status_filter` next to the releases (not shared: retained
messages are not sent to shared subscriptions, and every aggregator keeps
its own copy of each device's latest status); the validator thread passes
every received message to :func:`handle_message` first, which records and
acknowledges a status and leaves anything else to validation.

Everything here is best effort: a malformed status is logged and
acknowledged (the broker must not redeliver it forever), never stored,
and never affects releases.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, Optional

from pansketch.host_tools.output import textsafe
from pansketch.host_tools.ingest.decode import SUPPORTED_MODES, V2_KINDS
from pansketch.host_tools.store.schema import STATUS_INTS
from pansketch.host_tools.store.sql import SQLStore

log = logging.getLogger("pansketch.aggregator")

MAX_STATUS_BYTES = 4096
_DEVICE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_MAX_INT = 1 << 53  # JSON integers everyone reads exactly
# the words of a status (docs/FORMAT.md section 3): state as the Pi agent and the firmware send it,
# kind and mode as a release may have them (host_tools/ingest/decode.py), clock as the firmware sends it
STATUS_WORDS: dict[str, tuple[str, ...]] = {
    "state": ("online", "offline"), "kind": V2_KINDS, "mode": SUPPORTED_MODES, "clock": ("synced", "unsynced"),
}


def status_filter(cfg: Any) -> str:
    """The status topic filter matching the configured release filter: ``pansketch/+/status``."""
    return cfg.aggregator.topic.rsplit("/", 1)[0] + "/status"


def status_device(topic: str) -> Optional[str]:
    """The device level of ``<prefix>/<device>/status`` (None for any other topic)."""
    if not topic.endswith("/status"):  # a release topic: asked of every message, answered without a split
        return None
    levels = topic.split("/")  # at least two, the last "status"
    if not _DEVICE.fullmatch(levels[-2]):
        return None
    return levels[-2]


def parse(topic: str, payload: bytes) -> tuple[str, dict[str, Any]]:
    """(device, status object) of one status message; ValueError says what is wrong with it."""
    dev = status_device(topic)
    if dev is None:
        raise ValueError("not a device status topic")
    if len(payload) > MAX_STATUS_BYTES:
        raise ValueError("%d bytes (at most %d)" % (len(payload), MAX_STATUS_BYTES))
    try:
        doc = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError("not UTF-8 JSON: %s" % exc)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("dev", dev) != dev:
        raise ValueError("dev %s differs from the topic's device %r" % (textsafe.term(repr(doc.get("dev"))[:80]), dev))
    # the strings a status carries are shown by ``status`` and the dashboard: each from the fixed set
    # the device code sends (a device is untrusted even when authenticated)
    for k, allowed in STATUS_WORDS.items():
        v = doc.get(k, allowed[0] if k == "state" else None)
        if v is not None and v not in allowed:
            raise ValueError("%s must be one of %s, got %s" % (k, ", ".join(allowed), textsafe.term(repr(v)[:80])))
    for k in STATUS_INTS:
        v = doc.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _MAX_INT):
            raise ValueError("%s must be a non-negative integer or null, got %s" % (k, textsafe.term(repr(v)[:80])))
    nxt, old = doc.get("next_seq"), doc.get("oldest_pending")
    if nxt is not None and old is not None and old >= nxt:
        raise ValueError("oldest_pending %d is not below next_seq %d" % (old, nxt))
    return dev, doc


def record(store: SQLStore, topic: str, payload: bytes, received: Optional[float] = None) -> bool:
    """Validate one status message and keep it as the device's latest; False if it was refused or unchanged."""
    try:
        dev, doc = parse(topic, payload)
    except ValueError as exc:
        log.warning("ignored status message on %s (%d bytes): %s", topic, len(payload), exc)
        return False
    return store.put_status(dev, doc, time.time() if received is None else received)


def handle_message(store: SQLStore, client: Any, msg: Any, received: Optional[float] = None) -> bool:
    """For ``on_message``: a status message is recorded and acknowledged (True); anything else is left (False).

    A storage error is logged and the message still acknowledged: a status is replaced by the
    device's next one, and a lost status never loses a release.
    """
    if status_device(msg.topic) is None:
        return False
    try:
        record(store, msg.topic, msg.payload, received)
    except Exception as exc:  # the store is busy or broken: the release path reports that
        log.warning("could not record status on %s: %s", msg.topic, exc)
    try:
        client.ack(msg.mid, msg.qos)
    except Exception:  # pragma: no cover (client without manual acks)
        pass
    return True
