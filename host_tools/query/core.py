"""Frequency and top-k queries with intervals (``pansketch query freq | topk`` prints them: pansketch.host_tools.query.point_cli).

Python API (no CLI needed)::

    from pansketch.host_tools.store.sqlite import Store
    from pansketch.host_tools.query import core as query
    st = Store("pansketch.db", readonly=True)
    for a in query.freq(st, ["apple", "pear"], salt="fleet-salt", window=480000):
        print(a.item, a.estimate, a.lo, a.hi)
    top = query.topk(st, candidates, 10, salt="fleet-salt", since=t0, until=t1)

Selection: all releases (default), one window id (``window``: releases with
that ``win``; they must share one window length), or a time range
(``since``/``until``, unix seconds: releases whose epochs lie inside
[since, until); releases that straddle a bound cannot be split and are left
out, counted in ``Selection.partial``), optionally restricted to devices.
The selection is merged (pansketch.host_tools.query.merge; different sketch parameters are
refused with the reason) and answered by pansketch.host_tools.query.estimators.

Tree-mode devices (format v2, agent/tree.py) release every dyadic node of
epochs, so their releases overlap: level-l nodes hold the events of the
2**l leaves below them. For each such device the selection keeps only the
*fewest* stored nodes that cover its selected epochs (:func:`cover`: from
the left, the largest aligned node that fits, i.e. the canonical dyadic
decomposition, at most 2 per level), adding all parts of a node. Devices
in window/keep mode are summed as before. Every answer reports how many
releases and noise draws per cell it combined; the intervals come from the
merged noise (pansketch.host_tools.query.estimators), whatever mix of nodes it is.

Series over time (``pansketch query series``) are in host_tools/query/series.py:
each bucket and each running total is one such range query.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from pansketch.agent import hashing
from pansketch.host_tools.output import textsafe
from pansketch.host_tools.query import estimators, ranking
from pansketch.host_tools.query.merge import MergeError, Merged, NoiseTerm, merge
from pansketch.host_tools.store import exclusions
from pansketch.host_tools.store.rows import RollupInfo, StoredRelease
from pansketch.host_tools.store.sql import SQLStore
from pansketch.host_tools.store.write import rollup_key

try:
    from pansketch.host_tools import fasthash
except ImportError:  # pragma: no cover - fasthash ships with host_tools
    fasthash = None  # type: ignore[assignment]


class QueryError(Exception):
    """A query that cannot be answered (no data, unmergeable releases, wrong salt)."""


# -- time ------------------------------------------------------------------
def parse_time(s: Union[str, int, float]) -> float:
    """Unix seconds from unix seconds or ISO-8601 (UTC unless an offset is given)."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s)
    txt = str(s).strip()
    try:
        return float(txt)
    except ValueError:
        pass
    t = txt[:-1] + "+00:00" if txt.endswith(("Z", "z")) else txt
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise ValueError("not a time: %r (use ISO-8601 such as 2024-05-01T12:00:00Z, or unix seconds)" % txt)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def iso(t: Optional[float]) -> Optional[str]:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- selection ---------------------------------------------------------------
@dataclass
class Selection:
    window: Optional[int] = None
    since: Optional[float] = None
    until: Optional[float] = None
    devices: Optional[list[str]] = None
    partial: int = 0  # releases straddling the range bounds, left out
    tree_nodes: int = 0  # tree-mode nodes used (all their parts are in the merge)
    tree_skipped: int = 0  # tree-mode releases inside the range not needed by the cover
    missing_epochs: int = 0  # epochs of tree-mode devices inside their covered span with no node
    tree_used: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # per tree device: its cover
    tree_facts: dict[str, Any] = field(default_factory=dict)  # pansketch.host_tools.query.treels.apply's report
    excluded: list[str] = field(default_factory=list)  # devices left out (excluded in the store or by the query)

    def describe(self) -> str:
        if self.window is not None:
            s = "window %d" % self.window
        elif self.since is not None or self.until is not None:
            s = "range [%s, %s)" % (iso(self.since) or "-inf", iso(self.until) or "+inf")
        else:
            s = "all releases"
        if self.devices:
            s += ", device %s" % ",".join(self.devices)
        return s


