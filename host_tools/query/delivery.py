"""What ``pansketch status`` says of one device's delivery that both of its readers share (the full read
of every release, host_tools/query/status.py, and the kept summaries, statuskept.py): the bound on a
device status's word, the status as JSON, quarantined seqs apart."""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

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


S = TypeVar("S")  # the seqs held (stored or refused): a sorted list (full read) or sorted runs (summaries)


def by_status(head: dict[str, Any], have: S, top: int, st: Any, limit: int, max_jump: Optional[int],
              absent: Callable[[int, int, S, int], tuple[list[int], int]]) -> dict[str, Any]:
    """The rest of one device's classification (status.classify) after its stored and refused seqs:
    lost and pending by the device's status, or unknown without one (or with an implausible one).
    ``have``: every seq stored or refused, ``top`` one past the highest; ``absent(lo, hi, have, limit)``:
    the seqs in [lo, hi) not in ``have`` (first ``limit``) and their count."""
    out = dict(head, status_ignored=implausible(st, top, max_jump))
    if out["status_ignored"] is not None:
        st = None
    if st is not None and st.next_seq is not None:
        end = max(st.next_seq, top)
        # below `cut` the device holds nothing any more; from it on (its oldest pending release,
        # or the first release after the status when its outbox was empty) it may still hold it
        cut = st.next_seq if st.oldest_pending is None else min(st.oldest_pending, st.next_seq)
        lost, n_lost = absent(0, cut, have, limit)
        pend, n_pend = absent(cut, end, have, limit)
        out.update(checked=[0, end], basis="device status", lost_seqs=lost, lost_count=n_lost,
                   pending_seqs=pend, pending_count=n_pend, unknown_seqs=[], unknown_count=0)
    else:
        unk, n_unk = absent(0, top, have, limit)
        # lost and pending cannot be told apart without the device's word: not reported (None)
        out.update(checked=[0, top], basis="no device status yet", lost_seqs=[], lost_count=None,
                   pending_seqs=[], pending_count=None, unknown_seqs=unk, unknown_count=n_unk)
    return out


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
