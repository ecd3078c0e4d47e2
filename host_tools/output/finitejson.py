"""JSON stays JSON: non-finite numbers become ``null`` with the reason beside them.

``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity``, which no strict
JSON parser accepts (and ``allow_nan=False`` raises instead, which made the
dashboard answer 500). A noisy sketch can give such numbers honestly: a CDF
over a noisy total of readings at or below 0 is undefined (NaN), a rank
interval the sketch cannot bound is infinite. :func:`finite` replaces each
with ``None`` and records why in the enclosing object under
``null_reasons`` (``{"cdf": "nan: ...", "rank_hi[1]": "+inf: ..."}``), so a
reader sees that a value is absent and why, and every output (CLI ``--json``,
``--csv``, the dashboard's JSON API) stays parseable.
"""

from __future__ import annotations

import math
from typing import Any

REASONS_KEY = "null_reasons"
_WHY = {"nan": "nan: no defined value for this selection (e.g. a noisy count at or below 0)",
        "inf": "+inf: not bounded by what the releases hold",
        "-inf": "-inf: not bounded by what the releases hold"}


def _why(x: float) -> str:
    return _WHY["nan" if math.isnan(x) else "inf" if x > 0 else "-inf"]


def _bad(x: Any) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def finite(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, scalars) with every non-finite float as None; a dict that held one
    gets ``null_reasons``: key (``key[i]`` inside a list) -> why. Returns ``obj`` itself when nothing
    needed changing, so the common case copies nothing."""
    if isinstance(obj, dict):
        reasons: dict[str, str] = {}
        out: dict[Any, Any] = {}
        changed = False
        for k, v in obj.items():
            if _bad(v):
                out[k], reasons[str(k)] = None, _why(v)
            elif isinstance(v, (list, tuple)) and any(_bad(x) for x in v):
                out[k] = [None if _bad(x) else finite(x) for x in v]
                reasons.update({"%s[%d]" % (k, i): _why(x) for i, x in enumerate(v) if _bad(x)})
            else:
                out[k] = finite(v)
                changed = changed or out[k] is not v
                continue
            changed = True
        if not changed:
            return obj
        if reasons:
            out[REASONS_KEY] = dict(out.get(REASONS_KEY) or {}, **reasons)
        return out
    if isinstance(obj, (list, tuple)):
        new = [None if _bad(x) else finite(x) for x in obj]
        return obj if all(a is b for a, b in zip(new, obj)) else new
    if _bad(obj):
        return None
    return obj