def _devices(device: Union[None, str, Sequence[str]]) -> Optional[list[str]]:
    if device is None:
        return None
    if isinstance(device, str):
        return [device]
    return list(device) or None


def cover(nodes: dict[tuple[int, int], Any], lo: int, hi: int) -> tuple[list[tuple[int, int]], int]:
    """Fewest aligned dyadic nodes among ``nodes`` (keys (elo, ehi)) covering [lo, hi).

    From the left, take the largest stored node [x, x + 2**l) with x = 0 mod
    2**l that fits in [lo, hi); with every node stored this is the canonical
    decomposition (at most two nodes per level, minimal). Epochs no stored
    node covers are skipped and counted. Returns (nodes used, epochs missing).
    """
    top = 0
    for a, b in nodes:
        top = max(top, (b - a).bit_length() - 1)
    used: list[tuple[int, int]] = []
    missing = 0
    x = lo
    while x < hi:
        lv = top
        while lv >= 0:
            n = 1 << lv
            if x % n == 0 and x + n <= hi and (x, x + n) in nodes:
                break
            lv -= 1
        if lv < 0:
            missing += 1
            x += 1
            continue
        used.append((x, x + (1 << lv)))
        x += 1 << lv
    return used, missing


def _tree_cover(rels: list[Any], sel: Selection) -> list[Any]:
    """Replace each tree-mode device's releases by the parts of its covering nodes."""
    out = [r for r in rels if r.mode != "tree"]
    by_dev: dict[str, list[Any]] = {}
    for r in rels:
        if r.mode == "tree":
            by_dev.setdefault(r.device, []).append(r)
    for dev in sorted(by_dev):
        rs = by_dev[dev]
        nodes: dict[tuple[int, int], list[Any]] = {}
        for r in rs:
            nodes.setdefault((r.elo, r.ehi), []).append(r)
        lo = min(r.elo for r in rs)
        hi = max(r.ehi for r in rs)
        used, missing = cover(nodes, lo, hi)
        sel.tree_used[dev] = used
        n = 0
        for k in used:
            out.extend(nodes[k])
            n += len(nodes[k])
        sel.tree_nodes += len(used)
        sel.tree_skipped += len(rs) - n
        sel.missing_epochs += missing
    return out


POINT_KINDS = ("cs", "cms")  # freq, topk, series
KIND_QUERIES = {"cs": "freq, topk, series", "cms": "freq, topk, series", "dcs": "quantile, cdf, heavy",
                "dbits": "distinct", "strhh": "heavy"}


def pick_devices(store: SQLStore, kinds: Sequence[str]) -> Optional[list[str]]:
    """On a store that mixes kinds: the devices a query of ``kinds`` should merge when none are named.

    The devices of the one kind among ``kinds`` that most devices have (ties: the earlier in
    ``kinds``); None when the store holds that kind only (the fleet-wide path, with roll-ups).
    Devices of that kind with different shapes still meet the merge's refusal, which names them.
    QueryError naming what the store holds when no device is of those kinds. Reads the devices
    table only (one row per device), never the releases.
    """
    held = store.kind_counts()
    fit = [k for k in kinds if held.get(k)]
    if not fit:
        what = ", ".join("kind %s (%d device%s: answers %s)" % (k, n, "" if n == 1 else "s", KIND_QUERIES.get(k, "?"))
                         for k, n in sorted(held.items()))
        raise QueryError("no releases of kind %s in this store%s" % (
            " or ".join("'%s'" % k for k in kinds), "; it holds " + what if what else ""))
    best = min(fit, key=lambda k: (-held[k], list(kinds).index(k)))
    if len(held) == 1:
        return None
    return store.devices_of_kind(best)


