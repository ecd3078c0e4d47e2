"""Count over time: one interval estimate per time bucket, for the fleet or per device.

A *series* answers "how often was X seen, bucket by bucket" for a few
items. Each bucket is a half-open time range ``[t0, t1)`` (by default one
window: the window length of the selected releases) and each point is an
ordinary :func:`pansketch.host_tools.query.core.freq` answer over the releases that lie
inside that range, so it carries the same interval [lo, hi] at the same
confidence, the merged noise and the releases used. A bucket with no
release is a point without an answer (``error`` says why), never a zero.

This is the single place where a series is computed: the web UI
(host_tools/web), the JSON API and ``pansketch query series --plot`` use it.
Each bucket is one range query (pansketch.host_tools.query.core.freq): window/keep
devices' releases inside it are summed, and each tree-mode device
contributes the fewest dyadic nodes covering it (pansketch.host_tools.query.core.cover).
With ``running`` each point also carries the running total from the
first bucket's start to its end: the answer of that range query, computed
as the sum of the buckets' merges so far (``_incremental``) or, with
tree-mode devices, as the range query itself (its noise then grows with
log(length), not with the number of buckets).

    from pansketch.host_tools.query import series
    s = series.series(store, ["apple"], salt=cfg.fleet.salt, per_device=True)
    for line in s.lines:
        for p in line.points:
            print(line.label, p.t0, p.estimate, p.lo, p.hi, p.includes_zero)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union, cast

from pansketch.host_tools.query import core as query
from pansketch.host_tools.query import rollupview
from pansketch.host_tools.query.core import Answer, QueryError, iso
from pansketch.host_tools.query.merge import Merged, NoiseTerm
from pansketch.host_tools.store import exclusions
from pansketch.host_tools.store.sql import SQLStore as Store

MAX_BUCKETS = 2000


@dataclass
class Point:
    """One bucket of one line: an answer, or the reason there is none."""

    t0: int
    t1: int
    answer: Optional[Answer] = None
    error: Optional[str] = None
    # devices that released before and after this bucket but have no release in it: a fleet total
    # without them is lower because data are missing, not because the item was seen less
    missing_devices: list[str] = field(default_factory=list)
    running: Optional[Answer] = None  # the total from the series' start to t1 (series(running=True))

    @property
    def estimate(self) -> Optional[float]:
        return None if self.answer is None else self.answer.estimate

    @property
    def lo(self) -> Optional[float]:
        return None if self.answer is None else self.answer.lo

    @property
    def hi(self) -> Optional[float]:
        return None if self.answer is None else self.answer.hi

    @property
    def includes_zero(self) -> Optional[bool]:
        """True when 0 is inside [lo, hi]: the count is not distinguishable from absent."""
        if self.answer is None:
            return None
        return self.answer.lo <= 0 <= self.answer.hi

    def to_dict(self, devices_offset: int = 0, devices_limit: Optional[int] = query.DEVICES_LIMIT) -> dict[str, Any]:
        """The point's JSON object; its answer's devices as a page (:meth:`Answer.to_dict`)."""
        d: dict[str, Any] = {"t0": self.t0, "t1": self.t1, "since": iso(self.t0), "until": iso(self.t1),
                             "missing_devices": self.missing_devices}
        if self.answer is None:
            d.update({"estimate": None, "lo": None, "hi": None, "includes_zero": None, "error": self.error})
            return d
        a = self.answer.to_dict(devices_offset, devices_limit)
        for k in ("estimate", "lo", "hi", "confidence", "window", "devices", "devices_page", "releases",
                  "noise_draws", "noise_sd",
                  "method", "offset", "partial_excluded", "tree_nodes", "tree_missing_epochs"):
            if k in a:
                d[k] = a[k]
        d["includes_zero"] = self.includes_zero
        if self.running is not None:
            r = self.running.to_dict()
            d["running"] = {k: r[k] for k in ("estimate", "lo", "hi", "releases", "noise_draws", "noise_sd",
                                              "range", "tree_nodes") if k in r}
        return d


@dataclass
class Line:
    """The points of one item, for the fleet (``device`` None) or one device."""

    item: Any
    device: Optional[str]
    points: list[Point] = field(default_factory=list)

    @property
    def label(self) -> str:
        return str(self.item) if self.device is None else "%s @ %s" % (self.item, self.device)

    def to_dict(self, devices_offset: int = 0, devices_limit: Optional[int] = query.DEVICES_LIMIT) -> dict[str, Any]:
        return {"label": self.label, "item": self.item, "device": self.device,
                "points": [p.to_dict(devices_offset, devices_limit) for p in self.points]}


@dataclass
class Series:
    items: list[Any]
    step: int
    confidence: float
    devices: Optional[list[str]]
    per_device: bool
    lines: list[Line]
    truncated: int = 0  # buckets left out (older than the last MAX_BUCKETS)

    def to_dict(self, devices_offset: int = 0, devices_limit: Optional[int] = query.DEVICES_LIMIT) -> dict[str, Any]:
        return {"items": self.items, "step": self.step, "confidence": self.confidence, "devices": self.devices,
                "per_device": self.per_device, "truncated_buckets": self.truncated,
                "lines": [ln.to_dict(devices_offset, devices_limit) for ln in self.lines]}


def default_step(store: Store, devices: Optional[list[str]] = None) -> int:
    """The bucket length: the least common multiple of the selected releases' window lengths
    (for tree-mode releases their epoch length: a tree's "window" is its whole horizon)."""
    lens = store.rollup_lengths() if _all_rolled(store, devices) else store.release_lengths(devices)
    if not lens:
        raise QueryError("no releases%s" % (" for device %s" % ",".join(devices) if devices else ""))
    step = 1
    for x in lens:
        step = step * x // math.gcd(step, x)
    return step


def _all_rolled(store: Store, devices: Optional[list[str]]) -> bool:
    """Whether a fleet-wide series can read the roll-ups' window lengths and time extent (one row per
    window) instead of aggregating every release row: every stored release is in a roll-up (no tree
    nodes, no kinds that are not summed), so both give the same lengths and the same first t0 and last t1."""
    return devices is None and store.has_rollups and not store.has_unrolled() and not store.has_tree()


def _point_devices(store: Store, devs: Sequence[str]) -> None:
    """QueryError when a named device is of a kind that freq cannot answer (dcs, dbits)."""
    other = sorted("%s (%s)" % (r[0], r[3]) for r in store.devices()
                   if r[0] in devs and r[3] not in query.POINT_KINDS)
    if other:
        raise QueryError("%s: not a kind with item counts over time (cs, cms); %s" % (
            ", ".join(other), "; ".join("%s answers %s" % (k, q) for k, q in sorted(query.KIND_QUERIES.items())
                                        if k not in query.POINT_KINDS)))


def buckets(store: Store, step: int, since: Optional[float] = None, until: Optional[float] = None,
            devices: Optional[list[str]] = None, limit: int = MAX_BUCKETS) -> tuple[list[tuple[int, int]], int]:
    """Consecutive ``[t0, t1)`` of length ``step`` from the first to the last selected release.

    Aligned to multiples of ``step`` (so windows are buckets). Returns the
    last ``limit`` buckets and how many earlier ones were left out.
    """
    bks, cut, _ext = _buckets(store, step, since, until, devices, limit)
    return bks, cut


def _buckets(store: Store, step: int, since: Optional[float], until: Optional[float], devices: Optional[list[str]],
             limit: int) -> tuple[list[tuple[int, int]], int, Optional[dict[str, tuple[int, int]]]]:
    """:func:`buckets`, and the devices' extents it read (:meth:`release_extents` of the selection; None
    when the roll-ups gave the time extent of a fleet-wide series without a range: :func:`_all_rolled`)."""
    if step <= 0:
        raise QueryError("step must be positive")
    ext: Optional[dict[str, tuple[int, int]]] = None
    if since is None and until is None and _all_rolled(store, devices):
        whole = store.rollup_extent()
        if whole is None:
            return [], 0, {}
        lo, hi = whole
    else:
        ext = store.release_extents(devices, since, until)
        if not ext:
            return [], 0, ext
        lo, hi = min(a for a, _b in ext.values()), max(b for _a, b in ext.values())
    k0 = lo // step
    k1 = (hi + step - 1) // step
    if since is not None:
        k0 = max(k0, int(math.ceil(since / step)))
    if until is not None:
        k1 = min(k1, int(until // step))
    n = max(0, k1 - k0)
    cut = max(0, n - limit)
    return [(k * step, (k + 1) * step) for k in range(k0 + cut, k1)], cut, ext


def bucket_answers(store: Store, items: Sequence[Any], salt: str, t0: int, t1: int,
                   devices: Optional[list[str]], confidence: float) -> list[Point]:
    """One point per item for the releases inside [t0, t1) (the range-query seam)."""
    try:
        answers = query.freq(store, items, salt=salt, since=t0, until=t1, device=devices, confidence=confidence,
                             pick=False)  # series() picked the devices once
    except QueryError as exc:
        return [Point(t0, t1, None, str(exc)) for _ in items]
    return [Point(t0, t1, a) for a in answers]


def series(store: Store, items: Sequence[Any], *, salt: str, since: Optional[float] = None,
           until: Optional[float] = None, device: Union[None, str, Sequence[str]] = None,
           per_device: bool = False, step: Optional[int] = None, confidence: float = 0.95,
           limit: int = MAX_BUCKETS, running: bool = False) -> Series:
    """Per-bucket estimates with intervals of ``items``.

    ``device``: restrict to these devices (merged, unless ``per_device``);
    ``per_device``: one line per item and device instead of fleet lines.
    """
    items = list(dict.fromkeys(items))
    if not items:
        raise QueryError("no items")
    if since is not None and until is not None and until <= since:
        raise QueryError("empty time range: until must be after since")
    devs = [device] if isinstance(device, str) else (list(device) if device else None)
    if devs is None:  # a store mixing kinds: the devices that answer freq
        devs = query.pick_devices(store, query.POINT_KINDS)
    else:
        _point_devices(store, devs)
    natural = default_step(store, devs)
    if step is None:
        step = natural
    elif step <= 0:
        raise QueryError("step must be positive")
    elif step % natural:
        # a release cannot be split: shorter or unaligned buckets would each hold no whole release
        raise QueryError("a step of %d s does not hold whole releases: the selected releases are %d s long "
                         "(for tree-mode devices: their epoch); use a multiple of %d s" % (step, natural, natural))
    bks, cut, ext = _buckets(store, step, since, until, devs, limit)
    if not bks:
        raise QueryError("no releases in the selection")
    # device -> (first t0, last t1) inside the buckets, read when first needed: a fleet-wide bucket that
    # holds every device (the store's device list itself, pansketch.host_tools.query.core._rollup_devices)
    # misses none, and the read is a scan of every release row
    known: dict[str, Any] = {}

    def spans() -> tuple[dict[str, tuple[int, int]], list[str]]:
        if "span" not in known:
            if since is None and until is None and not cut and ext is not None:
                # the buckets run from below the first t0 to above the last t1: every release lies inside
                # them, so the extents inside the buckets are those just read
                known["span"] = ext
            else:
                known["span"] = store.release_extents(devs, bks[0][0], bks[-1][1])
            known["every"] = sorted(known["span"])  # once, not per bucket
        return known["span"], known["every"]

    if per_device:
        groups: list[Optional[list[str]]] = [[d] for d in spans()[1]]
    else:
        groups = [devs]
    lines: list[Line] = []
    for g in groups:
        mine = [Line(x, g[0] if per_device and g else None) for x in items]
        pts = _incremental(store, items, salt, bks, g, confidence, running)
        if pts is None:  # running totals that are not sums of the buckets: one range query each
            pts = [(bucket_answers(store, items, salt, t0, t1, g, confidence),
                    bucket_answers(store, items, salt, bks[0][0], t1, g, confidence) if running else None)
                   for t0, t1 in bks]
        whole = store.all_devices() if g is None else None
        for (t0, t1), (here, run) in zip(bks, pts):
            expected: Optional[list[str]] = None
            for i, (ln, p) in enumerate(zip(mine, here)):
                if p.answer is not None and p.answer.devices is whole:
                    p.missing_devices = []  # every device with a release: the expected ones among them
                else:
                    if expected is None:
                        span, every = spans()
                        expected = [d for d in (g if g else every)
                                    if d in span and span[d][0] <= t0 and span[d][1] >= t1]
                    got = set(p.answer.devices) if p.answer is not None else set()
                    p.missing_devices = [d for d in expected if d not in got]
                if run is not None:
                    p.running = run[i].answer
                ln.points.append(p)
        lines.extend(mine)
    return Series(items, step, confidence, devs, per_device, lines, cut)


_Pts = list[tuple[list[Point], Optional[list[Point]]]]


def _incremental(store: Store, items: Sequence[Any], salt: str, bks: list[tuple[int, int]],
                 devices: Optional[list[str]], confidence: float, running: bool) -> Optional[_Pts]:
    """Each bucket's points and running totals, the running merge kept as a prefix sum of the buckets'.

    A running range [first t0, t1) selects exactly the releases of its buckets when no release inside
    it crosses a bucket boundary; then its merge is the buckets' merges added up: counters and noise
    draws per term add, release counts add, devices and windows unite, the time extent is the outer
    one (pansketch.host_tools.query.merge). So each running total costs one (d, w) addition and one
    interval instead of a merge of everything since the first bucket (which made a series quadratic
    in its buckets). Epoch and bucket boundaries are multiples of the epoch length, so only releases
    longer than one epoch can cross one (:meth:`long_releases`, an index read). None, for the caller's
    range query per running total, when that shortcut would not give the same answer: tree-mode nodes
    (each range takes its own fewest covering nodes), a release crossing a bucket boundary inside the
    series, a bucket that cannot be merged for another reason than holding no release.
    """
    a, b, step = bks[0][0], bks[-1][1], bks[0][1] - bks[0][0]
    if running and store.has_tree():
        return None
    longs: list[tuple[str, int, int]] = []
    if running:
        longs = store.long_releases(a, b, devices)
        if any(a <= r0 and r1 <= b and r0 // step != (r1 - 1) // step for _d, r0, r1 in longs):
            return None  # bucket boundaries are multiples of step
        excl = set(exclusions.excluded(store)) | set(getattr(store, "query_exclude", ()) or ())
        longs = [x for x in longs if x[0] not in excl]
    if devices is not None or not store.has_rollups:
        return _buckets_merged(store, items, salt, bks, devices, confidence, running, longs)
    with store.read_tx():  # one snapshot: the roll-ups read once and what each bucket reads besides
        view = cast(Store, rollupview.RollupView(store, a, b))
        return _buckets_merged(view, items, salt, bks, devices, confidence, running, longs)


def _buckets_merged(store: Store, items: Sequence[Any], salt: str, bks: list[tuple[int, int]],
                    devices: Optional[list[str]], confidence: float, running: bool,
                    longs: list[tuple[str, int, int]]) -> Optional[_Pts]:
    """:func:`_incremental`'s loop over the buckets (``store``: a
    :class:`pansketch.host_tools.query.rollupview.RollupView` for a fleet-wide series)."""
    a = bks[0][0]
    out: _Pts = []
    acc: Optional[Merged] = None
    for t0, t1 in bks:
        try:
            m, sel = query.select_merged(store, None, t0, t1, devices, salt)  # series() picked the devices
            here = [Point(t0, t1, x) for x in query.merged_answers(m, sel, items, salt, confidence)]
        except QueryError as exc:
            if running and not str(exc).startswith("no releases"):
                return None  # e.g. sketches that do not merge: the running range query says so
            m, here = None, [Point(t0, t1, None, str(exc)) for _ in items]
        if not running:
            out.append((here, None))
            continue
        if m is not None:
            if acc is not None and (acc.kind, acc.d, acc.w, acc.hv, acc.salt) != (m.kind, m.d, m.w, m.hv, m.salt):
                return None  # the running range query refuses to merge them, naming both
            acc = m if acc is None else _add(acc, m)
        if acc is None:
            out.append((here, [Point(a, t1, None, "no releases") for _ in items]))
            continue
        # releases of the running range's devices that overlap it without lying inside: as count_partial
        rsel = query.Selection(since=a, until=t1, devices=devices,
                               partial=sum(1 for _d, r0, r1 in longs if r0 < t1 and r1 > a and not (r0 >= a and r1 <= t1)))
        out.append((here, [Point(a, t1, x) for x in query.merged_answers(acc, rsel, items, salt, confidence)]))
    return out


def _add(x: Merged, y: Merged) -> Merged:
    """The merge of the releases of ``x`` and ``y`` (disjoint sets, one merge group), as merge() sums them."""
    terms: dict[tuple[str, int, int], int] = {}
    for t in x.noise + y.noise:
        terms[(t.mech, t.num, t.den)] = terms.get((t.mech, t.num, t.den), 0) + t.count
    # both sorted: the same devices (a fleet that released in every bucket) need no set union
    # (the store's device list itself when each bucket has every device: kept as that object, no copy)
    devices = (x.devices if x.devices is y.devices else list(x.devices) if x.devices == y.devices
               else sorted(set(x.devices) | set(y.devices)))
    return Merged(kind=x.kind, d=x.d, w=x.w, hv=x.hv, salt=x.salt, counters=x.counters + y.counters,
                  releases=x.releases + y.releases, devices=devices,
                  noise=[NoiseTerm(m, n, d, c) for (m, n, d), c in sorted(terms.items())],
                  t0=min(x.t0, y.t0), t1=max(x.t1, y.t1), windows=_union(x.windows, y.windows),
                  b=x.b, map=x.map)


def _union(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sorted union of two sorted lists of windows: a concatenation when ``y`` follows ``x`` (the next
    bucket of a running total: no set of every window so far per bucket)."""
    if not x or not y or x[-1] < y[0]:
        return x + y
    return sorted(set(x) | set(y))
