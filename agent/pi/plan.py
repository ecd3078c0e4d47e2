"""Which mode for which query pattern: noise of a k-epoch range count.

Used by ``pansketch-agent check`` (and host_tools/bench/tree.py). A report,
not the noise path: floats are fine here.

Per cell, in units of one window-mode draw variance v1 (the variance of
the noise calibrated with L = 1 at the same budget):

* window/keep, one release per epoch: k * (2 + p) draws of v1, where
  p = ceil(epoch_s / persist_s) - 1 persists per epoch (a release resets
  the persist clock); under persist_noise = "shadow", k * (u(2) + 1):
  one internal draw at the calibration of 2 arrays + Z_out, whatever p
  (u(a) = a for the discrete Gaussian, about a^2 for discrete Laplace);
* tree with L levels: every draw is calibrated for L arrays, so it has
  variance L * v1 (discrete Gaussian: sigma^2 scales with Delta2^2) or
  about L^2 * v1 (discrete Laplace: the scale t scales with Delta1);
  a range uses nodes(k) nodes (the canonical dyadic cover, averaged over
  the range's position) with 2 draws each (Z_int, Z_out) plus one draw
  per persist inside the range (k * epoch_s / persist_s: in tree mode the
  persists go on while nodes are released); under shadow, nodes(k) *
  (u(2L) + u(L)): no persist term.

Restarts are not modelled (under shadow a restart adds the flash track's
draws to the nodes open at the time, docs/PRIVACY.md).
"""

import math


def cover_size(s, e, top):
    """Nodes in the canonical cover of epochs [s, e) with levels 0..top."""
    n = 0
    x = s
    while x < e:
        lv = top
        while lv > 0 and (x % (1 << lv) or x + (1 << lv) > e):
            lv -= 1
        x += 1 << lv
        n += 1
    return n


def avg_nodes(k, levels, samples=256):
    """Mean cover size of a k-epoch range over its position (deterministic sample of starts)."""
    top = levels - 1
    period = 1 << top
    n = min(samples, period)
    tot = 0
    for i in range(n):
        # an odd multiplier spreads the starts evenly over every residue class mod 2^j
        tot += cover_size((i * 7919 + 13) % period, (i * 7919 + 13) % period + k, top)
    return tot / float(n)


def _unit(arrays, mech):
    """Variance of one draw calibrated for ``arrays`` arrays, in units of v1."""
    return float(arrays) if mech == "dgauss" else float(arrays * arrays)