def select_merged(store: SQLStore, window: Optional[int] = None, since: Optional[float] = None,
                  until: Optional[float] = None, device: Union[None, str, Sequence[str]] = None,
                  salt: Optional[str] = None, use_rollups: bool = True,
                  kinds: Optional[Sequence[str]] = None, consistent: bool = True,
                  exclude: Optional[Iterable[str]] = None) -> tuple[Merged, Selection]:
    """Merge the selected releases; raises QueryError with the reason.

    Fleet-wide selections (no ``device``) are answered from the per-window
    roll-ups the store maintains at ingest, plus the raw releases of the
    windows that straddle a range bound; ``--device`` selections, stores
    without roll-ups and selections that span several merge groups (to
    report them) are merged from the raw releases, streaming (one payload
    in memory at a time). Both give the same :class:`Merged`
    (tests/test_host_rollups.py).
    """
    if window is not None and (since is not None or until is not None):
        raise QueryError("give either a window id or a time range, not both")
    if since is not None and until is not None and until <= since:
        raise QueryError("empty time range: until must be after since")
    if kinds and _devices(device) is None:  # a mixed store: the devices of the kinds this query answers
        device = pick_devices(store, kinds)
    sel = Selection(window=window, since=since, until=until, devices=_devices(device))
    m: Optional[Merged] = None
    with store.read_tx():  # one snapshot, while aggregators keep committing
        # devices left out: those excluded in the store (`pansketch device exclude`) and those the
        # query names (``exclude``, --exclude-device); the answer is that of a store without them
        excl = set(exclusions.excluded(store)) | set(exclude or ()) | set(getattr(store, "query_exclude", ()) or ())
        sel.excluded = sorted(excl)
        if excl and sel.devices is not None:
            sel.devices = [d for d in sel.devices if d not in excl]
            if not sel.devices:
                raise QueryError("every selected device is excluded (%s; `pansketch device include ID` takes one "
                                 "back)" % ", ".join(sorted(excl)[:8]))
        # a store that also holds releases no roll-up sums (kinds dcs/dbits, tree nodes) merges raw
        # releases: the roll-ups alone would answer a mixed selection from its cms/cs part only
        if use_rollups and sel.devices is None and store.has_rollups and not store.has_unrolled():
            m = _from_rollups(store, sel, excl) if excl else _from_rollups(store, sel)
        if m is None:
            if excl and sel.devices is None:
                sel.devices = [d for d in store.devices_with_releases() if d not in excl]
                if not sel.devices:
                    raise QueryError("no releases of any device that is not excluded (%s)"
                                     % ", ".join(sorted(excl)[:8]))
            m = _from_releases(store, sel, consistent)
    if salt is not None and hashing.salt_id(salt) != m.salt:
        raise QueryError("the configured fleet salt (id %s) is not the salt of these releases (id %s)"
                         % (hashing.salt_id(salt), m.salt))
    return m, sel


def _window_lengths(window: int, lens: set[int]) -> None:
    if len(lens) > 1:
        raise QueryError("window %d means different times for devices with window lengths %s seconds; "
                         "query a time range (--since/--until) or one device" % (window, sorted(lens)))


