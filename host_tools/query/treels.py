"""Tree-mode range answers from least-squares consistent node estimates.

A tree-mode device (agent/tree.py) releases every dyadic node of its epochs,
each with its own independent noise. The plain range answer sums the
canonical cover (pansketch.host_tools.query.core.cover) and ignores the other nodes,
although they carry information about the same events. Here the nodes of
every *complete* subtree (a released node whose descendants down to the
epochs were all released) that holds part of the cover are made consistent
by weighted least squares (pansketch.host_tools.query.consistency.tree_consistent,
Hay et al., VLDB 2010, Theorem 3 with per-node variances from each node's
noise terms), cell by cell, and the cover is summed from the consistent
values. Post-processing of released data: no privacy cost.

Intervals. CountSketch intervals are read from the merged counters
themselves (pansketch.host_tools.query.estimators: the counters are the sample of the
error distribution, noise at its merged scale), so they follow the smaller
noise with no model. The merged noise terms (``noise_sd``, ``noise_draws``,
Count-Min's offset E, dcs's exact levels) stay those of the raw cover: the
consistent answer is the best linear unbiased one, so its noise variance is
at most the raw cover's and E stays a valid (now conservative) bound for
Gaussian noise. The consistent answer's per-cell noise sd is reported as
``tree_noise_sd_consistent``: the variance of the weighted sum of the nodes'
draws, measured by running the same consistency on ``PROBES`` seeded normal
probe columns with the nodes' variances (the map is linear and the same for
every cell).

Nodes outside complete subtrees (the tree still open at the end, epochs the
device did not release) keep their raw values; a subtree too large to hold
in memory (more than ``MAX_VALUES`` node-cells) is split into its children.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import numpy as np

from pansketch.host_tools.query.consistency import tree_consistent
from pansketch.host_tools.query.merge import Merged, noise_variance

PROBES = 256
PROBE_SEED = 0x7EE5
MAX_VALUES = 1 << 24  # node-cells held at once (float64: 128 MB)
KINDS = ("cs", "cms", "dcs")  # linear counts (dbits bits are not)

Key = tuple[int, int]


def complete_nodes(keys: set[Key]) -> set[Key]:
    """Nodes (elo, ehi) present whose whole subtree down to single epochs is present."""
    done: set[Key] = set()
    for lo, hi in sorted(keys, key=lambda k: k[1] - k[0]):
        n = hi - lo
        if n == 1:
            done.add((lo, hi))
        elif n & (n - 1) == 0 and lo % n == 0:
            mid = lo + n // 2
            if (lo, mid) in done and (mid, hi) in done:
                done.add((lo, hi))
    return done


def _parent(k: Key) -> Key:
    n = 2 * (k[1] - k[0])
    lo = k[0] - k[0] % n
    return (lo, lo + n)


def subtree_root(k: Key, complete: set[Key], cells: int) -> Optional[Key]:
    """The largest complete ancestor-or-self of k that fits MAX_VALUES (None: k is not complete)."""
    if k not in complete:
        return None
    root = k
    while True:
        p = _parent(root)
        if p not in complete or (2 * (p[1] - p[0]) - 1) * (cells + PROBES) > MAX_VALUES:
            return root
        root = p


def node_variance(rels: list[Any]) -> float:
    """Per-cell noise variance of a node (the sum of its parts' draws)."""
    v = 0.0
    for r in rels:
        v += (r.nz - 1) * noise_variance(r.mech, r.nint[0], r.nint[1]) + noise_variance(r.mech, r.nout[0], r.nout[1])
    return v


def consistent_cover(store: Any, dev: str, root: Key, cover: list[Key], shape: tuple[int, ...],
                     ep_s_of: Any) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(raw sum, consistent sum, raw noise variance, consistent noise variance) of the
    ``cover`` nodes under the complete subtree ``root`` of device ``dev``."""
    lo, hi = root
    ep_s = int(ep_s_of(store, dev))
    rels = store.releases(devices=[dev], since=lo * ep_s, until=hi * ep_s)
    sel = [r for r in rels if r.mode == "tree"]
    L = (hi - lo).bit_length()  # levels 0 .. L-1
    cells = int(np.prod(shape))
    # a series asks many ranges of the same subtree: keep the last few made consistent (a subtree's
    # released nodes never change once complete; the key still checks what was read)
    key = (dev, root, len(sel), max((r.seq for r in sel), default=-1), tuple(shape))
    try:
        cache = _CACHE.setdefault(store, {})
    except TypeError:  # a store that cannot be weakly referenced: no cache
        cache = {}
    hit = cache.get(key)
    if hit is None:
        hit = _consistent_subtree(store, dev, root, sel, rels, ep_s, L, cells)
        cache[key] = hit
        while len(cache) > CACHE_SUBTREES:
            cache.pop(next(iter(cache)))
    vals, var, cons = hit
    raw = np.zeros(cells + PROBES)
    out = np.zeros(cells + PROBES)
    for a, b in cover:
        lv = (b - a).bit_length() - 1
        raw += vals[lv][(a - lo) >> lv]
        out += cons[lv][(a - lo) >> lv]
    raw_var = sum(var[(b - a).bit_length() - 1][(a - lo) >> ((b - a).bit_length() - 1)] for a, b in cover)
    cons_var = float(np.mean(np.square(out[cells:])))
    return raw[:cells].reshape(shape), out[:cells].reshape(shape), float(raw_var), cons_var


CACHE_SUBTREES = 2  # per store object (dropped with it)
_CACHE: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]]]" = \
    weakref.WeakKeyDictionary()


def _consistent_subtree(store: Any, dev: str, root: Key, sel: list[Any], rels: list[Any], ep_s: int, L: int,
                        cells: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """(raw node values, node variances, consistent values) per level of one complete subtree."""
    lo, hi = root
    vals = [np.zeros(((hi - lo) >> lv, cells + PROBES)) for lv in range(L)]
    var = [np.zeros((hi - lo) >> lv) for lv in range(L)]
    byk: dict[Key, list[Any]] = {}
    for r in sel:
        byk.setdefault((r.elo, r.ehi), []).append(r)
    it = store.iter_counters(devices=[dev], since=lo * ep_s, until=hi * ep_s)
    for r, c in zip(rels, it):
        if r.mode != "tree":
            continue
        lv = (r.ehi - r.elo).bit_length() - 1
        vals[lv][(r.elo - lo) >> lv, :cells] += np.asarray(c, dtype=np.float64).ravel()
    rng = np.random.default_rng(PROBE_SEED)
    for (a, b), parts in byk.items():
        lv = (b - a).bit_length() - 1
        v = node_variance(parts)
        var[lv][(a - lo) >> lv] = v
        vals[lv][(a - lo) >> lv, cells:] = rng.normal(0.0, math.sqrt(v), PROBES)
    return vals, var, tree_consistent(vals, var)


def apply(store: Any, m: Merged, used: dict[str, list[Key]], keys: dict[str, set[Key]],
          ep_s: dict[str, int]) -> dict[str, Any]:
    """Replace the tree devices' raw cover sums in ``m`` by consistent ones (in place).

    ``used``: per tree device, its cover nodes; ``keys``: all its stored nodes; ``ep_s``: its epoch length.
    Returns facts for the answer (nodes made consistent, noise variances)."""
    if m.kind not in KINDS or not used:
        return {}
    shape = m.counters.shape
    cells = int(np.prod(shape))
    delta = np.zeros(shape)
    raw_var = cons_var = 0.0
    nodes = 0
    for dev, cover in sorted(used.items()):
        complete = complete_nodes(keys[dev])
        groups: dict[Key, list[Key]] = {}
        for k in cover:
            root = subtree_root(k, complete, cells)
            if root is not None and (root != k or k[1] - k[0] > 1):  # a lone epoch has nothing to add
                groups.setdefault(root, []).append(k)
        for root, ks in sorted(groups.items()):
            r_sum, c_sum, rv, cv = consistent_cover(store, dev, root, ks, shape, lambda _s, d: ep_s[d])
            if cv >= rv:  # the probes' sampling error could only make it look worse: keep the raw nodes
                continue
            delta += c_sum - r_sum
            raw_var += rv
            cons_var += cv
            nodes += len(ks)
    if not nodes:
        return {}
    m.counters = m.counters + np.rint(delta).astype(np.int64)
    total = m.noise_var
    return {"tree_consistent_nodes": nodes,
            "tree_noise_sd_consistent": round(math.sqrt(max(0.0, total - raw_var + cons_var)), 3)}
