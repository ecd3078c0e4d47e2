"""Which mode for which query pattern: noise of a k-epoch range count.

Used by ``pansketch-agent check`` (and host_tools/bench_tree.py). A report,
not the noise path: floats are fine here.

Per cell, in units of one window-mode draw variance v1 (the variance of
the noise calibrated with L = 1 at the same budget):

* window/keep, one release per epoch: k * (2 + p) draws of v1, where
  p = ceil(epoch_s / persist_s) - 1 persists per epoch (a release resets
  the persist clock);
* tree with L levels: every draw is calibrated for L arrays, so it has
  variance L * v1 (discrete Gaussian: sigma^2 scales with Delta2^2) or
  about L^2 * v1 (discrete Laplace: the scale t scales with Delta1);
  a range uses nodes(k) nodes (the canonical dyadic cover, averaged over
  the range's position) with 2 draws each (Z_int, Z_out) plus one draw
  per persist inside the range (k * epoch_s / persist_s: in tree mode the
  persists go on while nodes are released).
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


def range_variance(mode, k, epoch_s, persist_s, levels=1, mech="dgauss"):
    """Per-cell noise variance of a k-epoch range, in units of v1 (see module doc)."""
    if mode != "tree":
        p = max(0, -(-epoch_s // persist_s) - 1)
        return k * (2.0 + p)
    per = float(levels) if mech == "dgauss" else float(levels * levels)
    return per * (2.0 * avg_nodes(k, levels) + k * epoch_s / float(persist_s))


def crossover(pw, pt, limit=1 << 22):
    """Smallest k (epochs) from which tree params ``pt`` give less noise than
    window/keep params ``pw``, or None below ``limit`` (binary search on the
    trend, then a linear check down)."""
    def better(k):
        return (range_variance("tree", k, pt.epoch_s, pt.persist_s, pt.levels, pt.mechanism)
                < range_variance(pw.mode, k, pw.epoch_s, pw.persist_s, 1, pw.mechanism))

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
    from agent.params import Params

    if p.kind not in ("cms", "cs"):  # Params refuses tree mode for dcs and dbits: nothing to compare
        return ["range noise: tree mode supports kinds cms and cs only (kind %s): no tree comparison" % p.kind]
    base = {"device": p.device, "salt": p.salt, "kind": p.kind, "d": p.d, "w": p.w, "clip": p.clip,
            "mechanism": p.mechanism, "budget": "%d/%d" % p.budget, "epoch_s": p.epoch_s, "persist_s": p.persist_s}
    L = tree_levels or (p.levels if p.mode == "tree" else 8)
    cfg_w = dict(base, mode="window", window_s=p.epoch_s)
    pw = Params(cfg_w)
    pt = Params(dict(base, mode="tree", levels=L))
    v1 = pw.noise.num / pw.noise.den
    if pw.mechanism == "dlap":
        t = v1
        q = math.exp(-1.0 / t)
        v1 = 2 * q / (1 - q) ** 2
    out = ["range noise (per cell sd) at this budget, epoch %d s, persist %d s:" % (p.epoch_s, p.persist_s),
           "  %-10s %14s %14s  %s" % ("epochs", "per epoch", "tree L=%d" % L, "better")]
    for k in lengths:
        vw = range_variance("window", k, p.epoch_s, p.persist_s, 1, p.mechanism)
        vt = range_variance("tree", k, p.epoch_s, p.persist_s, L, p.mechanism)
        out.append("  %-10d %14.1f %14.1f  %s" % (k, math.sqrt(vw * v1), math.sqrt(vt * v1),
                                                   "tree" if vt < vw else "window/keep"))
    c = crossover(pw, pt)
    if c is None:
        out.append("recommendation: tree mode never has less noise here (persists too frequent for the tree: "
                   "raise persist_s); use window/keep")
    else:
        out.append("recommendation: ranges of %d epochs or more -> mode = \"tree\" (levels = %d, horizon %d epochs); "
                   "shorter ranges -> window/keep" % (c, L, 1 << (L - 1)))
    return out
