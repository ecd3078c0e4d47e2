"""Host acknowledgements: the one ack path of the Pi agent and the firmware.

docs/FORMAT.md section 7. A broker's PUBACK only means the broker has a
release; MQTT drops a QoS 1 message that no subscription or saved session
is waiting for. So a device deletes a release from its outbox only when the
**host** says it stored it, on ``<prefix>/<device>/ack``::

    {"dev": "<device>", "ok": [seq, ...], "bad": [[seq, "<code>"], ...]}

and re-sends every release that is not acknowledged after ``timeout`` and
on every reconnect. The host stores idempotently and acknowledges a
duplicate again, so a lost acknowledgement costs one re-send.

Device core: MicroPython subset, no allocation that depends on events (the
schedule is keyed by release seq, which follows the clock).
"""

import json


class AckError(ValueError):
    pass


def parse(payload, device):
    """(ok, bad) of an ack message for ``device``: lists of seq and (seq, code).

    Raises AckError for anything malformed or addressed to another device;
    the caller logs it and ignores the message.
    """
    if isinstance(payload, (bytes, bytearray, memoryview)):
        try:
            payload = bytes(payload).decode()
        except Exception:
            raise AckError("ack is not UTF-8")
    try:
        doc = json.loads(payload)
    except Exception:
        raise AckError("ack is not JSON")
    if not isinstance(doc, dict):
        raise AckError("ack is not a JSON object")
    if doc.get("dev") != device:
        raise AckError("ack for device %r, not %r" % (doc.get("dev"), device))
    ok = []
    for s in doc.get("ok") or []:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise AckError("ack 'ok' holds a non-seq %r" % (s,))
        ok.append(s)
    bad = []
    for e in doc.get("bad") or []:
        if not isinstance(e, list) or len(e) != 2 or not isinstance(e[0], int) or isinstance(e[0], bool) \
                or e[0] < 0 or not isinstance(e[1], str):
            raise AckError("ack 'bad' entry %r is not [seq, code]" % (e,))
        bad.append((e[0], e[1][:64]))
    return ok, bad


def apply(outbox, ok, bad, log=None):
    """Delete acknowledged releases, set rejected ones aside.

    Returns the highest seq acknowledged as stored (or None). A seq the
    outbox does not hold (already deleted: a repeated ack) is ignored.
    """
    top = None
    for s in ok:
        if outbox.has(s):
            outbox.ack(s)
        if top is None or s > top:
            top = s
    for s, code in bad:
        if outbox.has(s):
            outbox.reject(s)
            if log is not None:
                log("host rejected release %d (%s); kept in %s/rejected, not re-sent" % (s, code, outbox.dir))
    return top


class Resend:
    """When to (re)send each release: never sent, or unacknowledged for its timeout.

    The first re-send waits ``timeout_ms``, each further one twice as long
    (capped at 64x): a host that is down for hours does not get the whole
    backlog again every minute (each copy waits in its persistent session).
    With ``rand`` (``os.urandom``-like: n -> n random bytes) each wait gets
    a random extra of up to a quarter of itself, drawn at every send and
    independent of the data, so that re-sends do not stay in step with
    other devices' sends (a broker that hands a shared subscription's
    messages to its members in turn would otherwise give the same member
    the same release again and again). ``now`` values are milliseconds
    from one monotonic clock. ``reset()`` (on every reconnect) makes every
    release due again at once.
    """

    MAX_DOUBLINGS = 6
    JITTER_SHIFT = 2  # the extra is below wait >> 2

    def __init__(self, timeout_ms, rand=None):
        self.timeout_ms = timeout_ms
        self.rand = rand
        self.sent = {}  # seq -> [last send time, sends so far, wait until the next send]

    def reset(self):
        self.sent = {}

    def _wait(self, n):
        w = self.timeout_ms << min(n - 1, self.MAX_DOUBLINGS)
        if self.rand is not None:
            b = self.rand(2)
            w += (((b[0] << 8) | b[1]) * (w >> self.JITTER_SHIFT)) >> 16  # uniform in [0, w/4)
        return w

    def due(self, seq, now):
        e = self.sent.get(seq)
        return e is None or now - e[0] >= e[2]

    def mark(self, seq, now):
        e = self.sent.get(seq)
        if e is None:
            self.sent[seq] = [now, 1, self._wait(1)]
        else:
            e[0] = now
            e[1] += 1
            e[2] = self._wait(e[1])

    def forget_except(self, seqs):
        """Drop the times of releases no longer in the outbox (keeps the dict small)."""
        for s in list(self.sent):
            if s not in seqs:
                del self.sent[s]

    def next_due(self, seqs, now):
        """Milliseconds until the next of ``seqs`` is due (0 if one is due now, None if none)."""
        best = None
        for s in seqs:
            e = self.sent.get(s)
            left = 0 if e is None else e[2] - (now - e[0])
            if left < 0:
                left = 0
            if best is None or left < best:
                best = left
        return best


def system_rand():
    """``os.urandom`` for :class:`Resend` jitter, or None where there is none (no jitter then)."""
    try:
        import os

        os.urandom(2)
        return os.urandom
    except (ImportError, AttributeError, OSError, NotImplementedError):
        return None