def range_variance(mode, k, epoch_s, persist_s, levels=1, mech="dgauss", shadow=False):
    """Per-cell noise variance of a k-epoch range, in units of v1 (see module doc)."""
    if mode != "tree":
        if shadow:
            return k * (_unit(2, mech) + 1.0)
        p = max(0, -(-epoch_s // persist_s) - 1)
        return k * (2.0 + p)
    per = _unit(levels, mech)
    if shadow:
        return avg_nodes(k, levels) * (_unit(2 * levels, mech) + per)
    return per * (2.0 * avg_nodes(k, levels) + k * epoch_s / float(persist_s))


def crossover(pw, pt, limit=1 << 22):
    """Smallest k (epochs) from which tree params ``pt`` give less noise than
    window/keep params ``pw``, or None below ``limit`` (binary search on the
    trend, then a linear check down)."""
    def better(k):
        return (range_variance("tree", k, pt.epoch_s, pt.persist_s, pt.levels, pt.mechanism, pt.shadow)
                < range_variance(pw.mode, k, pw.epoch_s, pw.persist_s, 1, pw.mechanism, pw.shadow))

    k = 1
    while k < limit and not better(k):
        k *= 2
    if k >= limit:
        return None
    lo = k // 2 + 1 if k > 1 else 1
    for j in range(lo, k + 1):
        if better(j) and better(j + 1) and better(2 * j):
            return j
    return k


def report(p, lengths=(1, 24, 168, 720, 10080), tree_levels=None):
    """Lines comparing window mode and tree mode at p's budget for k-epoch ranges."""
    from pansketch.agent.params import Params

    if p.kind not in ("cms", "cs"):  # Params refuses tree mode for dcs and dbits: nothing to compare
        return ["range noise: tree mode supports kinds cms and cs only (kind %s): no tree comparison" % p.kind]
    base = {"device": p.device, "salt": p.salt, "kind": p.kind, "d": p.d, "w": p.w, "clip": p.clip,
            "mechanism": p.mechanism, "budget": "%d/%d" % p.budget, "epoch_s": p.epoch_s, "persist_s": p.persist_s}
    L = tree_levels or (p.levels if p.mode == "tree" else 8)
    # window/keep with the config's persist scheme (auto resolves per epoch length); the tree both ways
    cfg_w = dict(base, mode="window", window_s=p.epoch_s,
                 persist_noise="auto" if p.mode == "tree" else p.persist_noise)
    pw = Params(cfg_w)
    pt = Params(dict(base, mode="tree", levels=L, persist_noise="refresh"))
    ps = Params(dict(base, mode="tree", levels=L, persist_noise="shadow"))
    v1 = pw.noise.num / pw.noise.den
    if pw.mechanism == "dlap":
        t = v1
        q = math.exp(-1.0 / t)
        v1 = 2 * q / (1 - q) ** 2
    out = ["range noise (per cell sd) at this budget, epoch %d s, persist %d s:" % (p.epoch_s, p.persist_s),
           "  %-10s %18s %14s %16s  %s" % ("epochs", "per epoch (%s)" % ("shadow" if pw.shadow else "refresh"),
                                           "tree L=%d" % L, "tree+shadow", "better")]
    for k in lengths:
        vw = range_variance("window", k, p.epoch_s, p.persist_s, 1, p.mechanism, pw.shadow)
        vt = range_variance("tree", k, p.epoch_s, p.persist_s, L, p.mechanism)
        vs = range_variance("tree", k, p.epoch_s, p.persist_s, L, p.mechanism, True)
        best = min(vw, vt, vs)
        out.append("  %-10d %18.1f %14.1f %16.1f  %s" % (
            k, math.sqrt(vw * v1), math.sqrt(vt * v1), math.sqrt(vs * v1),
            "window/keep" if best == vw else ("tree" if best == vt else "tree+shadow")))
    c = crossover(pw, pt)
    cs = crossover(pw, ps)
    if c is None and cs is None:
        out.append("recommendation: tree mode never has less noise here; use window/keep")
    else:
        use_shadow = cs is not None and (c is None or cs < c)
        k0 = cs if use_shadow else c
        out.append("recommendation: ranges of %d epochs or more -> mode = \"tree\" (levels = %d, horizon %d epochs%s); "
                   "shorter ranges -> window/keep" % (k0, L, 1 << (L - 1),
                                                       ", persist_noise = \"shadow\": %d more arrays of RAM" % L
                                                       if use_shadow else ""))
    return out


# -- will the intervals say anything? (pansketch-agent check --events N) ------------------------
Z95 = 1.96


def _draw_var(spec):
    """Variance of one noise draw of a NoiseSpec (discrete Laplace: ~2 t^2)."""
    x = spec.num / spec.den
    return x if spec.mech == "dgauss" else 2.0 * x * x


def interval_advice(p, events, target=0.05, warn_at=0.25):
    """Lines describing the expected interval half-width, as a fraction of ``events``
    (the events of one release), and a warning with suggested d and w when it exceeds
    ``warn_at`` (the interval would be uninformative). Like DataSketches'
    suggest_num_buckets(relative_error) / suggest_num_hashes(confidence): the sketch-error
    part is a worst case over the data (all events on few items/values: F2 <= n^2), the
    noise part is exact in expectation for one release (internal + output draw).

    * cms: collision error <= e n / w with probability 1 - e^-d (Cormode-Muthukrishnan);
      suggested w = ceil(e / target), d = ceil(ln(1 / 0.05)) = 3.
    * cs: error <= sqrt(F2 / w) * z <= z n / sqrt(w); w = ceil((z / target)^2), d odd.
    * dcs: a rank sums one node per level; the h = exact_from(b, w) hashed levels add
      CountSketch errors (sum of variances <= h n^2 / w), the noise b node draws;
      w with z sqrt(h / w) <= target.
    * dbits: relative sd ~ 3 / (eps sqrt(w)) once n exceeds w, additive ~ 2 sqrt(w) / eps
      below (docs/HOST.md); w = ceil((3 z / (eps target))^2) rounded up to a multiple of 8.
    """
    n = float(max(1, events))
    nv = _draw_var(p.inoise) + _draw_var(p.noise)
    lines = []
    sugg = None
    if p.kind in ("cms", "cs"):
        noise = Z95 * math.sqrt(nv * (math.pi / 2.0 if p.kind == "cs" else 1.0) / max(1, p.d)) / n
        if p.kind == "cms":
            coll = math.e / p.w
            w_need = int(math.ceil(math.e / target))
        else:
            coll = Z95 / math.sqrt(p.w)
            w_need = int(math.ceil((Z95 / target) ** 2))
        sugg = (3, w_need)
        lines.append("intervals   %s at %d events per release: +-%.1f%% of n from noise, up to +-%.1f%% from "
                     "collisions (worst case over the data)" % (p.kind, events, 100 * noise, 100 * coll))
        total = noise + coll
    elif p.kind == "dcs":
        from pansketch.agent.dcs import exact_from

        h = exact_from(p.b, p.w)
        noise = Z95 * math.sqrt(p.b * nv * math.pi / 2.0 / max(1, p.d)) / n
        coll = Z95 * math.sqrt(h / float(p.w))
        w_need = p.w
        while Z95 * math.sqrt(exact_from(p.b, w_need) / float(w_need)) > target and w_need < (1 << 24):
            w_need *= 2
        sugg = (4, w_need)
        lines.append("intervals   dcs rank at %d events per release: +-%.1f%% of n from noise, up to +-%.1f%% "
                     "from collisions in %d hashed levels (worst case over the data)"
                     % (events, 100 * noise, 100 * coll, h))
        # per-salt intervals (host_tools/query/dyadic.py DyadicView.fit): a hashed level is solved by least
        # squares over the children of the nodes above 2 sd, at most d*w/2 of them
        node_sd = math.sqrt(nv / max(1, p.d))
        cap = p.d * p.w // 2
        spread = min(float(1 << p.b), n / (2.0 * node_sd) * 2.0)
        if h and spread > cap:
            lines.append("resolution  per-salt dcs intervals at single readings need at most %d readings with more "
                         "than %.0f events each (per release); with more, quantile and default cdf answers come "
                         "at a coarser resolution and `query cdf --at` a finer reading has no honest interval "
                         "(w = %d doubles the limit)" % (cap // 2, 2 * node_sd, 2 * p.w))
        total = noise + coll
    elif p.kind == "dbits":
        eps = p.budget[0] / float(p.budget[1])
        rel = Z95 * 3.0 / (eps * math.sqrt(p.w))
        add = Z95 * 2.0 * math.sqrt(p.w) / eps / n
        total = max(rel, add)
        w_need = int(math.ceil((3.0 * Z95 / (eps * target)) ** 2 / 8.0)) * 8
        sugg = (p.d, w_need)
        lines.append("intervals   dbits at %d distinct per release: about +-%.0f%% of n" % (events, 100 * total))
    else:
        return lines
    if total > warn_at:
        lines.append("warning     %s intervals will be uninformative at %d events per release (+-%.0f%% of n); "
                     "for +-%.0f%% at 95%%: d = %d, w = %d (%s)"
                     % (p.kind, events, 100 * total, 100 * target, sugg[0], sugg[1],
                        "or a larger budget" if p.kind == "dbits" else "or more events per release: a longer window"))
    return lines
