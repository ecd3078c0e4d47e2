"""``pansketch audit``: measure a lower bound on ε for a device configuration.

Runs the real device core (pansketch.agent.recorder.Recorder, persist, restart,
release encoding) on pairs of neighbouring streams, attacks the release
view and the intrusion view with likelihood-ratio tests, and reports a
Clopper–Pearson 95 % lower bound on ε next to the claimed ε
(Jagielski et al. 2020). A sound device gives bounds at or below the
claim; a bound above it is a privacy bug (exit status 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pansketch.agent.params import ParamError, Params

from pansketch.host_tools.audit import engine, report, scenarios
from pansketch.host_tools.audit.model import ModelError

# The grid of the docs/PRIVACY.md table: window and keep mode,
# dlap eps = 1/2 and 1, dgauss rho = 1/2, a small Count-Min sketch.
TABLE_BASE = {"device": "audit", "salt": "audit-fleet-salt", "kind": "cms", "d": 2, "w": 8, "clip": 1,
              "window_s": 600, "persist_s": 86400}
TABLE_MODES = ({"mode": "window"}, {"mode": "keep", "epoch_s": 60})
TABLE_BUDGETS = (("dlap", "1/2"), ("dlap", "1"), ("dgauss", "1/2"))
# persist_noise = "shadow" (window mode): the internal noise at 2x the arrays, the output noise at 1x.
# Persists are explicit scenario operations, so persist_s only decides what "auto" would pick
# (60 s: 9 persists per 600 s epoch, auto would pick shadow too) and when a tick persists.
TABLE_SHADOW = ({"mode": "window", "persist_s": 60, "persist_noise": "shadow"},)
TABLE_SHADOW_BUDGETS = (("dlap", "1/2"), ("dgauss", "1/2"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "audit",
        help="measure an empirical lower bound on epsilon for a device config (real device code path)",
        description=__doc__.split("\n\n")[1] + "\n\nThe sketch is audited with the configured kind, d, clip, "
        "mode, windows, epochs, mechanism and budget, but only W columns (--w): the width does not enter "
        "the calibration (sensitivity d*clip), and a narrow sketch makes each real run cheap. The config's "
        "state directory is never touched: every run uses a fresh temporary directory (/dev/shm when present). "
        "Method, table and limits: docs/PRIVACY.md, 'Empirical audit'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="agent TOML config (pansketch-agent's); required unless --table")
    p.add_argument("--trials", type=int, default=100_000,
                   help="evaluation trials per scenario and view, both worlds together (default 100000); "
                        "a separate calibration set of half as many chooses tests and thresholds")
    p.add_argument("--view", choices=("release", "intrusion", "both"), default="both",
                   help="release: every release of the window; intrusion: one read of all RAM and every "
                        "flash copy at the attacker's chosen moment, plus all releases (default both)")
    p.add_argument("--json", action="store_true", help="one JSON object per line (per scenario, then summaries)")
    p.add_argument("--csv", action="store_true", help="CSV: a header row, then the fields of --json, one row each")
    p.add_argument("--seed", type=int, default=1, help="seed of the sampled trials (default 1)")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help="audit only this scenario (repeatable; --list-scenarios shows them)")
    p.add_argument("--list-scenarios", action="store_true", help="list the scenarios of each mode and exit")
    p.add_argument("--w", type=int, default=8, help="columns of the audited sketch (default 8)")
    p.add_argument("--delta", type=float, default=engine.DEFAULT_DELTA,
                   help="delta at which a dgauss rho-zCDP claim is converted to (eps, delta) (default %(default)g, "
                        "the host's [query] delta default: pansketch status and the dashboard give the same eps)")
    p.add_argument("--real", action="store_true",
                   help="run every trial on the real code path (slow) instead of the verified model")
    p.add_argument("--real-trials", type=int, default=1000,
                   help="cap on trials per world and set on the real code path (default 1000)")
    p.add_argument("--verify-trials", type=int, default=10,
                   help="real trials per world that must match the model bit for bit (default 10)")
    p.add_argument("--table", metavar="DOC",
                   help="regenerate the audit table in DOC (docs/PRIVACY.md) over the fixed grid: window and "
                        "keep mode, dlap eps 1/2 and 1, dgauss rho 1/2, and window mode with persist_noise = "
                        "shadow (dlap eps 1/2, dgauss rho 1/2), both views; ignores --config")
    p.set_defaults(func=run)


def _err(msg: str) -> int:
    print("pansketch audit: %s" % msg, file=sys.stderr)
    return 2


def _params(args: argparse.Namespace) -> Params:
    from pansketch.agent.pi import config as agent_config

    cfg = agent_config.load(args.config)
    p = cfg.params
    raw = {"device": p.device, "salt": p.salt, "kind": p.kind, "d": p.d, "w": args.w, "clip": p.clip,
           "mode": p.mode, "window_s": p.window_s, "epoch_s": p.epoch_s, "mechanism": p.mechanism,
           "budget": "%d/%d" % p.budget, "persist_s": p.persist_s, "persist_noise": p.persist_noise}
    if p.mode == "tree":  # window_s is derived from the levels
        del raw["window_s"]
        raw["levels"] = p.levels
    if p.kind == "dcs":  # the config's domain: b levels + 1 and the reading map (not the defaults)
        raw["b"] = p.b
        raw["map"] = list(p.map)
    if p.kind == "strhh":  # the config's item length = prefix levels
        raw["len"] = p.b
    if p.kind == "dbits":  # w is bits per level: a multiple of 8
        raw["w"] = max(8, (args.w + 7) // 8 * 8)
    return Params(raw)


def run(args: argparse.Namespace) -> int:
    if args.list_scenarios:
        for mode, scs in scenarios.MODE_SCENARIOS.items():
            print("%s:" % mode)
            for sc in scs:
                print("  %-26s %s" % (sc.name, sc.doc))
        return 0
    if args.trials < 8:
        return _err("--trials must be at least 8")
    if args.w < 2:
        return _err("--w must be at least 2")
    if not 0 < args.delta < 1:
        return _err("--delta must be in (0, 1)")
    views = list(engine.VIEWS) if args.view == "both" else [args.view]
    log = (lambda m: None) if args.json or args.csv else (lambda m: print(m, file=sys.stderr, flush=True))
    if args.table:
        return _table(args, log)
    if not args.config:
        return _err("give --config agent.toml (or --table DOC to regenerate the docs table)")
    try:
        p = _params(args)
    except (OSError, ValueError, ParamError) as exc:
        return _err("config error: %s" % exc)
    try:
        scenarios.for_mode(p.mode, args.scenario)
    except ValueError as exc:
        return _err(str(exc))
    log("auditing %s %dx%d (w reduced to %d), %s, %s %s, %d trials per scenario and view"
        % (p.kind, p.d, args.w, args.w, p.mode, p.mechanism, "%d/%d" % p.budget, args.trials))
    t = time.time()
    try:
        audits, summary = engine.audit(p, views, args.trials, args.seed, args.scenario, args.real,
                                       args.real_trials, args.verify_trials, args.delta, progress=log)
    except ModelError as exc:
        # the view is not a fixed function of (world, noise draws): noise or shape depend on the data
        print("pansketch audit: FLAGGED: %s" % exc, file=sys.stderr)
        return 1
    per = [a.results[v] for a in audits for v in views]
    if args.json:
        print(report.json_lines(per, summary))
    elif args.csv:
        from pansketch.host_tools.query import csvout

        csvout.from_json_lines(report.json_lines(per, summary), sys.stdout)
    else:
        print(report.text(summary))
        notes = sorted({n for r in per for n in r.notes})
        for n in notes[:10]:
            print("note: %s" % n)
        print("(%.0f s; claims: %s)" % (time.time() - t, engine.claim_of(p, args.delta).conversion))
    return 1 if any(r.flagged for r in summary) else 0


def table_rows(trials: int, seed: int, views: list[str], log: Any = None,
               grid: tuple = TABLE_BUDGETS, modes: tuple = TABLE_MODES,
               shadow_grid: tuple = TABLE_SHADOW_BUDGETS, shadow_modes: tuple = TABLE_SHADOW) -> list[engine.Result]:
    rows = []
    for g, ms in ((grid, modes), (shadow_grid, shadow_modes)):
        for mode in ms:
            for mech, budget in g:
                cfg = dict(TABLE_BASE, mechanism=mech, budget=budget, **mode)
                p = Params(cfg)
                if log:
                    log("%s %s %s%s" % (mode["mode"], mech, budget, " shadow" if p.shadow else ""))
                _, summary = engine.audit(p, views, trials, seed, progress=log)
                rows.extend(summary)
    return rows


def _table(args: argparse.Namespace, log: Any) -> int:
    try:
        with open(args.table, encoding="utf-8") as f:
            doc = f.read()
        report.replace_table(doc, "")
    except (OSError, ValueError) as exc:
        return _err(str(exc))
    views = list(engine.VIEWS) if args.view == "both" else [args.view]
    rows = table_rows(args.trials, args.seed, views, log)
    with open(args.table, "w", encoding="utf-8") as f:
        f.write(report.replace_table(doc, report.markdown(rows)))
    print(report.markdown(rows))
    return 1 if any(r.flagged for r in rows) else 0