def _from_releases(store: SQLStore, sel: Selection, consistent: bool = True) -> Merged:
    """Merge the raw releases of the selection (streaming); tree-mode covers from least-squares
    consistent nodes unless ``consistent`` is False (pansketch.host_tools.query.treels)."""
    window, since, until = sel.window, sel.since, sel.until
    every = store.releases(devices=sel.devices, window=window, since=since, until=until)
    if since is not None or until is not None:
        sel.partial = store.count_partial(since, until, sel.devices)
    kept = {id(r) for r in _tree_cover(every, sel)}
    rels = [r for r in every if id(r) in kept]  # the store's order, which iter_counters follows
    if not rels:
        extra = " (%d release(s) straddle the range bounds)" % sel.partial if sel.partial else ""
        known = [r[0] for r in store.device_activity()]
        unknown = [d for d in (sel.devices or []) if d not in known]
        if unknown:  # a typo or a device that never released: say which ones exist
            raise QueryError("no releases match device %s: it has none; devices with releases: %s" % (
                ", ".join(unknown), ", ".join(known[:20]) + (" ... (%d in all)" % len(known) if len(known) > 20 else "")
                if known else "none yet"))
        raise QueryError("no releases match %s%s" % (sel.describe(), extra))
    if window is not None:
        _window_lengths(window, {r.win_s for r in rels})

    def counters() -> Any:
        for r, c in zip(every, store.iter_counters(devices=sel.devices, window=window, since=since, until=until)):
            if id(r) in kept:
                yield c

    try:
        m = merge(rels, counters())
    except MergeError as exc:
        raise QueryError(str(exc))
    if sel.tree_used and consistent:
        from pansketch.host_tools.query import treels

        keys: dict[str, set[tuple[int, int]]] = {}
        ep_s: dict[str, int] = {}
        for dev in sel.tree_used:
            trs = [r for r in store.releases(devices=[dev]) if r.mode == "tree"]
            keys[dev] = {(r.elo, r.ehi) for r in trs}
            ep_s[dev] = trs[0].ep_s
        sel.tree_facts = treels.apply(store, m, sel.tree_used, keys, ep_s)
    return m


def _from_rollups(store: SQLStore, sel: Selection, excl: Optional[set[str]] = None) -> Optional[Merged]:
    """The selection from roll-ups (+ raw releases of boundary windows), or None to merge raw releases.

    Tree-mode nodes overlap and are never rolled up: a store holding any
    takes the raw path, which covers each tree device with its fewest nodes."""
    if store.has_tree():
        return None
    # only roll-ups overlapping the range: the rest are neither used nor boundary windows below
    infos = store.rollups(window=sel.window, since=sel.since, until=sel.until)
    if sel.window is not None:
        _window_lengths(sel.window, {i.win_s for i in infos})
    use: list[RollupInfo] = []
    boundary: set[tuple[int, int]] = set()
    if sel.since is None and sel.until is None:
        use = infos
    else:
        lo = sel.since if sel.since is not None else -math.inf
        hi = sel.until if sel.until is not None else math.inf
        for i in infos:
            if i.t0 >= lo and i.t1 <= hi:
                use.append(i)  # every release of this roll-up lies inside the range
            elif i.t0 < hi and i.t1 > lo:
                boundary.add((i.win_s, i.win))  # some may, some may straddle: raw releases
    raw: list[StoredRelease] = []
    for ws, win in sorted(boundary):
        raw += [r for r in store.releases(window=win, win_s=ws, since=sel.since, until=sel.until, with_payload=True)
                if not excl or r.device not in excl]
    if boundary:
        keep = [d for d in store.devices_with_releases() if d not in excl] if excl else None
        sel.partial = store.count_partial(sel.since, sel.until, devices=keep, windows=boundary) if keep != [] else 0
    less: Optional[_Less] = None
    if excl:
        less = _less(store, use, excl)
        if less is None:
            return None  # an excluded device's payload was pruned: the raw path says which
        use = [i for i in use if i.id not in less.gone]
    if not use and not raw:
        return None  # the raw path reports "no releases match" with the straddling count
    groups = {i.group for i in use} | {r.group for r in raw}
    if len(groups) != 1:
        return None  # the raw path names the groups and their devices
    kind, d, w, hv, salt = next(iter(groups))
    ids = [i.id for i in use]
    acc = np.zeros((d, w), dtype=np.int64)
    for c in store.rollup_sums(ids):
        acc += c
    for r in raw:
        acc += r.counters()
    terms = store.rollup_noise(ids) if ids else {}
    for r in raw:
        for k, n in (((r.mech, r.nint[0], r.nint[1]), r.nz - 1), ((r.mech, r.nout[0], r.nout[1]), 1)):
            terms[k] = terms.get(k, 0) + n
    devices = _rollup_devices(store, use, {r.device for r in raw}, excl)
    n_rel = sum(i.releases for i in use) + len(raw)
    t0s, t1s = [i.t0 for i in use], [i.t1 for i in use]
    if less is not None:  # the excluded devices' releases taken out of the roll-ups that sum them
        acc -= less.sums
        for k, n in less.noise.items():
            terms[k] = terms.get(k, 0) - n
        terms = {k: n for k, n in terms.items() if n}
        devices = set(devices) - (excl or set())
        n_rel -= sum(i.releases - less.releases.get(i.id, i.releases) for i in use)
        t0s = [less.extent.get(i.id, (i.t0, i.t1))[0] for i in use]
        t1s = [less.extent.get(i.id, (i.t0, i.t1))[1] for i in use]
    return Merged(kind=kind, d=d, w=w, hv=hv, salt=salt, counters=acc,
                  releases=n_rel, devices=devices if isinstance(devices, list) else sorted(devices),
                  noise=[NoiseTerm(mm, n, dd, c) for (mm, n, dd), c in sorted(terms.items())],
                  t0=min(t0s + [r.t0 for r in raw]), t1=max(t1s + [r.t1 for r in raw]),
                  windows=sorted({(i.win_s, i.win) for i in use} | {(r.win_s, r.win) for r in raw}))


