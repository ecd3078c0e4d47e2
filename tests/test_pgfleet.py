"""pansketch.host_tools.bench.pgfleet at a small size: it builds its PostgreSQL store (the bulk copy's
device rows counted by the trigger in one transaction past its per-row locks), its two answers with and
without the counts are equal (it exits otherwise), the answers with the counts read no device rows (it
exits otherwise), and it writes its figures."""

from __future__ import annotations

import json
from typing import Any

from pansketch.host_tools.bench import pgfleet
from tests.support import pg as pgsupport

pytestmark = pgsupport.marks()


def test_pgfleet_runs_and_checks_its_answers(tmp_path: Any) -> None:
    assert pgfleet.main(["--devices", "30", "--windows", "40", "--shards", "2", "--rounds", "1",
                         "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "pgfleet.json").read_text())
    assert out["devices"] == 30 and out["windows"] == 40 and set(out["cpu_s"]) == {"freq", "series"}
    assert all(out["cpu_s"][m]["counts"]["median"] > 0 for m in out["cpu_s"])
