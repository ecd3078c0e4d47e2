"""The host's acknowledgements to devices (docs/FORMAT.md section 7): what each outcome says, one message
per device per committed group."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from pansketch.host_tools.ingest.aggregator import Outcome


def _ack_entry(out: Outcome) -> Optional[tuple[str, Any]]:
    """What a host acknowledgement says of one outcome: ``("ok", seq)``, ``("bad", [seq, code])`` or None.

    Stored and duplicate releases are acknowledged as stored; a rejected one
    whose seq is known as refused for good, except ``internal`` (a validator
    bug: the device should keep it and send it again after the fix),
    ``timeout`` and ``topic``; a quarantined one is not acknowledged, except one over the fleet's
    contribution limit (code ``bound``: no later delivery makes it acceptable, so the device is told and
    sets it aside instead of re-sending it forever).
    """
    if out.device is None or out.seq is None:
        return None
    if out.status in ("stored", "duplicate"):
        return ("ok", out.seq)
    # not for quarantined releases (the device keeps re-sending: a window from the future is stored once
    # its time has come), nor for refusals that are the host's own limits (internal, timeout)
    if out.status == "quarantined" and out.code == "bound":
        return ("bad", [out.seq, out.code])
    if out.status == "rejected" and out.code is not None and out.code not in ("internal", "topic", "timeout"):
        return ("bad", [out.seq, out.code])
    return None


def ack_topic(release_topic: str) -> str:
    """``<prefix>/<device>/release`` -> ``<prefix>/<device>/ack``."""
    return release_topic.rsplit("/", 1)[0] + "/ack"



def group_acks(done: Sequence[tuple[str, Outcome]]) -> list[tuple[str, bytes]]:
    """One acknowledgement per device for a committed group: (ack topic, payload), in first-seen order.

    docs/FORMAT.md section 7: one message may acknowledge several releases
    of one device (``ok`` and ``bad`` lists); the rules per outcome are
    those of :func:`_ack_entry`.
    """
    docs: dict[str, dict[str, Any]] = {}
    for topic, out in done:
        e = _ack_entry(out)
        if e is None:
            continue
        t = ack_topic(topic)
        doc = docs.get(t)
        if doc is None:
            doc = docs[t] = {"dev": out.device}
        doc.setdefault(e[0], []).append(e[1])
    enc = _ACK_JSON.encode
    return [(t, enc(d).encode()) for t, d in docs.items()]


_ACK_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps with separators builds an encoder per call