def _rollup_devices(store: SQLStore, use: list[RollupInfo], raw: set[str],
                    excl: Optional[set[str]]) -> Union[list[str], set[str]]:
    """The devices of the roll-ups ``use`` and of the boundary releases' devices ``raw``.

    Every device in a roll-up has a row in ``devices`` (written with its first release, deleted with its
    last), so a roll-up that counts as many devices as that table holds has them all, and so has the
    union: then the answer is the sorted table (:meth:`all_devices`, O(N) once) instead of the N rows of
    every window (O(N * W)). A roll-up's count is the sum over its rows (PostgreSQL keeps one row per
    writer shard and counts each device of a roll-up in one of them: pansketch.host_tools.store.pg).
    Otherwise, or with devices excluded, or without kept counts: the rows."""
    ids = [i.id for i in use]
    if ids and not excl:
        counts = store.rollup_device_counts(ids)
        if counts:
            per_key: dict[tuple[Any, ...], int] = {}
            for i in use:
                k = (i.win_s, i.win, i.group)
                per_key[k] = per_key.get(k, 0) + counts.get(i.id, 0)
            if max(per_key.values()) == store.device_count():
                every = store.all_devices()
                if not raw or raw <= set(every):
                    return every
    return (store.rollup_devices(ids) if ids else set()) | raw


@dataclass
class _Less:
    """What the excluded devices put into the roll-ups a selection uses: their counter sums and noise
    draws, and per roll-up id the release count and time extent without them."""

    sums: Any
    noise: dict[tuple[str, int, int], int]
    releases: dict[int, int]  # roll-up id -> releases left (PostgreSQL: all taken from the key's first row)
    extent: dict[int, tuple[int, int]]  # roll-up id -> (t0, t1) of the releases left
    gone: set[int]  # roll-up ids that sum excluded devices only (left out whole: a store without them has none)


def _less(store: SQLStore, use: list[RollupInfo], excl: set[str]) -> Optional[_Less]:
    """The excluded devices' part of the roll-ups in ``use`` (None if one of their payloads was pruned)."""
    touched = exclusions.touched_rollups(store, excl)
    hit = [i for i in use if i.id in touched]
    d, w = (use[0].d, use[0].w) if use else (1, 1)
    out = _Less(np.zeros((d, w), dtype=np.int64), {}, {}, {}, set())
    by_key: dict[tuple[Any, ...], list[RollupInfo]] = {}
    for i in hit:
        by_key.setdefault((i.win_s, i.win, i.kind, i.d, i.w, i.hv, i.salt), []).append(i)
    for key, infos in sorted(by_key.items()):
        ws, win = key[0], key[1]
        mine = [r for r in store.releases(window=win, win_s=ws, devices=sorted(excl), with_payload=True)
                if rollup_key(r) == key]
        rest = [r for r in store.releases(window=win, win_s=ws) if rollup_key(r) == key and r.device not in excl]
        if not rest:
            out.gone.update(i.id for i in infos)
            continue
        if any(not r.payload for r in mine):
            return None
        for r in mine:
            out.sums += r.counters()
            for k, c in (((r.mech, r.nint[0], r.nint[1]), r.nz - 1), ((r.mech, r.nout[0], r.nout[1]), 1)):
                out.noise[k] = out.noise.get(k, 0) + c
        n = len(mine)
        for i in infos:  # the roll-up rows of one key add up: take the excluded count from them in turn
            take = min(i.releases, n)
            n -= take
            out.releases[i.id] = i.releases - take
            out.extent[i.id] = (min(r.t0 for r in rest), max(r.t1 for r in rest))
    return out


