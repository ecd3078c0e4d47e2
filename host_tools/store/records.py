"""What the store keeps and the ingest path hands it: the validated release, its shape, the refusal.

:class:`Release` is a release message that passed ``pansketch.host_tools.ingest.decode``
(docs/FORMAT.md); :class:`SketchShape` its shape and merge group, shared with
the stored row (:class:`pansketch.host_tools.store.rows.StoredRelease`); :class:`Rejected`
the refusal (a short code and a message) that decode and the store raise.
Here, below both, so that the store does not import the ingest path.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from pansketch.agent.release import FORMAT_VERSION


class Rejected(Exception):
    """A release that is refused; ``code`` is a short class, ``reason`` the message."""

    def __init__(self, code: str, reason: str) -> None:
        Exception.__init__(self, "%s: %s" % (code, reason))
        self.code = code
        self.reason = reason


class SketchShape:
    """Shape and merge group of a release: shared by the validated message
    (:class:`Release`) and the stored row (pansketch.host_tools.store.rows.StoredRelease)."""

    kind: str
    d: int
    w: int
    hv: int
    salt: str
    b: int
    map: Optional[tuple[int, int, int]]
    payload: Optional[bytes]
    ctr_off: int  # offset of the counter bytes in payload

    @property
    def levels(self) -> int:
        if self.kind == "dcs":
            return self.b + 1
        return self.b if self.kind == "strhh" else 1  # strhh: b = item bytes = prefix levels

    @property
    def rows(self) -> int:
        """Counter rows of w cells: levels * d."""
        return self.levels * self.d

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of ``counters()``: (levels * d, w); (1, d) for kind dbits (d per-level counts)."""
        return (1, self.d) if self.kind == "dbits" else (self.rows, self.w)

    @property
    def group(self) -> tuple[Any, ...]:
        """What must be identical for releases to merge: (kind, d, w, hv, salt id[, b, map])."""
        if self.kind in ("dcs", "strhh"):
            return (self.kind, self.d, self.w, self.hv, self.salt, self.b, self.map)
        return (self.kind, self.d, self.w, self.hv, self.salt)

    def counters(self) -> np.ndarray:
        """The noisy int32 counters, shape :attr:`shape` (read from the payload without copying)."""
        if self.payload is None:
            raise ValueError("release loaded without its payload")
        r, c = self.shape
        return np.frombuffer(self.payload, dtype="<i4", count=r * c, offset=self.ctr_off).reshape(r, c)


@dataclass(frozen=True)
class ReleaseParams(SketchShape):
    """The sketch and noise parameters a release carries, shared by the validated
    message (:class:`Release`) and the stored row (pansketch.host_tools.store.rows.StoredRelease)."""

    mode: str
    kind: str
    d: int
    w: int
    hv: int
    salt: str
    clip: int
    mech: str
    budget: tuple[int, int]
    nint: tuple[int, int]
    nout: tuple[int, int]
    nz: int  # noise draws per cell: (nz - 1) x nint + 1 x nout
    L: int


@dataclass(frozen=True)
class Release(ReleaseParams):
    """A validated release (all fields of the map, plus the raw bytes)."""

    dev: str
    seq: int
    win_s: int
    ep_s: int
    win: int
    elo: int
    ehi: int
    part: int
    payload: bytes
    ctr_off: int  # offset of the counter bytes in payload
    sha256: str
    v: int = FORMAT_VERSION
    lvl: int = 0  # v2: tree level of the node [elo, ehi) (0 in window/keep mode)
    b: int = 0  # dcs: domain bits (levels = b + 1)
    map: Optional[tuple[int, int, int]] = None  # dcs: (scale_num, scale_den, offset)

    @property
    def key(self) -> tuple[str, int, int, int]:
        """The idempotency key (device, elo, ehi, part)."""
        return (self.dev, self.elo, self.ehi, self.part)

    @property
    def t0(self) -> int:
        return self.elo * self.ep_s

    @property
    def t1(self) -> int:
        return self.ehi * self.ep_s

    @property
    def ctr(self) -> bytes:
        r, c = self.shape
        return self.payload[self.ctr_off:self.ctr_off + 4 * r * c]

    def state(self) -> tuple[Any, ...]:
        """Every field but ``payload``, in :data:`STATE_FIELDS` order (small: sent between processes)."""
        return tuple(getattr(self, n) for n in STATE_FIELDS)

    @classmethod
    def from_state(cls, state: tuple[Any, ...], payload: bytes) -> "Release":
        """The release :meth:`state` was taken from, given its payload (no validation: it was validated)."""
        if len(state) != len(STATE_FIELDS):
            raise ValueError("release state of %d fields, expected %d" % (len(state), len(STATE_FIELDS)))
        # the frozen dataclass's __init__ sets each of the 28 fields through object.__setattr__; filling
        # the instance dict at once gives the same object for a fraction of the cost (once per message)
        rel = cls.__new__(cls)
        d = rel.__dict__
        d.update(zip(STATE_FIELDS, state))
        d["payload"] = payload
        return rel


STATE_FIELDS = tuple(f.name for f in fields(Release) if f.name != "payload")
