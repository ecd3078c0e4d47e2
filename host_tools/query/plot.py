"""Plots with interval bands for people without a server: ``pansketch query series|topk|freq --plot FILE``.

matplotlib (the ``repro`` extra) with the non-interactive Agg backend; the
format follows the file name (.png, .svg, .pdf). A series is drawn as
one line per item (or item and device) with its interval as a shaded band
and hollow markers where the interval includes 0; top-k / freq answers as
horizontal bars with interval whiskers. Titles state the confidence.
"""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from typing import Any, Sequence

from pansketch.host_tools.query.core import Answer, iso
from pansketch.host_tools.query.series import Series

FORMATS = (".png", ".svg", ".pdf")


# README "Dashboard, metrics and plots" says the same (tests/test_first_hour.py holds them together)
MISSING = ("--plot needs matplotlib, which `make demo` does not install: pip install 'pansketch[repro]' "
           "(`make setup-python` installs it too)")


def check_path(path: str) -> None:
    """Before the query runs: a format we draw, a directory that exists (no raw '[Errno 2]' after it)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError("--plot: %s: the file name must end in %s" % (path, ", ".join(FORMATS)))
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where):
        raise ValueError("--plot: %s: directory %s does not exist" % (path, where))
    if not os.access(where, os.W_OK):
        raise ValueError("--plot: %s: directory %s is not writable" % (path, where))


def available() -> None:
    """ImportError with the one-line hint when matplotlib is missing."""
    _plt()


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MISSING)
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _fin(x: float) -> float:
    return x if math.isfinite(x) else float("nan")


def plot_series(s: Series, path: str, title: str = "") -> str:
    """Line + band per line of ``s``; returns ``path``."""
    check_path(path)
    plt = _plt()
    import matplotlib.dates as mdates

    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ln in enumerate(s.lines):
        c = colors[i % len(colors)]
        xs, est, lo, hi, zx, zy = [], [], [], [], [], []
        for p in ln.points:
            xs.append(datetime.fromtimestamp((p.t0 + p.t1) / 2, tz=timezone.utc))
            if p.answer is None:
                est.append(float("nan"))
                lo.append(float("nan"))
                hi.append(float("nan"))
                continue
            est.append(p.answer.estimate)
            lo.append(_fin(p.answer.lo))
            hi.append(_fin(p.answer.hi))
            if p.includes_zero:
                zx.append(xs[-1])
                zy.append(p.answer.estimate)
        ax.fill_between(xs, lo, hi, color=c, alpha=0.2, linewidth=0)
        ax.plot(xs, est, "-o", color=c, markersize=3.5, linewidth=1.6, label=ln.label)
        if zx:
            ax.plot(zx, zy, "o", markersize=8, markerfacecolor="white", markeredgecolor=c, markeredgewidth=1.5)
    partial = [k for k in range(len(s.lines[0].points) if s.lines else 0)
               if any(ln.points[k].missing_devices for ln in s.lines)]
    for k in partial:
        p = s.lines[0].points[k]
        ax.axvspan(datetime.fromtimestamp(p.t0, tz=timezone.utc), datetime.fromtimestamp(p.t1, tz=timezone.utc),
                   color="#ffc107", alpha=0.15, linewidth=0)
    ax.axhline(0, color="#555", linewidth=0.8)
    ax.set_ylabel("estimated count per %d s" % s.step)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%Y-%m-%d\n%H:%M", tz=timezone.utc))
    ax.grid(alpha=0.3)
    pct = "%g%%" % round(100 * s.confidence, 3)
    ax.set_title((title + "\n" if title else "") + "shaded: %s interval per point; hollow: interval includes 0 (UTC)"
                 % pct + ("; yellow: some devices sent no release" if partial else ""), fontsize=10)
    if len(s.lines) <= 12:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_answers(answers: Sequence[Answer], path: str, title: str = "") -> str:
    """Horizontal bars (estimate) with interval whiskers, first answer on top; returns ``path``."""
    check_path(path)
    plt = _plt()
    n = len(answers)
    fig, ax = plt.subplots(figsize=(9, max(2.2, 0.34 * n + 1.3)), dpi=110)
    ys = list(range(n))[::-1]
    est = [a.estimate for a in answers]
    zero = [a.lo <= 0 <= a.hi for a in answers]
    ax.barh(ys, est, color=["#c9ccd3" if z else "#7aa6dc" for z in zero], height=0.6)
    lo_err = [a.estimate - a.lo if math.isfinite(a.lo) else 0 for a in answers]
    hi_err = [a.hi - a.estimate if math.isfinite(a.hi) else 0 for a in answers]
    ax.errorbar(est, ys, xerr=[lo_err, hi_err], fmt="none", ecolor="#1d2433", capsize=3, linewidth=1.2)
    ax.set_yticks(ys)
    ax.set_yticklabels([("%d. " % a.rank if a.rank else "") + str(a.item)[:40] for a in answers], fontsize=8)
    ax.axvline(0, color="#555", linewidth=0.8)
    ax.grid(axis="x", alpha=0.3)
    a0 = answers[0] if answers else None
    sub = ""
    if a0 is not None:
        sub = "%g%% interval per item (not simultaneous); %d release(s) from %d device(s), %s to %s" % (
            round(100 * a0.confidence, 3), a0.releases, len(a0.devices), iso(a0.since), iso(a0.until))
    ax.set_xlabel("estimated count (grey: interval includes 0)")
    import textwrap

    # wrapped: one line of ~140 characters ran past the right edge of the 9-inch figure
    ax.set_title((title + "\n" if title else "") + textwrap.fill(sub, 95), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
