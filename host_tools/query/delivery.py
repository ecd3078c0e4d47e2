"""What ``pansketch status`` says of one device's delivery that both of its readers share (the full read
of every release, host_tools/query/status.py, and the kept summaries, statuskept.py): the bound on a
device status's word, the status as JSON, quarantined seqs apart."""

from __future__ import annotations

from typing import Any, Optional

from pansketch.host_tools.query.core import iso

LIST_LIMIT = 50  # seqs listed per class in --json (counts are always complete)


def implausible(st: Any, top: int, max_jump: Optional[int]) -> Optional[str]:
    """Why the counters of status ``st`` cannot be taken as the device's word (None: they can).

    A status is only the device's claim; the host bounds it by what it has seen, as it bounds
    releases (``max_seq_jump``): a ``next_seq`` more than that above the highest seq stored or
    refused would make up to 2^53 seqs lost or pending, and a backlog larger than the seqs the
    status says the device still holds is no backlog of this device."""
    if st is None or st.next_seq is None:
        return None
    if max_jump is not None and st.next_seq > top + max_jump:
        return "next_seq %d is more than max_seq_jump %d above the highest seq seen (%s)" % (
            st.next_seq, max_jump, top - 1 if top else "none")
    held = st.next_seq - (st.next_seq if st.oldest_pending is None else st.oldest_pending)
    if st.pending is not None and st.pending > held:
        return "pending %d exceeds the %d seq(s) from oldest_pending to next_seq" % (st.pending, held)
    return None


def _status_dict(st: Any, now: float) -> Optional[dict[str, Any]]:
    if st is None:
        return None
    return {"state": st.state, "received": iso(st.received), "received_unix": st.received, "ts": st.ts,
            "next_seq": st.next_seq, "oldest_pending": st.oldest_pending, "pending": st.pending,
            "acked_seq": st.acked_seq, "rejected": st.rejected, "state_received_unix": st.state_received}


def _quarantine(out: dict[str, Any], quarantined: dict[int, str], stored: set[int]) -> None:
    """Quarantined seqs (held back as likely forgeries, pansketch.host_tools.store) are shown apart: not pending, lost or
    unknown. They never widen the checked range (a forged seq 2^32 - 1 would make billions 'pending')."""
    qs = sorted(q for q in quarantined if q not in stored)
    out.update(quarantined_seqs=qs[:LIST_LIMIT], quarantined_count=len(qs),
               quarantined_codes={str(q): quarantined[q] for q in qs[:LIST_LIMIT]})
    lo, hi = out["checked"]
    inside = {q for q in qs if lo <= q < hi}
    for k in ("pending", "unknown", "lost"):
        if out[k + "_count"] and inside:
            drop = [q for q in out[k + "_seqs"] if q in inside]
            out[k + "_seqs"] = [q for q in out[k + "_seqs"] if q not in inside]
            out[k + "_count"] -= len(drop)
