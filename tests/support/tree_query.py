"""Shared by tests/test_tree_query.py and the tests that build on it: E0, EP, record_epochs, tparams."""

from __future__ import annotations

from pansketch.agent.params import Params
from pansketch.agent.recorders import make
from pansketch.agent.rng import DeterministicSource, Rng
from tests.support.host import SALT


EP = 3600


E0 = 1_700_000_000 // (EP * 256) * 256  # a multiple of 2**8 epochs


def tparams(device="tree-a", salt=SALT, **kw):
    cfg = {"device": device, "salt": salt, "kind": "cs", "d": 4, "w": 128, "mode": "tree", "levels": 5,
           "epoch_s": EP, "mechanism": "dgauss", "budget": "1/2", "persist_s": 86400}
    cfg.update(kw)
    return Params(cfg)


def record_epochs(p, root, epochs, seed, start=E0):
    """One list of events per epoch, from epoch ``start``; returns the releases in order."""
    rec = make(p, root, start * p.epoch_s, rng=Rng(DeterministicSource(seed)), log=lambda _m: None)
    for k, events in enumerate(epochs):
        rec.add_many(events)
        rec.tick((start + k + 1) * p.epoch_s)
    return [rec.outbox.read(s) for s in rec.outbox.pending()]
