"""What an audit finds: one view's result, one scenario's audit, and the summary over scenarios.

Here, below both audit engines (engine: the linear model of the noise draws;
bits: kind dbits on the real code path), so that neither imports the other
for its result types.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pansketch.host_tools.audit import model as mdl
from pansketch.host_tools.audit.scenarios import Scenario


@dataclass
class Result:
    mode: str
    view: str
    scenario: str
    mech: str
    budget: str
    eps_claimed: float
    delta: float
    eps_lower: float
    trials: int  # evaluation trials, both worlds
    calibration_trials: int
    fp: int
    fn: int
    path: str  # "model" (verified, sampled with numpy) or "real" (every trial runs the Recorder)
    statistic: str
    threshold: float
    verified_real_trials: int
    kind: str = ""
    d: int = 0
    w: int = 0
    cal_eps: float = 0.0
    notes: list[str] = field(default_factory=list)
    persist_noise: str = ""  # the resolved persist scheme audited: "refresh" or "shadow"

    @property
    def flagged(self) -> bool:
        return self.eps_lower > self.eps_claimed

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["flagged"] = self.flagged
        if not math.isfinite(out["threshold"]):
            out["threshold"] = None
        return out


@dataclass
class ScenarioAudit:
    scenario: Scenario
    model: mdl.Model
    results: dict[str, Result]
    cal: dict[str, float]  # view -> best calibration ε bound


def summarize(audits: list[ScenarioAudit], view: str) -> Result:
    """The view's result: the scenario whose test was best on its calibration set."""
    best = max(audits, key=lambda a: a.cal[view])
    r = copy.deepcopy(best.results[view])
    r.scenario = "%s (chosen on calibration of %d scenarios)" % (r.scenario, len(audits))
    return r
