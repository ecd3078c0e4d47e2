"""The recorder for a configuration: the one place that picks the device core's recorder class.

pansketch.agent.recorder.Recorder (window, keep; kinds cms, cs, dcs), pansketch.agent.tree.TreeRecorder
(mode tree) and pansketch.agent.dbits.DistinctRecorder (kind dbits, a Recorder with
another state) share one interface. Here, above all three, so that none of them
imports another to be chosen; each is imported only when used (a board in
window mode never loads tree or dbits, one in tree mode never loads
agent/recorder.py: ~5 KB of heap from .mpy, firmware/memory.py TREE_CODE_*).
"""

# Every recorder is built on pansketch.agent.accum.Core: imported here, with the firmware's other modules at
# start-up, so its objects sit among theirs and not between them and the sketch's arrays (a frozen
# Pico W needs two contiguous 32 KiB blocks for d*w = 8192 under refresh, benchmarks/firmware_unix.py).
import pansketch.agent.accum  # noqa: F401


def make(params, root, now, rng=None, log=None, outbox_max=0):
    """The recorder for ``params``: pansketch.agent.tree.TreeRecorder (mode tree),
    pansketch.agent.dbits.DistinctRecorder (kind dbits, which keeps bits) or Recorder
    (window, keep; kinds cms, cs, dcs); all have the same interface.
    Params refuses tree mode with kinds other than cms and cs."""
    if params.mode == "tree":
        from pansketch.agent.tree import TreeRecorder

        return TreeRecorder(params, root, now, rng=rng, log=log, outbox_max=outbox_max)
    if params.kind == "dbits":
        from pansketch.agent.dbits import DistinctRecorder

        return DistinctRecorder(params, root, now, rng=rng, log=log, outbox_max=outbox_max)
    from pansketch.agent.recorder import Recorder

    return Recorder(params, root, now, rng=rng, log=log, outbox_max=outbox_max)


make_recorder = make  # the name the kinds branch used
