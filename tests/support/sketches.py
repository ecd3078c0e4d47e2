"""Device parameters and exact (noise-free) counters, as the tests build them.

``params_with(BASE)`` gives a test module its ``params(**overrides)``; ``exact(p, events)`` is what
a device's sketch holds after ``events`` before any noise (what a release minus its noise must be).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Union

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.params import Params
from pansketch.agent.sketch import Sketch, new_counters

Event = Union[str, tuple[str, int]]


def params_with(base: Mapping[str, Any]) -> Callable[..., Params]:
    """``params(device=None, **overrides)``: Params of ``base`` with the overrides over it. A positional
    ``device`` sets the device id; an override of None drops the key (the field's derived default,
    e.g. window_s in tree mode)."""

    def params(device: Optional[str] = None, **kw: Any) -> Params:
        cfg = dict(base)
        if device is not None:
            cfg["device"] = device
        cfg.update(kw)
        return Params({k: v for k, v in cfg.items() if v is not None})

    return params


def exact(p: Params, events: Iterable[Event]) -> list[int]:
    """The counters of ``p``'s sketch after ``events`` (items, or (item, weight) pairs), without noise."""
    if p.kind == "dcs":
        from pansketch.agent.dcs import DyadicSketch

        s: Any = DyadicSketch(p.b, p.d, p.w, hashing.salt_prefix(p.salt), p.clip, p.map, new_counters(p.cells))
    else:
        s = Sketch(p.kind, p.d, p.w, hashing.salt_prefix(p.salt), p.clip)
    for e in events:
        item, w = e if isinstance(e, tuple) else (e, 1)
        s.update(item, w)
    return list(s.counters)


def exact_array(p: Params, events: Iterable[Event]) -> np.ndarray:
    """:func:`exact` as an int64 array."""
    return np.array(exact(p, events), dtype=np.int64)