# -- answers -----------------------------------------------------------------
DEVICES_LIMIT = 20  # contributing devices an answer's JSON lists by default (all: --all-devices)


@dataclass
class Answer:
    item: Any
    estimate: float
    lo: float
    hi: float
    confidence: float
    window: Optional[int]
    since: int  # start of the covered epochs (unix s)
    until: int  # end of the covered epochs
    devices: list[str]
    releases: int
    kind: str
    noise_sd: float
    method: str
    offset: float = 0.0
    rank: Optional[int] = None
    partial_excluded: int = 0
    noise_draws: int = 0  # independent noise draws per cell summed by the merge
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, devices_offset: int = 0, devices_limit: Optional[int] = DEVICES_LIMIT) -> dict[str, Any]:
        """The JSON object of the answer. Its contributing devices are a page: ``devices`` lists
        ``devices_limit`` of them from ``devices_offset`` (device order) and ``devices_page`` is
        {offset, limit, total}; ``devices_limit`` None lists every device, without ``devices_page``
        (a fleet-wide answer over 10^4 devices is then about 140 KB)."""
        d: dict[str, Any] = {}
        if self.rank is not None:
            d["rank"] = self.rank
        if devices_limit is None and not devices_offset:
            listed = self.devices
        else:
            end = None if devices_limit is None else devices_offset + devices_limit
            listed = self.devices[devices_offset:end]
        d.update({
            "item": self.item if isinstance(self.item, (str, int)) else repr(self.item),
            "estimate": _num(self.estimate), "lo": _num(self.lo), "hi": _num(self.hi),
            "confidence": self.confidence, "window": self.window,
            "range": {"since": iso(self.since), "until": iso(self.until), "since_unix": self.since,
                      "until_unix": self.until},
            "devices": listed, "releases": self.releases, "noise_draws": self.noise_draws, "kind": self.kind,
            "noise_sd": round(self.noise_sd, 3), "method": self.method,
        })
        if listed is not self.devices:
            d["devices_page"] = {"offset": devices_offset, "limit": devices_limit, "total": len(self.devices)}
        if self.kind == "cms":
            d["offset"] = round(self.offset, 3)
        if self.partial_excluded:
            d["partial_excluded"] = self.partial_excluded
        d.update(self.extra)
        return d


def _num(x: float) -> Union[int, float, None]:
    if math.isinf(x) or math.isnan(x):
        return None
    if float(x).is_integer():
        return int(x)
    return round(float(x), 3)


