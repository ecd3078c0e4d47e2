"""Neighbouring streams for the audit, one registry per release mode.

A scenario is a timed list of operations on one device; the two neighbouring
worlds run it with and without the ``target`` operation (one event of weight
``sign * clip`` on the target item). Times are in epochs from an epoch-aligned
start, so the same scenario serves ``window`` mode (epoch = window) and
``keep`` mode. Every operation is a real device call:

==============  ================================================================
``bg``          ``Recorder.add`` of a few fixed background events
``target``      ``Recorder.add(target, sign * clip)`` -- world 1 only
``persist``     ``Recorder.persist(now)`` (what ``tick`` calls every persist_s)
``restart``     power cut: RAM is lost, a new ``Recorder`` boots on the same
                directory with a new ``Rng`` (events since the last persist are lost)
``tick``        ``Recorder.tick(now)`` at an epoch boundary: the release
``flush``       ``Recorder.flush(now)``: an early release (``part`` > 0 follows)
``outbox_fail`` the next outbox write fails (flash full): the release is not
                written and its range [elo, ehi) grows (``ehi`` > ``elo`` + 1)
``outbox_heal`` the outbox is writable again
``ack``         the host acknowledges the oldest pending release (it leaves the
                outbox; the audit keeps its bytes: it was published)
``fault``       the next write of one file (``arg`` = target:stage[:exc], device.Fault:
                state, tmp or marker; before, before-counters, mid-counters,
                after-counters, before-trailer or at-close; enospc, eio or memory)
                fails in the op right after it; every byte written stays on the
                audited flash (device.FlashLog)
==============  ================================================================

A scenario may set ``outbox_max`` (the Recorder's limit of unacknowledged
releases): a full outbox fails the release like a full flash.

Adding a release mode (e.g. ``tree``) means adding its scenarios to
:data:`MODE_SCENARIOS`; the device runner, the model and the distinguishers
are generic (they learn which noise draws land in which array).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

F = Fraction


@dataclass(frozen=True)
class Op:
    kind: str
    at: Fraction  # time in epochs after the start
    arg: str = ""  # "fault": target:stage[:exc] (device.Fault)


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    ops: tuple[Op, ...]
    sign: int = 1  # weight of the target event: sign * clip
    outbox_max: int = 0  # Recorder(outbox_max=...): 0 = no limit

    def negated(self) -> "Scenario":
        return Scenario(self.name + "-neg", self.doc + " (weight -clip)", self.ops, -self.sign, self.outbox_max)


OP_KINDS = ("bg", "target", "persist", "restart", "tick", "flush", "outbox_fail", "outbox_heal", "ack", "fault")


def _ops(*spec: tuple[str, ...]) -> tuple[Op, ...]:
    out = tuple(Op(x[0], F(x[1]), x[2] if len(x) > 2 else "") for x in spec)
    for op in out:
        if op.kind not in OP_KINDS:
            raise ValueError("unknown scenario op %r" % op.kind)
    return out


COMMON: tuple[Scenario, ...] = (
    Scenario("no-persist", "event in an epoch released without any persist (nz = 2: Z_int and Z_out)",
             _ops(("bg", "1/10"), ("target", "3/10"), ("bg", "6/10"), ("tick", "1"))),
    Scenario("before-persist", "event counted before the first persist (masked by Z_int in state.bin)",
             _ops(("bg", "1/10"), ("target", "2/10"), ("persist", "3/10"), ("bg", "4/10"),
                  ("persist", "5/10"), ("bg", "6/10"), ("tick", "1"))),
    Scenario("between-persists", "event between two persists (masked by the fresh draw Y)",
             _ops(("bg", "1/10"), ("persist", "2/10"), ("target", "3/10"), ("persist", "4/10"),
                  ("bg", "5/10"), ("tick", "1"))),
    Scenario("after-last-persist", "event after the last persist, then the release (Y and Z_out)",
             _ops(("bg", "1/10"), ("persist", "2/10"), ("bg", "25/100"), ("target", "3/10"), ("tick", "1"))),
    Scenario("restart-after-event", "event, persist, power cut and restart (refresh at boot)",
             _ops(("bg", "1/10"), ("persist", "2/10"), ("target", "3/10"), ("persist", "4/10"),
                  ("restart", "5/10"), ("bg", "6/10"), ("tick", "1"))),
    Scenario("after-restart", "event right after a restart (masked by the boot refresh)",
             _ops(("bg", "1/10"), ("persist", "2/10"), ("restart", "3/10"), ("target", "4/10"),
                  ("bg", "5/10"), ("tick", "1"))),
    Scenario("restart-between-persists", "restart between two persists, event after it",
             _ops(("bg", "1/10"), ("persist", "2/10"), ("bg", "3/10"), ("restart", "4/10"),
                  ("target", "5/10"), ("persist", "6/10"), ("bg", "7/10"), ("persist", "8/10"), ("tick", "1"))),
    Scenario("flush-part0", "event in an early release (flush), the epoch goes on as part 1",
             _ops(("bg", "1/10"), ("target", "2/10"), ("persist", "3/10"), ("flush", "5/10"),
                  ("bg", "6/10"), ("tick", "1"))),
    Scenario("flush-part1", "event in part 1, after an early release",
             _ops(("bg", "1/10"), ("flush", "3/10"), ("persist", "4/10"), ("target", "5/10"), ("tick", "1"))),
    Scenario("outbox-failure", "the release fails (flash full): range [e, e+2) released one epoch late",
             _ops(("bg", "1/10"), ("target", "3/10"), ("persist", "5/10"), ("outbox_fail", "9/10"),
                  ("tick", "1"), ("outbox_heal", "11/10"), ("bg", "12/10"), ("persist", "14/10"), ("tick", "2"))),
    Scenario("outbox-limit", "the outbox holds outbox_max unacknowledged releases: range [e, e+2) released late",
             _ops(("bg", "1/10"), ("tick", "1"), ("bg", "11/10"), ("target", "13/10"), ("persist", "15/10"),
                  ("tick", "2"), ("ack", "21/10"), ("bg", "22/10"), ("tick", "3")), outbox_max=1),
    Scenario("second-epoch", "event in the next epoch, after a release",
             _ops(("bg", "1/10"), ("persist", "5/10"), ("tick", "1"), ("bg", "12/10"), ("target", "14/10"),
                  ("persist", "16/10"), ("tick", "2"))),
)

# Failed writes: a write that was attempted counts as written. The flash log
# (device.FlashLog) keeps every byte that reached flash, also of a removed .new/.tmp, and a
# "fault" op makes the next write of that file (in the next op) fail at one stage.
def _persist_fault(stage: str, exc: str = "enospc") -> Scenario:
    return Scenario("persist-fail-%s%s" % (stage, "" if exc == "enospc" else "-" + exc),
                    "a state write fails (%s) %s; the event comes after it, an intrusion reads RAM and the partial "
                    "copy" % (exc, stage.replace("-", " ")),
                    _ops(("bg", "1/10"), ("persist", "2/10"), ("bg", "25/100"), ("fault", "3/10", "state:%s:%s"
                                                                                    % (stage, exc)),
                         ("persist", "35/100"), ("target", "4/10"), ("bg", "5/10"), ("persist", "6/10"),
                         ("bg", "7/10"), ("tick", "1")))


def _commit_fault(target: str, stage: str, exc: str = "enospc") -> Scenario:
    name = "commit-fail-%s" % ("at-marker" if target == "marker" else stage)
    if exc != "enospc":
        name += "-" + exc
    return Scenario(name, "a release commit fails (%s, %s %s); the event comes after it, before the next "
                    "persist (RAM - .tmp and the next flash increment)" % (exc, target, stage.replace("-", " ")),
                    _ops(("bg", "1/10"), ("persist", "5/10"),
                         ("fault", "9/10", "%s:%s:%s" % (target, stage, exc)), ("tick", "1"), ("bg", "12/10"),
                         ("target", "13/10"), ("persist", "14/10"), ("bg", "16/10"), ("tick", "2")))


FAULTS: tuple[Scenario, ...] = (
    _persist_fault("before"), _persist_fault("mid-counters"), _persist_fault("after-counters", "eio"),
    _persist_fault("before-trailer"), _persist_fault("at-close"), _persist_fault("mid-counters", "memory"),
    _commit_fault("tmp", "mid-counters"), _commit_fault("tmp", "at-close"), _commit_fault("marker", "before"),
    _commit_fault("tmp", "before-counters", "memory"),
)

# A release that failed and was retried with a grown range [e, e+2), and the accumulator that
# follows it: the events after the retried release are counted into an accumulator opened on the
# retry path (after a commit whose .tmp is on flash, or after a full outbox), and an intrusion in
# that window reads it. A core that opened it without Z_int would show those events exactly; the
# scenarios that end at the retried release count nothing there and cannot see that.
def _retried(name: str, doc: str, fail: tuple[str, ...], outbox_max: int = 0) -> Scenario:
    return Scenario(name, doc + "; the event is counted in the accumulator after the retried release",
                    _ops(("bg", "1/10"), ("persist", "5/10"), fail, ("tick", "1"), ("outbox_heal", "11/10"),
                         ("bg", "12/10"), ("persist", "14/10"), ("tick", "2"), ("bg", "21/10"),
                         ("target", "23/10"), ("persist", "25/10"), ("bg", "27/10"), ("tick", "3")),
                    outbox_max=outbox_max)


RETRIED: tuple[Scenario, ...] = (
    _retried("retry-grown-next", "the release fails (flash full), is retried with [e, e+2)",
             ("outbox_fail", "9/10")),
    _retried("retry-grown-next-at-close", "the commit fails at close (its .tmp on flash), is retried with [e, e+2)",
             ("fault", "9/10", "tmp:at-close")),
    _retried("retry-grown-next-at-marker", "the marker write fails after a complete .tmp, retried with [e, e+2)",
             ("fault", "9/10", "marker:before")),
    Scenario("retry-grown-next-limit", "the outbox holds outbox_max unacknowledged releases: the second release "
             "waits and goes out as [e, e+2) after an acknowledgement; the event is counted in the accumulator "
             "after it",
             _ops(("bg", "1/10"), ("tick", "1"), ("bg", "11/10"), ("persist", "15/10"), ("tick", "2"),
                  ("ack", "21/10"), ("bg", "22/10"), ("tick", "3"), ("bg", "31/10"), ("target", "33/10"),
                  ("persist", "35/10"), ("bg", "37/10"), ("ack", "38/10"), ("tick", "4")), outbox_max=1),
)

# Tree mode (agent/tree.py): the same persist/restart/flush positions, each
# event lands in every open node (L accumulators); a tick releases every node
# that closes, so ticks at epochs 1 and 2 also release the level-1 node
# [e, e+2) that holds the event. A failed outbox write keeps the node and
# retries it (no range growth), so the outbox scenarios are tree-specific.
TREE: tuple[Scenario, ...] = tuple(
    Scenario(s.name, s.doc + "; tree: the level-1 node closes at epoch 2",
             s.ops + ((Op("bg", F(15, 10)), Op("tick", F(2))) if all(o.at <= 1 for o in s.ops) else ()),
             s.sign, s.outbox_max)
    for s in COMMON if not s.name.startswith("outbox")) + (
    Scenario("tree-all-levels", "event in the first leaf; ticks until the level-2 node [e, e+4) closes: "
             "the event is in three releases (summed evidence)",
             _ops(("bg", "1/10"), ("target", "3/10"), ("persist", "5/10"), ("tick", "1"), ("bg", "15/10"),
                  ("tick", "2"), ("bg", "25/10"), ("tick", "3"), ("tick", "4"))),
    Scenario("tree-outbox-failure", "the release of the closing nodes fails (flash full) and is retried later",
             _ops(("bg", "1/10"), ("target", "3/10"), ("persist", "5/10"), ("outbox_fail", "9/10"),
                  ("tick", "1"), ("outbox_heal", "11/10"), ("bg", "12/10"), ("tick", "12/10"), ("tick", "2"))),
    Scenario("tree-retry-next", "the release of the closing nodes fails (flash full) and is retried; the event "
             "is counted in the leaf after the retried release",
             _ops(("bg", "1/10"), ("persist", "5/10"), ("outbox_fail", "9/10"), ("tick", "1"),
                  ("outbox_heal", "11/10"), ("bg", "12/10"), ("tick", "12/10"), ("bg", "13/10"),
                  ("target", "14/10"), ("persist", "15/10"), ("bg", "16/10"), ("tick", "2"))),
    Scenario("tree-retry-next-at-close", "the commit of the closing nodes fails at close (its .tmp on flash) and "
             "is retried; the event is counted in the leaf after the retried release",
             _ops(("bg", "1/10"), ("persist", "5/10"), ("fault", "9/10", "tmp:at-close"), ("tick", "1"),
                  ("bg", "12/10"), ("tick", "12/10"), ("bg", "13/10"), ("target", "14/10"),
                  ("persist", "15/10"), ("bg", "16/10"), ("tick", "2"))),
)

# mode -> scenarios; a new mode registers its own list here.
TREE_FAULTS: tuple[Scenario, ...] = tuple(
    Scenario(s.name, s.doc + "; tree: the level-1 node closes at epoch 2",
             s.ops + ((Op("bg", F(15, 10)), Op("tick", F(2))) if all(o.at <= 1 for o in s.ops) else ()),
             s.sign, s.outbox_max) for s in FAULTS)

MODE_SCENARIOS: dict[str, tuple[Scenario, ...]] = {
    "window": COMMON + (COMMON[2].negated(),) + FAULTS + RETRIED,
    "keep": COMMON + (COMMON[2].negated(),) + FAULTS + RETRIED,
    "tree": TREE + (TREE[2].negated(),) + TREE_FAULTS,
}


def for_mode(mode: str, names: Sequence[str] | None = None) -> list[Scenario]:
    """The scenarios of a mode, optionally only those named (error if unknown)."""
    if mode not in MODE_SCENARIOS:
        raise ValueError("the audit has no scenarios for mode %r (known: %s)" % (mode, ", ".join(MODE_SCENARIOS)))
    allsc = list(MODE_SCENARIOS[mode])
    if not names:
        return allsc
    byname = {s.name: s for s in allsc}
    bad = [n for n in names if n not in byname]
    if bad:
        raise ValueError("unknown scenario(s) %s for mode %s (known: %s)" % (", ".join(bad), mode, ", ".join(byname)))
    return [byname[n] for n in names]
