"""Shared by tests/test_e2e_dcs.py and the tests that build on it: FROZEN, T0, _fleet, _query, _stop."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pansketch.host_tools.store.sqlite import Store
from tests.support.e2e import (REPO, agent_env, agent_toml, host_toml, pansketch_cmd,
                                    run_agent, start_mosquitto, wait_for)


T0 = 1_700_000_000 - 1_700_000_000 % 3600  # in the past: the host quarantines windows from the future


FROZEN = ("--clock-start", str(T0 + 100), "--clock-speed", "0")


def _fleet(tmp_path, streams, kind, timeout=120, db="fleet.db", **sketch):
    """mosquitto, ``pansketch aggregate`` and one agent of ``kind`` per stream (agent_toml's ``sketch``
    arguments), each fed its stream with a frozen clock; every release stored, nothing rejected."""
    broker = start_mosquitto(tmp_path)
    log = open(tmp_path / "aggregate.log", "wb")
    hcfg = host_toml(str(tmp_path / "host.toml"), broker.port, db, fleet_extra='kind = "%s"' % kind)
    agg = subprocess.Popen(pansketch_cmd("aggregate", "--config", hcfg), stdout=log, stderr=log, env=agent_env(),
                           cwd=REPO)
    try:
        assert wait_for(lambda: b"subscribing" in open(tmp_path / "aggregate.log", "rb").read(), 20)
        time.sleep(0.3)
        for i, lines in enumerate(streams):
            cfg = agent_toml(str(tmp_path / ("a%d.toml" % i)), "pi-%d" % i, broker.port, str(tmp_path / ("s%d" % i)),
                             kind=kind, **sketch)
            r = run_agent("feed", cfg, "--timeout", "60", "--insecure-seed", "%s-%d" % (kind, i), *FROZEN,
                          input=("\n".join(lines) + "\n").encode(), timeout=timeout)
            assert r.returncode == 0, r.stderr.decode()
        with Store(str(tmp_path / db), readonly=True) as st:
            assert wait_for(lambda: st.release_count() >= len(streams), 30)
            assert st.release_count() == len(streams) and st.rejection_count() == 0
    except BaseException:
        agg.send_signal(signal.SIGTERM)
        agg.wait(15)
        broker.stop()
        raise
    return broker, agg, log, hcfg


def _stop(broker, agg, log):
    agg.send_signal(signal.SIGTERM)
    assert agg.wait(15) == 0
    log.close()
    broker.stop()


def _query(hcfg, *args):
    q = subprocess.run(pansketch_cmd("query", "--config", hcfg, *args, "--json"), capture_output=True,
                       env=agent_env(), cwd=REPO, timeout=120)
    assert q.returncode == 0, q.stderr.decode()
    return [json.loads(x) for x in q.stdout.decode().splitlines() if x.strip()]
