"""What the command-line tools show a user, with the real CLIs as subprocesses.

* a closed stdout (`pansketch status | head -1`) ends status, query and
  `pansketch-agent check` quietly with exit 141, no BrokenPipeError
  traceback; a closed stderr does not stop `feed` from delivering;
* `pansketch aggregate` says what it subscribed to and prints one line per
  stored release (`-q`: warnings only), and `--until-idle` exits without a
  "disconnected ... reconnecting" warning;
* `pansketch-agent check` connects to the broker (OK, refused, unreachable;
  `--offline` skips it) and warns about the examples' placeholder salt;
* the documented `persist_s` defaults are the code's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pansketch.agent.params import Params
from pansketch.agent.pi.tomlconf import PLACEHOLDER_SALTS
from pansketch.host_tools.ingest.aggregator import Aggregator
from tests.support.broker import free_port, mosquitto, needs_mosquitto, start_mosquitto  # noqa: F401  (fixture)
from tests.support.aggregator_mqtt import publish_all
from tests.support.host import SALT, encoded, host_cfg, params, topic

REPO = Path(__file__).resolve().parent.parent
EXIT_PIPE = 141
NOISE = ("Traceback", "BrokenPipeError", "Exception ignored")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.pop("PANSKETCH_INSECURE_SEED", None)
    return e


def pansketch(*args: str) -> list[str]:
    return [sys.executable, "-m", "pansketch.host_tools.cli", *args]


def agent(*args: str) -> list[str]:
    return [sys.executable, "-m", "pansketch.agent.pi.daemon", *args]


def run_closed_stdout(cmd: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """Run with stdout a pipe whose reader is already gone (what `| head -1` leads to)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, input=stdin, env=env(), cwd=REPO, timeout=60)
    finally:
        os.close(w)


def host_toml(path: Path, db: str, port: int = 1883, salt: str = SALT, extra: str = "") -> str:
    path.write_text('[broker]\nhost = "127.0.0.1"\nport = %d\n[aggregator]\ndb = "%s"\n[fleet]\nsalt = "%s"\n%s'
                    % (port, db, salt, extra))
    return str(path)


def agent_toml(path: Path, port: int, salt: str = SALT, broker_extra: str = "") -> str:
    path.write_text('[broker]\nhost = "127.0.0.1"\nport = %d\n%s\n[device]\nid = "ux-1"\nsalt = "%s"\n'
                    '[sketch]\nd = 2\nw = 64\n[storage]\ndir = "state"\n' % (port, broker_extra, salt))
    return str(path)


def stored_db(tmp_path: Path) -> str:
    cfg = host_cfg(tmp_path)
    agg = Aggregator(cfg)
    for dev in ("dev-a", "dev-b"):
        assert agg.handle(topic(dev), encoded(params(dev), fill=3)).stored
    agg.close()
    return cfg.aggregator.db


# -- closed pipes ---------------------------------------------------------------
def test_closed_stdout_ends_status_query_and_check_quietly(tmp_path):
    conf = host_toml(tmp_path / "host.toml", stored_db(tmp_path))
    items = ["item-%d" % i for i in range(2000)]  # far more output than a pipe buffer
    for cmd in (pansketch("status", "--config", conf),
                pansketch("status", "--config", conf, "--json"),
                pansketch("query", "--config", conf, "freq", *items, "--json"),
                pansketch("query", "--config", conf, "freq", *items),
                agent("check", "--offline", "--config", agent_toml(tmp_path / "agent.toml", 1))):
        r = run_closed_stdout(cmd)
        err = r.stderr.decode()
        assert r.returncode == EXIT_PIPE, (cmd[2:4], r.returncode, err)
        assert not any(n in err for n in NOISE), (cmd[2:4], err)


