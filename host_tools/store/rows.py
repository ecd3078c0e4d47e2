"""What the store takes and hands back: a message to store (:class:`Pending`), the bounds on what
refusals may occupy (:class:`Limits`), and the rows read back (:class:`StoredRelease`,
:class:`RollupInfo`, :class:`DeviceStatus`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from pansketch.host_tools.store import payloadcodec
from pansketch.host_tools.store.errors import PrunedError
from pansketch.host_tools.store.records import Rejected, Release, ReleaseParams, SketchShape


@dataclass(frozen=True)
class DeviceStatus:
    """The latest status a device published (docs/FORMAT.md section 3), as kept by the store."""

    device: str
    received: float  # when the host received the status these numbers come from
    ts: Optional[int]  # the device's own time stamp of it
    next_seq: Optional[int]
    oldest_pending: Optional[int]
    pending: Optional[int]
    acked_seq: Optional[int]
    rejected: Optional[int]
    doc: dict[str, Any]
    state: str  # 'online' | 'offline' (last will) | whatever the device said
    state_received: float


@dataclass(frozen=True)
class Limits:
    """Bounds on what refused and quarantined messages may occupy ([aggregator] of host.toml, docs/HOST.md).

    A rejection row holds at most ``keep_bytes`` of the payload plus
    :data:`REJECTION_ROW_OVERHEAD` bytes (topic, device, reason are cut to
    fixed lengths), so ``max_bytes`` lowers the row cap to
    ``max_bytes // (keep_bytes + overhead)``. When a cap is exceeded the
    oldest rows go, down to 90 % of it (pruning is amortised over many
    inserts); rows older than ``retention_s`` go at least once a minute.
    Quarantine rows keep the whole (validated) payload and are capped by
    count and by the sum of their sizes.
    """

    keep_bytes: int = 256
    max_rows: int = 10000
    max_bytes: int = 16 << 20
    retention_s: float = 30 * 86400.0
    quarantine_rows: int = 1000
    quarantine_bytes: int = 64 << 20
    max_seq_jump: int = 100000  # a release more than this above the device's highest stored seq is quarantined

    @property
    def rejection_rows(self) -> int:
        return max(1, min(self.max_rows, self.max_bytes // (self.keep_bytes + REJECTION_ROW_OVERHEAD)))


REJECTION_ROW_OVERHEAD = 1024  # topic (cut to 256 bytes), reason (300), device (64), SHA-256, code, numbers
TOPIC_KEEP = 256
REASON_KEEP = 300


@dataclass(frozen=True)
class StoredRelease(ReleaseParams):
    """A release row as read back (counters decoded on demand)."""

    device: str
    elo: int
    ehi: int
    part: int
    seq: int
    win: int
    win_s: int
    ep_s: int
    t0: int
    t1: int
    received: float
    ctr_off: int
    payload: Optional[bytes] = None
    v: int = 1
    lvl: int = 0
    b: int = 0  # dcs: domain bits
    map: Optional[tuple[int, int, int]] = None  # dcs: (scale_num, scale_den, offset)

    def counters(self) -> np.ndarray:
        """As :meth:`SketchShape.counters`; a release whose bytes retention pruned says so."""
        if self.payload is not None and not self.payload:  # SQLStore.prune kept the row without the bytes
            raise PrunedError("release %s seq %d (epochs [%d, %d)) was pruned by retention ([aggregator] "
                              "retain_raw_s): its counters live on only in its window's roll-up; query whole "
                              "windows of the fleet (answered from the roll-ups)"
                              % (self.device, self.seq, self.elo, self.ehi))
        return SketchShape.counters(self)


def _row_to_release(r: Sequence[Any], with_payload: bool) -> StoredRelease:
    (device, elo, ehi, part, seq, win, win_s, ep_s, t0, t1, mode, kind, d, w, hv, salt, clip, mech,
     bn, bd, inn, ind, onn, ond, nz, L, received, ctr_off, v, lvl, b, mn, md, mo) = r[:34]
    return StoredRelease(mode=mode, kind=kind, d=int(d), w=int(w), hv=int(hv), salt=salt, clip=int(clip), mech=mech,
                         budget=(int(bn), int(bd)), nint=(int(inn), int(ind)), nout=(int(onn), int(ond)), nz=int(nz),
                         L=int(L), device=device, elo=int(elo), ehi=int(ehi), part=int(part), seq=int(seq),
                         win=int(win), win_s=int(win_s), ep_s=int(ep_s), t0=int(t0), t1=int(t1),
                         received=float(received), ctr_off=int(ctr_off),
                         payload=payloadcodec.decode(bytes(r[34])) if with_payload else None, v=int(v), lvl=int(lvl), b=int(b),
                         map=(int(mn), int(md), int(mo)) if mn is not None else None)



@dataclass(frozen=True)
class RollupInfo:
    """One roll-up's metadata (sums read separately with :meth:`SQLStore.rollup_sums`)."""

    id: int
    win_s: int
    win: int
    kind: str
    d: int
    w: int
    hv: int
    salt: str
    releases: int
    t0: int  # earliest epoch start of its releases
    t1: int  # latest epoch end of its releases

    @property
    def group(self) -> tuple[str, int, int, int, str]:
        return (self.kind, self.d, self.w, self.hv, self.salt)


@dataclass
class Pending:
    """One message for :meth:`SQLStore.commit_group`: a validated release or a refusal.

    After the call, ``status`` is 'stored', 'duplicate', 'rejected' (``rej``
    says why: validation, or the store's ``device``/``conflict`` checks) or
    'error' (``error``: a database error on this message alone; it was
    rolled back to its savepoint and nothing of it is stored).
    """

    payload: bytes
    topic: Optional[str]
    received: float
    rel: Optional[Release] = None
    rej: Optional[Rejected] = None
    device: Optional[str] = None
    keep_bytes: Optional[int] = None  # prefix of a refused payload to keep (None: the store's Limits.keep_bytes)
    status: str = ""
    error: Optional[BaseException] = None
    seq: Optional[int] = None  # a refused message: the seq its bytes name (pansketch.host_tools.cborscan.peek)
    pdev: Optional[str] = None  # ... and the dev they name
    quarantine: Optional[Rejected] = None  # a valid release held back (code 'future'); status 'quarantined'
