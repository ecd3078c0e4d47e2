"""Exact event recovery per failure case.

    PYTHONPATH=. python -m tests.failpaths_report            # this checkout
    PYTHONPATH=/old/checkout python -m tests.failpaths_report  # another one (negative control)

Every stage of every write x {ENOSPC, MemoryError, EIO} for each kind x mode
x scheme (tests/test_failpaths.py, exact null-space check); prints, per
failure case (stage kind x file), the cases whose views recover exact events,
and those that leave the scratch buffer non-zero.
"""

import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from tests.support import failpaths as t
def main() -> None:
    only = sys.argv[1:]
    tot: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for case in t.CASES:
        name = "-".join(case)
        if only and name not in only:
            continue
        cfg = t.cfg_for(*case)
        with tempfile.TemporaryDirectory() as td:
            stages = t._stages(cfg, Path(td) / "st")
            for j, kind, path in stages:
                f = "state" if "state" in path else ("marker" if "released" in path else "release")
                for exc in t.EXCS:
                    a = t.run_py(cfg, Path(td) / ("%d%sa" % (j, exc)), True, j, exc)
                    b = t.run_py(cfg, Path(td) / ("%d%sb" % (j, exc)), False, j, exc)
                    leak = bool(t.leak_moments(a, b))
                    for key in ("%s %s %s" % (f, kind, "memory" if exc == "memory" else "oserror"),
                                "ALL " + name):
                        tot[key][0] += leak
                        tot[key][1] += 1
                        tot[key][2] += bool(a["dirty"])
        print("done", name, file=sys.stderr, flush=True)
    for k in sorted(tot):
        print("%-40s exact recovery %5d / %5d (%3.0f %%)   scratch not zero after it %5d" % (
            k, tot[k][0], tot[k][1], 100.0 * tot[k][0] / tot[k][1], tot[k][2]))


if __name__ == "__main__":
    main()