def test_head_dash_one_prints_one_line_and_no_traceback(tmp_path):
    conf = host_toml(tmp_path / "host.toml", stored_db(tmp_path))
    items = " ".join("item-%d" % i for i in range(2000))
    line = "%s -m pansketch.host_tools.cli query --config %s freq %s --json | head -1" % (sys.executable, conf, items)
    r = subprocess.run(["sh", "-c", line], capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.count("\n") == 1 and r.stdout.startswith('{"item": "item-0"'), r
    assert r.stderr == "", r.stderr


@needs_mosquitto
def test_feed_with_closed_stderr_still_delivers(tmp_path, mosquitto):
    from tests.support.e2e import AggregatorThread

    conf = agent_toml(tmp_path / "agent.toml", mosquitto.port)
    hconf = tmp_path / "h.toml"
    hconf.write_text('[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "ux-host"\n[aggregator]\ndb = "%s"\n'
                     '[fleet]\nsalt = "%s"\n' % (mosquitto.port, tmp_path / "h.db", SALT))
    host = AggregatorThread(str(hconf))  # the host whose acknowledgement ends the feed
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(agent("feed", "--config", conf, "--timeout", "30"), input=b"a\nb\na\n", stdout=w,
                           stderr=w, env=env(), cwd=REPO, timeout=60)
    finally:
        os.close(w)
        host.stop()
    assert p.returncode == 0
    assert os.listdir(tmp_path / "state" / "outbox") == []  # the host stored the release and acknowledged it


# -- aggregator output ----------------------------------------------------------
@needs_mosquitto
def test_aggregate_reports_subscription_and_each_stored_release(tmp_path, mosquitto):
    conf = host_toml(tmp_path / "host.toml", "agg.db", mosquitto.port)
    msgs = [(topic("ux-a"), encoded(params("ux-a", w=32), seq=0)),
            (topic("ux-b"), encoded(params("ux-b", w=32, mode="keep", epoch_s=600), seq=0)),
            (topic("ux-a"), b"junk")]

    def aggregate(*extra: str) -> str:
        proc = subprocess.Popen(pansketch("aggregate", "--config", conf, "--until-idle", "5", *extra), env=env(),
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        try:
            line = ""
            if "-q" not in extra:  # publish once the subscription is in place
                line = proc.stderr.readline()
                assert "connected to 127.0.0.1:%d as pansketch-aggregator; subscribing pansketch/+/release" \
                    % mosquitto.port in line
                line += proc.stderr.readline()
                assert "subscribed to pansketch/+/release (QoS 1, persistent session); storing releases in %s" \
                    % (tmp_path / "agg.db") in line
                publish_all(mosquitto.port, msgs)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert out == ""
        assert "disconnected" not in err and "reconnecting" not in err, err
        assert "rejected message on pansketch/ux-a/release" in err
        return line + err

    err = aggregate()
    assert re.search(r"stored ux-a seq 0: window \d{4}-\d\d-\d\dT\d\d:00Z \(3600 s\), \d+ bytes", err), err
    assert re.search(r"stored ux-b seq 0: epochs \S+\.\.\S+ \(window \S+\), \d+ bytes", err), err
    assert "aggregator stopped: 2 stored, 0 duplicates, 1 rejected" in err
    # -q: published while it is down (the persistent session keeps them): only the rejection is shown
    publish_all(mosquitto.port, msgs)
    err = aggregate("-q")
    assert "stored" not in err and "subscrib" not in err and "duplicate" not in err, err


# -- pansketch-agent check -------------------------------------------------------
@needs_mosquitto
def test_check_tries_the_broker(tmp_path, mosquitto):
    ok = subprocess.run(agent("check", "--config", agent_toml(tmp_path / "a.toml", mosquitto.port)),
                        capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"^broker      127\.0\.0\.1:%d: OK, connection accepted \(\d+ ms\)$" % mosquitto.port, ok.stdout,
                     re.M), ok.stdout
    assert ok.stderr == ""

    down = agent_toml(tmp_path / "b.toml", free_port())
    r = subprocess.run(agent("check", "--config", down), capture_output=True, text=True, env=env(), cwd=REPO,
                       timeout=60)
    assert r.returncode == 1
    assert "config %s is valid" % down in r.stdout
    assert re.search(r"^broker      127\.0\.0\.1:\d+: FAILED: \[Errno 111\] Connection refused$", r.stdout, re.M), r.stdout
    assert "--offline skips this test" in r.stderr
    r = subprocess.run(agent("check", "--offline", "--config", down), capture_output=True, text=True, env=env(),
                       cwd=REPO, timeout=60)
    assert r.returncode == 0 and "not tried (--offline)" in r.stdout and r.stderr == ""


@needs_mosquitto
def test_check_reports_a_refused_login(tmp_path):
    b = start_mosquitto(tmp_path, conf_extra="allow_anonymous false")
    try:
        conf = agent_toml(tmp_path / "a.toml", b.port, broker_extra='username = "ux-1"\npassword = "wrong"')
        r = subprocess.run(agent("check", "--config", conf, "--timeout", "5"), capture_output=True, text=True,
                           env=env(), cwd=REPO, timeout=60)
    finally:
        b.stop()
    assert r.returncode == 1
    assert re.search(r"^broker      .*: FAILED: broker refused the connection: (Not authorized|Bad user name or password)$",
                     r.stdout, re.M), r.stdout


def test_placeholder_salts_are_flagged_by_check_and_aggregate(tmp_path):
    # the placeholders are the ones the examples really use
    assert 'salt = "change-me-fleet-salt"' in (REPO / "examples" / "agent.toml").read_text()
    for board in (REPO / "deploy" / "board").glob("*.json"):
        assert re.search(r'"salt": "(%s)"' % "|".join(map(re.escape, PLACEHOLDER_SALTS)), board.read_text()), board
    for salt in ("change-me-fleet-salt", "our-fleet-salt-2026"):
        r = subprocess.run(agent("check", "--offline", "--config", agent_toml(tmp_path / "a.toml", 1, salt=salt)),
                           capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
        assert r.returncode == 0
        assert r.stderr.startswith("pansketch-agent: WARNING: device.salt is the example placeholder %r" % salt)
    r = subprocess.run(agent("check", "--offline", "--config", agent_toml(tmp_path / "a.toml", 1)),
                       capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert "WARNING" not in r.stderr
    conf = host_toml(tmp_path / "host.toml", "x.db", free_port(), salt="change-me-fleet-salt")
    r = subprocess.run(pansketch("aggregate", "--config", conf, "--until-idle", "0.5"), capture_output=True,
                       text=True, env=env(), cwd=REPO, timeout=60)
    assert "WARNING fleet.salt is the example placeholder 'change-me-fleet-salt'" in r.stderr


# -- docs ---------------------------------------------------------------------
def test_documented_persist_s_default_is_the_code_default():
    default = Params({"device": "x", "salt": "12345678"}).persist_s
    agent_md = (REPO / "docs" / "AGENT.md").read_text()
    m = re.search(r"^\| `persist_s` \| (\d+) \|", agent_md, re.M)
    assert m and int(m.group(1)) == default
    firmware_md = (REPO / "docs" / "FIRMWARE.md").read_text()
    m = re.search(r"`persist_s` \((\d+):", firmware_md)
    assert m and int(m.group(1)) == default


def test_systemd_unit_checks_the_config_offline():
    """A broker outage must not keep the agent from starting (and counting): ExecStartPre skips the broker."""
    unit = (REPO / "deploy" / "systemd" / "pansketch-agent.service").read_text()
    pre = [ln for ln in unit.splitlines() if ln.startswith("ExecStartPre=")]
    assert pre and all(" check --offline " in ln for ln in pre), pre
