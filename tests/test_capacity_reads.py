"""The capacity plan's read rows (host_tools/bench/capacity.py) from the fleetscale benchmark's figures:
each read's CPU on the largest store measured, carried to N devices and a month of windows by its
fitted law; the code measured first is the one planned for; without a law there are no rows."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pansketch.host_tools.bench import capacity

FS = {"rows": [{"devices": 1000, "windows": 168, "code": "this", "freq": 0.2, "page_fleet": 0.07},
               {"devices": 10000, "windows": 720, "code": "this", "freq": 0.25, "page_fleet": 0.25},
               {"devices": 10000, "windows": 720, "code": "before", "freq": 9.0, "page_fleet": 9.0}],
      "growth": {"this": {"freq": {"exp_devices": 0.1, "exp_windows": 0.5},
                          "page_fleet": {"exp_devices": 1.0, "exp_windows": 0.0}},
                 "before": {"freq": {"exp_devices": 2.0, "exp_windows": 2.0}}}}


def test_read_rows_follow_the_law_from_the_largest_store(tmp_path: Any, capsys: Any) -> None:
    fs = tmp_path / "fleetscale.json"
    fs.write_text(json.dumps(FS))
    out = tmp_path / "capacity.md"
    assert capacity.main(["--pg", str(tmp_path / "none.json"), "--fleetscale", str(fs), "--devices", "1e4,1e5",
                          "--window-s", "7200", "--out", str(out)]) == 0
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.read_text().splitlines()]
    rows = {c[0]: c[2:] for c in cells if c[0].startswith("CPU")}
    # freq: 0.25 s x 10^0.1 at 10^5; a month of 2-hour windows is 360 = half the 720 measured: x 0.5^0.5
    assert rows[capacity.READS["freq"]] == ["%.3g s" % (0.25 * 0.5 ** 0.5), "%.3g s" % (0.25 * 10 ** 0.1 * 0.5 ** 0.5)]
    assert rows[capacity.READS["page_fleet"]] == ["0.25 s", "2.5 s"]
    assert "write path's rows left out" in capsys.readouterr().err


def test_no_growth_law_no_read_rows() -> None:
    with pytest.raises(SystemExit):
        capacity.reads({"rows": FS["rows"][:1], "growth": {}})
