"""One flag: a device whose contribution to a window is out of line with the fleet's.

The record shared by the per-cell test (pansketch.host_tools.query.influence) and the distinct-count
test (pansketch.host_tools.query.dbitsflag); docs/HOST.md "Flagged devices" says what each field means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Flag:
    device: str
    win_s: int
    win: int
    kind: str
    score: float  # the largest residual in allowances (> 1: flagged)
    cell: tuple[int, int, int]  # (level, row, column)
    residual: float  # events the cell holds beyond what the device's share predicts (signed)
    share: float  # the device's part of the fleet's cell (Y_i / Y; may exceed 1 when the others are negative)
    cells: int  # how many cells of the device are beyond their allowance
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "win_s": self.win_s, "window": self.win, "kind": self.kind,
                "score": round(self.score, 1), "cell": list(self.cell), "residual": round(self.residual, 1),
                "share": round(self.share, 3), "cells": self.cells, "reason": self.reason}