def _hash(items: Sequence[Any], salt: str, d: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    if fasthash is not None:
        return fasthash.cols_signs(fasthash.streams(items, salt, d), d, w)
    prefix = hashing.salt_prefix(salt)
    cols = np.empty((len(items), d), dtype=np.int64)
    signs = np.empty((len(items), d), dtype=np.int8)
    for i, x in enumerate(items):
        for r, (c, s) in enumerate(hashing.columns(prefix, x, d, w)):
            cols[i, r] = c
            signs[i, r] = s
    return cols, signs


def _tree_extra(sel: Selection) -> dict[str, Any]:
    if not (sel.tree_nodes or sel.missing_epochs):
        return {}
    return {"tree_nodes": sel.tree_nodes, "tree_missing_epochs": sel.missing_epochs, **sel.tree_facts}


def _answers(m: Merged, sel: Selection, items: Sequence[Any], est: np.ndarray, rule: estimators.IntervalRule,
             idx: Iterable[int], ranked: bool,
             bounds: Optional[tuple[np.ndarray, np.ndarray, str]] = None) -> list[Answer]:
    out = []
    for rank, i in enumerate(idx, 1):
        e = float(est[i])
        lo, hi = (e - rule.below, e + rule.above) if bounds is None else (float(bounds[0][i]), float(bounds[1][i]))
        out.append(Answer(item=items[i], estimate=e, lo=lo, hi=hi,
                          confidence=rule.confidence, window=sel.window, since=m.t0, until=m.t1,
                          devices=m.devices, releases=m.releases, kind=m.kind, noise_sd=rule.noise_sd,
                          method=rule.method if bounds is None else bounds[2], offset=rule.offset,
                          rank=rank if ranked else None,
                          partial_excluded=sel.partial, noise_draws=m.noise_draws, extra=_tree_extra(sel)))
    return out


def _point_kind(m: Merged) -> None:
    if m.kind == "dcs":
        raise QueryError("releases of kind dcs answer quantile, cdf and heavy (not freq/topk)")
    if m.kind == "strhh":
        raise QueryError("releases of kind strhh answer heavy (not freq/topk)")


def freq(store: SQLStore, items: Sequence[Any], *, salt: str, window: Optional[int] = None,
         since: Optional[float] = None, until: Optional[float] = None,
         device: Union[None, str, Sequence[str]] = None, confidence: float = 0.95,
         use_rollups: bool = True, pick: bool = True, consistent: bool = True) -> list[Answer]:
    """Estimated frequency of each item (in order) over the selection, with intervals
    (tree-mode nodes made consistent first unless ``consistent`` is False).

    ``pick``: on a store that mixes kinds, merge the devices of :data:`POINT_KINDS` when no device is
    named (:func:`pick_devices`); False when the caller already did (series, per bucket).
    """
    m, sel = select_merged(store, window, since, until, device, salt, use_rollups,
                           kinds=POINT_KINDS if pick else None, consistent=consistent)
    return merged_answers(m, sel, items, salt, confidence)


def merged_answers(m: Merged, sel: Selection, items: Sequence[Any], salt: str, confidence: float) -> list[Answer]:
    """:func:`freq`'s answers from an already merged selection (a series sums its buckets' merges
    into running totals instead of merging each running range again)."""
    _point_kind(m)
    items = list(items)
    cols, signs = _hash(items, salt, m.d, m.w)
    est = estimators.point_estimates(m.counters, cols, signs, m.kind)
    rule = estimators.interval_rule(m, confidence)
    return _answers(m, sel, items, est, rule, range(len(items)), False)


def topk(store: SQLStore, candidates: Sequence[Any], k: int, *, salt: str, window: Optional[int] = None,
         since: Optional[float] = None, until: Optional[float] = None,
         device: Union[None, str, Sequence[str]] = None, confidence: float = 0.95,
         use_rollups: bool = True, refit: bool = True) -> list[Answer]:
    """The k candidates with the largest estimates, best first, with intervals.

    CountSketch: the leading candidates are re-estimated by a least-squares refit
    (pansketch.host_tools.query.ranking; ``refit=False`` ranks by the medians); each interval
    is the calibrated one of the median, extended to contain the refit value.
    Intervals are per item (each covers its own count at ``confidence``),
    not simultaneous over the k items.
    """
    if k < 1:
        raise QueryError("k must be at least 1")
    m, sel = select_merged(store, window, since, until, device, salt, use_rollups, kinds=POINT_KINDS)
    _point_kind(m)
    cands = list(dict.fromkeys(candidates))  # distinct, first-seen order
    if not cands:
        raise QueryError("no candidates")
    cols, signs = _hash(cands, salt, m.d, m.w)
    est = estimators.point_estimates(m.counters, cols, signs, m.kind)
    rule = estimators.interval_rule(m, confidence)
    k = min(k, len(cands))
    bounds = None
    fit = ranking.refit(m.counters, cols, signs, est, k) if refit and m.kind == "cs" else None
    if fit is not None:
        S, f = fit
        lo, hi = est - rule.below, est + rule.above
        est = est.copy()
        est[S] = f
        bounds = (np.minimum(lo, est), np.maximum(hi, est), rule.method + "+ls-refit")
    part = np.argpartition(-est, k - 1)[:k]
    order = part[np.lexsort((part, -est[part]))]  # by estimate desc, ties by candidate order
    return _answers(m, sel, cands, est, rule, [int(i) for i in order], True, bounds)


def read_candidates(path: str, as_int: bool = False) -> list[Any]:
    """Candidates file: one item per line (text before a TAB; blank lines skipped)."""
    out: list[Any] = []
    try:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    except OSError as exc:  # a hint, not a raw "[Errno 2] No such file or directory: 'x'"
        raise ValueError("--candidates %s: %s (one item per line, or - for standard input)"
                         % (path, exc.strerror or exc))
    try:
        for n, line in enumerate(f, 1):
            item = line.rstrip("\r\n").split("\t", 1)[0]
            if not item:
                continue
            out.append(_item(item, as_int, "%s line %d" % (path, n)))
    finally:
        if f is not sys.stdin:
            f.close()
    return out


def _item(s: str, as_int: bool, where: str) -> Any:
    if not as_int:
        return s
    try:
        return int(s, 10)
    except ValueError:
        raise ValueError("%s: %r is not an integer (drop --int for text items)" % (where, s))


def int_at_least(txt: str, lo: int) -> int:
    """An integer >= ``lo`` for an argparse type (a usage error, exit 2, otherwise)."""
    try:
        v = int(txt, 10)
    except ValueError:
        raise argparse.ArgumentTypeError("not an integer: %r" % txt)
    if v < lo:
        raise argparse.ArgumentTypeError("must be at least %d, got %d" % (lo, v))
    return v


def positive_int(txt: str) -> int:
    """argparse type: an integer >= 1."""
    return int_at_least(txt, 1)


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "-inf" if x < 0 else "+inf"
    return "%d" % x if float(x).is_integer() else "%.1f" % x


def _print_table(answers: list[Answer], ranked: bool, elapsed: float) -> None:
    if not answers:
        return
    a0 = answers[0]
    where = "window %d" % a0.window if a0.window is not None else "epochs [%s, %s)" % (iso(a0.since), iso(a0.until))
    print("# %s; %d release(s) from %d device(s) (%s), %d noise draws per cell; %s sketch, noise sd %.1f per cell; "
          "%.0f%% intervals (%s)"
          % (where, a0.releases, len(a0.devices), ",".join(a0.devices[:8]) + ("..." if len(a0.devices) > 8 else ""),
             a0.noise_draws, a0.kind, a0.noise_sd, 100 * a0.confidence, a0.method))
    if a0.extra.get("tree_nodes"):
        print("# tree-mode devices: %d dyadic node(s) cover the range" % a0.extra["tree_nodes"]
              + ("; %d epoch(s) without any node" % a0.extra["tree_missing_epochs"]
                 if a0.extra.get("tree_missing_epochs") else ""))
    if a0.partial_excluded:
        print("# %d release(s) straddling the range bounds were left out" % a0.partial_excluded)
    items = [textsafe.term(a.item) for a in answers]  # items may come from devices (strhh) or files
    width = max(8, min(40, max(len(x) for x in items)))
    head = ("%4s  " % "RANK" if ranked else "") + "%-*s  %12s  %s" % (width, "ITEM", "ESTIMATE", "INTERVAL")
    print(head)
    for a, item in zip(answers, items):
        line = ("%4d  " % (a.rank or 0) if ranked else "") + "%-*s  %12s  [%s, %s]" % (
            width, item[:width], _fmt(a.estimate), _fmt(a.lo), _fmt(a.hi))
        print(line)
    print("# answered in %.1f ms" % (elapsed * 1000))
